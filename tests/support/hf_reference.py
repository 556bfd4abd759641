"""The session's Hugging Face reference (model and tokenizer), built once per run and read by every pytest process.

transformers loading the bundled GGUF is the correctness oracle, but the load dequantizes every tensor and walks the
49k-string vocabulary (30-60 s on the 2-core box), and under `-n 2` each pytest process paid it. The first process
to ask loads it through transformers' GGUF path and writes the float32 weights (safetensors), the config and the
tokenizer to `<root>/<sha256 of the GGUF>/`; the others wait on a file lock and read that folder back in a second
or two. The writer also keeps the GGUF-loaded model's logits on a probe prompt, and every reader checks its model
gives the same bits, so the copy cannot drift from the oracle.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

import safetensors.torch
import torch

PROBE_TEXT = "The capital of France is Paris. 1 + 1 = 2; def f(x): return x * 2  # ünïcode"
_DONE = "complete"


def checkpoint_hash(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()[:32]


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


def _probe_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _build(gguf_path: str, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
    save_hf_checkpoint(model, folder)
    tokenizer.save_pretrained(str(folder))
    ids = tokenizer(PROBE_TEXT).input_ids
    probe = {"ids": ids, "logits": _probe_logits(model, ids)}
    torch.save(probe, folder / "probe.pt")
    (folder / _DONE).write_text(gguf_path)


def reference_folder(gguf_path: str, root: str) -> Path:
    """`<root>/<hash>/`, built by whichever process gets the lock first; a half-written folder (a killed run) is
    built again."""
    os.makedirs(root, exist_ok=True)
    folder = Path(root) / checkpoint_hash(gguf_path)
    with open(f"{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not (folder / _DONE).exists():
            _build(gguf_path, folder)
    return folder


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    probe = torch.load(folder / "probe.pt")
    assert tokenizer(PROBE_TEXT).input_ids == probe["ids"], "the cached tokenizer encodes unlike the GGUF one"
    return tokenizer


def load_model(folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    probe = torch.load(folder / "probe.pt")
    assert torch.equal(_probe_logits(model, probe["ids"]), probe["logits"]), "cached model != the GGUF one"
    return model
