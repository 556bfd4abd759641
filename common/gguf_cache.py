"""An opt-in disk cache of what llmserve parses out of a GGUF file: set LLMSERVE_GGUF_CACHE_DIR to a directory.

Reading a GGUF costs seconds on a CPU before any work: `gguf.GGUFReader` walks every vocabulary string of the
metadata one numpy slice at a time (~10 s for the bundled SmolLM2's 49k tokens and merges on a loaded 2-core box),
and the worker then dequantizes every tensor. Each worker and each scheduler start pays it again. With the variable
set, the first process stores its result (the worker: float32 weights as safetensors with the model config; the
scheduler: the assembled tokenizer), and later starts read that back in well under a second.

A process that finds no entry parses under a lock on it (`building`): starts beside it on the same GGUF (the ranks of
a tensor-parallel group, a worker and its scheduler) wait and read the entry instead of parsing too.

Entries are keyed by the file's absolute path, size and modification time plus `FORMAT`, so a changed file is
parsed again; bump `FORMAT` when what the loader or the tokenizer builds from a GGUF changes. The test suite points
the variable at a fresh directory per run (so each run's first load still goes through the real parser); unset,
the default, nothing is cached.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator

log = logging.getLogger("llmserve.gguf_cache")

ENV = "LLMSERVE_GGUF_CACHE_DIR"
FORMAT = 3  # 2: GGUF tokenizers cut words by their tokenizer.ggml.pre; 3: more pre values, SentencePiece GGUFs


def entry(path: str, kind: str) -> str | None:
    """Where the cached `kind` ("weights.safetensors", "tokenizer.json") of the GGUF at `path` lives, or None when
    caching is off. The entry may not exist yet."""
    directory = os.environ.get(ENV)
    if not directory:
        return None
    path = os.path.abspath(path)
    st = os.stat(path)
    key = hashlib.sha256(f"{FORMAT}|{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    return os.path.join(directory, f"{os.path.basename(path)}-{key}-{kind}")


def store(target: str, write: Callable[[str], None]) -> None:
    """`write(tmp_path)`, then an atomic rename to `target`: concurrent starts (e.g. the ranks of a tensor-parallel
    group) each write their own file, and a reader never sees half of one. A cache that cannot be written (disk
    full, read-only directory) is logged and skipped: the caller already has what it parsed."""
    tmp = None
    try:
        directory = os.path.dirname(target)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        os.close(fd)
        write(tmp)
        os.replace(tmp, target)
    except OSError as e:
        log.warning("%s: not cached (%s)", target, e)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def building(target: str) -> Iterator[None]:
    """Held while this process looks for `target` and, if absent, parses and stores it: one parse per entry however
    many start at once. An flock on `target`.lock, released when the file closes, also if the holder dies; a
    directory that cannot hold the lock (read-only) parses without one."""
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        lock = open(f"{target}.lock", "w")
    except OSError as e:
        log.warning("%s: parsing without the cache's lock (%s)", target, e)
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
