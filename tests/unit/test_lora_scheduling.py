"""LoRA in the scheduler, pure: the adapter salts a request's prefix-cache hashes, --max-loras bounds the distinct
adapters of the running batch (FCFS: a request that would add one waits), the ledger record keeps the adapter, and
--lora-modules parses as vLLM's NAME=PATH pairs."""

from __future__ import annotations

from collections import deque

import pytest

from common.lora import parse_lora_modules
from common.sampling_fields import SamplingParams
from scheduler_svc.core import step_records
from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.policy import PolicyConfig, schedule
from scheduler_svc.core.request import Request
from scheduler_svc.ledger.codec import final_fields, spec_fields
from scheduler_svc.ledger.store import _decode_request

BS = 4
PROMPT = list(range(1, 17))


def req(rid: str, lora: str = "", seq: int = 0, salt: str = "") -> Request:
    return Request(request_id=rid, prompt_ids=list(PROMPT), sampling=SamplingParams(max_tokens=4), arrival_seq=seq,
                   lora_name=lora, lora_path=f"/adapters/{lora}" if lora else "", cache_salt=salt)


def test_adapter_salts_the_prefix_hashes():
    base, a, a2, b = req("x"), req("y", "a"), req("z", "a"), req("w", "b")
    h = {r.request_id: r.full_block_hashes(BS) for r in (base, a, a2, b)}
    assert h["y"] == h["z"]  # same adapter, same prompt: shared
    assert len({h["x"][0], h["y"][0], h["w"][0]}) == 3  # never shared across adapters or with the base model
    # The adapter salt composes with the tenant salt; the base model's hashes are unchanged by this feature.
    tenant_only = req("u", salt="t").full_block_hashes(BS)[0]
    assert req("s", "a", salt="t").full_block_hashes(BS)[0] not in (h["y"][0], tenant_only)


def test_prefix_cache_hits_only_under_the_same_adapter():
    cfg = PolicyConfig(max_num_batched_tokens=64, max_num_seqs=8, block_size=BS, max_loras=4)
    pool = BlockPool(32)
    first = req("first", "a")
    schedule(deque([first]), [], pool, cfg)
    for i, bid in enumerate(first.block_ids[: len(PROMPT) // BS]):
        pool.register(bid, first.full_block_hashes(BS)[i], tuple(PROMPT[i * BS : (i + 1) * BS]))
    running = [first]
    for rid, lora, hits in (("other", "b", 0), ("base", "", 0), ("same", "a", 3)):
        r = req(rid, lora, seq=len(running))
        out = schedule(deque([r]), running, pool, cfg)
        assert r in out.admitted and r.num_cached_tokens == hits * BS, (rid, r.num_cached_tokens)


def test_max_loras_bounds_the_distinct_adapters_running():
    cfg = PolicyConfig(max_num_batched_tokens=256, max_num_seqs=16, block_size=BS, max_loras=2)
    pool = BlockPool(256)
    waiting = deque(req(f"r{i}", lora, seq=i) for i, lora in enumerate(["a", "", "a", "b", "c", "b", ""]))
    running: list[Request] = []
    out = schedule(waiting, running, pool, cfg)
    # a, base, a, b run; c would be a third adapter: it waits, and FCFS keeps the ones behind it waiting too.
    assert [r.request_id for r in out.admitted] == ["r0", "r1", "r2", "r3"]
    assert out.admission_stopped_by == step_records.STOP_MAX_LORAS
    assert [r.request_id for r in waiting] == ["r4", "r5", "r6"]
    # Without --enable-lora (max_loras 0) there is no such limit.
    out = schedule(deque(req(f"s{i}", x, seq=i) for i, x in enumerate("abc")), [], BlockPool(64),
                   PolicyConfig(max_num_batched_tokens=256, max_num_seqs=16, block_size=BS))
    assert len(out.admitted) == 3


def test_ledger_record_keeps_the_adapter():
    r = req("r", "a")
    flat = spec_fields(r) + final_fields(r)
    back = _decode_request("r", dict(zip(flat[::2], flat[1::2], strict=True)), b"", b"", "0")
    assert (back.lora_name, back.lora_path) == ("a", "/adapters/a")
    old = {k: v for k, v in zip(flat[::2], flat[1::2], strict=True) if k not in ("lora", "lora_path")}
    assert _decode_request("r", old, b"", b"", "0").lora_name == ""  # records written before LoRA: the base model


def test_lora_modules_flag():
    assert parse_lora_modules("a=/x b=/y,c=/z") == [("a", "/x"), ("b", "/y"), ("c", "/z")]
    assert parse_lora_modules(None) == []
    with pytest.raises(ValueError, match="word 'a' must be NAME=PATH"):
        parse_lora_modules("a")
    with pytest.raises(ValueError, match="names 'a' twice"):
        parse_lora_modules("a=/x a=/y")
