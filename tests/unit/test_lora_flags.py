"""--enable-lora with the compiled forward is refused at start naming both flags (never silently run eager)."""

from __future__ import annotations

import pytest

from common.config import parse
from common.validation import ConfigError
from worker_svc.config import WorkerConfig
from worker_svc.model.compiled import wants_compiled


@pytest.mark.parametrize("level", [1, 2, 3])
def test_optimization_level_with_enable_lora_is_refused(level):
    with pytest.raises(ConfigError, match=rf"--optimization-level {level} does not run with --enable-lora"):
        wants_compiled(parse(WorkerConfig, [f"-O{level}", "--enable-lora"]))


def test_eager_with_enable_lora_is_accepted():
    assert not wants_compiled(parse(WorkerConfig, ["-O0", "--enable-lora"]))
    assert not wants_compiled(parse(WorkerConfig, ["--enable-lora"]))
