"""The worker's allocator setting while it loads (worker_svc/model/load_heap.py)."""

import pytest

from worker_svc.model import load_heap


def test_default_threshold_is_64_kib():
    assert load_heap.load_threshold({}) == 64 * 1024


def test_zero_leaves_glibc_alone_and_glibcs_own_variable_wins():
    assert load_heap.load_threshold({load_heap.ENV: "0"}) is None
    assert load_heap.load_threshold({"MALLOC_MMAP_THRESHOLD_": "131072", load_heap.ENV: "4096"}) is None
    assert load_heap.load_threshold({load_heap.ENV: "4096"}) == 4096


@pytest.mark.parametrize("raw", ["64k", "-1", str(64 * 1024 * 1024)])
def test_bad_values_name_the_setting(raw):
    with pytest.raises(ValueError, match=load_heap.ENV):
        load_heap.load_threshold({load_heap.ENV: raw})


def test_loading_inside_the_context_keeps_working():
    with load_heap.bounded_heap():
        block = bytearray(8 * 1024 * 1024)  # above the load threshold: mapped on its own
        del block
    assert bytearray(1024 * 1024)  # and after it, under the serving threshold
