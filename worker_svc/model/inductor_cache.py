"""What every compiled forward (compiled.py, compiled_hybrid.py) shares with inductor and dynamo: the persistent graph
cache, and room in dynamo's per-function caches for the graphs of every model this process compiles."""

from __future__ import annotations

import os

import torch

_CACHE_ENTRIES = 0  # the compiled functions' cache entries the models of this process may need

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "llmserve", "inductor")


def use_cache_dir(path: str | None) -> str:
    """Persist inductor's compiled graphs under `path` (default DEFAULT_CACHE_DIR): read by every compile after
    this call, so a restart loads them instead of compiling again. $TORCHINDUCTOR_CACHE_DIR, if set, wins."""
    path = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", path or DEFAULT_CACHE_DIR)
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    return path


def reserve_cache_entries(n: int) -> None:
    """Room in torch.compile's per-function caches for `n` more graphs: never fall back to dynamic shapes or stop
    compiling at serving time. The graphs guard on the model they trace, so each model built in this process adds
    its own entries to the functions' shared caches."""
    global _CACHE_ENTRIES
    _CACHE_ENTRIES += n
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, _CACHE_ENTRIES)
