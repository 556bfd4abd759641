"""The session's Hugging Face reference (model and tokenizer), built once per machine and read by every pytest process.

transformers loading the bundled GGUF is the correctness oracle, but the load dequantizes every tensor and walks the
49k-string vocabulary (30-60 s on the 2-core box), and under `-n 2` each pytest process paid it. The first process
to ask loads it through transformers' GGUF path and writes the float32 weights (safetensors), the config and the
tokenizer to `<root>/<sha256 of the GGUF>/{model,tokenizer}/` (each built only when first asked for); the others
wait on a file lock and read the folder back in a second or two. The writer also keeps the GGUF-loaded model's
logits on probe ids (and the tokenizer's ids of a probe text), and every reader checks it gives the same bits, so
the copy cannot drift from the oracle. `<root>` (tests/conftest.py) outlives the run, keyed by the versions the load
depends on (`default_cache_dir`): later runs on the machine skip the transformers load.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
from pathlib import Path

import safetensors.torch
import torch

PROBE_TEXT = "The capital of France is Paris. 1 + 1 = 2; def f(x): return x * 2  # ünïcode"
PROBE_IDS = [1, 504, 3458, 282, 4649, 314, 7042, 30, 216, 33, 1232, 216, 33, 446, 216, 34, 43, 3014, 275, 17, 104]
_DONE = "complete"


@functools.cache
def checkpoint_hash(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()[:32]


def default_cache_dir() -> str:
    """~/.cache/llmserve/hf-reference/<key>: the key hashes what the saved model and tokenizer depend on besides the
    GGUF (whose hash names the folder below it): the transformers and torch versions and this module's source."""
    import importlib.metadata

    versions = " ".join(importlib.metadata.version(p) for p in ("transformers", "torch", "gguf"))
    key = hashlib.sha256(versions.encode() + Path(__file__).read_bytes()).hexdigest()[:16]
    return str(Path.home() / ".cache" / "llmserve" / "hf-reference" / key)


def save_hf_checkpoint(model, path: Path) -> None:
    """The dequantized float32 weights and a config without the GGUF quantization entry (save_pretrained refuses a
    model loaded from a GGUF)."""
    path.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    config["architectures"] = [type(model).__name__]
    (path / "config.json").write_text(json.dumps(config, indent=1))
    tied = model.config.tie_word_embeddings
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    safetensors.torch.save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


def _probe_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([PROBE_IDS])).logits[0]


def _build_model(gguf_path: str, folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    save_hf_checkpoint(model, folder)
    torch.save(_probe_logits(model), folder / "probe.pt")


def _build_tokenizer(gguf_path: str, folder: Path) -> None:
    from transformers import AutoTokenizer

    d, f = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
    tokenizer.save_pretrained(str(folder))
    (folder / "probe.json").write_text(json.dumps(tokenizer(PROBE_TEXT).input_ids))


def _built(gguf_path: str, root: str, part: str, build) -> Path:
    """`<root>/<hash of the GGUF>/<part>/`, built by whichever process takes the lock first; a half-written one (a
    killed run) is built again."""
    folder = Path(root) / checkpoint_hash(gguf_path) / part
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not (folder / _DONE).exists():
            build(gguf_path, folder)
            (folder / _DONE).write_text(gguf_path)
    return folder


def load_tokenizer(gguf_path: str, root: str):
    """transformers' tokenizer of the GGUF, as its first load in this run saved it."""
    from transformers import AutoTokenizer

    folder = _built(gguf_path, root, "tokenizer", _build_tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    want = json.loads((folder / "probe.json").read_text())
    assert tokenizer(PROBE_TEXT).input_ids == want, "the saved tokenizer encodes unlike the GGUF one"
    return tokenizer


def load_model(gguf_path: str, root: str):
    """transformers' float32 model of the GGUF, as its first load in this run saved it."""
    from transformers import AutoModelForCausalLM

    folder = _built(gguf_path, root, "model", _build_model)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert torch.equal(_probe_logits(model), torch.load(folder / "probe.pt")), "saved model != the GGUF one"
    _LOADED[id(model)] = (model, folder)  # by identity: a copy (merged, cast) is another model
    return model


_LOADED: dict[int, tuple] = {}  # id -> (the model, its folder): what `shared_result` may share


def shared_result(model, kind: str, key, compute):
    """`compute()` for the session's HF model, computed once per run by whichever pytest process asks first and
    read back by the others (JSON, under `kind`/sha256 of `key`); any other model computes it here."""
    loaded = _LOADED.get(id(model))
    if loaded is None or loaded[0] is not model:
        return compute()
    # per run (LLMSERVE_TEST_HF_RESULTS_DIR): `compute` is a test's code, which may change between runs
    folder = Path(os.environ.get("LLMSERVE_TEST_HF_RESULTS_DIR") or loaded[1]) / loaded[1].parent.name
    path = folder / kind / f"{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(compute()))
            tmp.rename(path)
        return json.loads(path.read_text())
