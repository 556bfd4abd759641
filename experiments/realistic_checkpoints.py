"""Random-weight checkpoints at a realistic size for the peer benchmark and the quantized-format comparison: a
bfloat16 Llama in Llama-3.2-1B's shape (hidden 2048, 16 layers, intermediate 8192; 1.2B parameters with the bundled
tokenizer's 49,152-token vocabulary) with that tokenizer beside it, so that llmserve and vLLM load the same
directory, and the same weights rewritten in the quantized formats llmserve reads (FP8 128x128 blocks, AWQ int4,
GPTQ int4, compressed-tensors W8A8 int8), each quantized by the rules of the test that checks the format against
transformers (tests/service/test_*_model.py: one quantizer per format, reused here).

    python -m experiments.realistic_checkpoints --root /tmp/llama1b                 # bf16/, then fp8/ awq/ gptq/ w8a8/
    python -m experiments.realistic_checkpoints --root /tmp/llama1b --formats bf16  # the bfloat16 directory only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from experiments.load_memory import write_checkpoint

FORMATS = ("bf16", "fp8", "awq", "gptq", "w8a8")
GROUP = 128  # AWQ's and GPTQ's group size here (their most common one)


def save_bundled_tokenizer(path: str) -> int:
    """The bundled GGUF's tokenizer as an HF tokenizer in `path`; returns its vocabulary size."""
    from transformers import AutoTokenizer

    from worker_svc.model.loader import default_model_path

    folder, name = os.path.split(default_model_path())
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok.save_pretrained(path)
    return len(tok)


def write_bf16(path: str, layers: int, hidden: int, intermediate: int) -> int:
    """The bfloat16 directory (config, one safetensors file, tokenizer); returns its bytes of weights."""
    os.makedirs(path, exist_ok=True)
    vocab = save_bundled_tokenizer(path)
    return write_checkpoint(path, layers, hidden, intermediate, vocab)


def _quantizer(fmt: str):
    """(quantize(name, weight float32) -> tensors to store, quantization_config) of a format, from its test."""
    if fmt == "fp8":
        from tests.service.test_fp8_model import FORMATS as FP8
        from tests.service.test_fp8_model import fp8_quantize

        config, suffix, strategy = FP8["fp8_block"]

        def fp8(name: str, w: torch.Tensor) -> dict:
            codes, scale = fp8_quantize(w, strategy)
            return {name: codes, name.removesuffix("weight") + suffix: scale}
        return fp8, config
    if fmt == "awq":
        from tests.service.test_awq_model import awq_config, awq_quantize

        return (lambda name, w: _renamed(name, awq_quantize(w, GROUP)[0])), awq_config(GROUP)
    if fmt == "gptq":
        from tests.service.test_gptq_model import gptq_config, gptq_quantize

        gen = torch.Generator().manual_seed(0)
        return ((lambda name, w: _renamed(name, gptq_quantize(w, GROUP, True, False, False, gen)[0])),
                gptq_config(GROUP, sym=True, v2=False, act_order=False))
    if fmt == "w8a8":
        from tests.service.test_compressed_int_model import compressed_config, int8_quantize

        return ((lambda name, w: _renamed(name, int8_quantize(w, "channel")[0])),
                compressed_config(None, True, "channel"))
    raise ValueError(f"--formats: unknown format {fmt!r} (one of {', '.join(FORMATS)})")


def _renamed(name: str, tensors: dict) -> dict:
    return {name.removesuffix("weight") + k: v for k, v in tensors.items()}


def write_quantized(src: str, dst: str, fmt: str) -> None:
    """`src` (the bfloat16 directory) rewritten in `fmt`: its projections quantized one tensor at a time."""
    from tests.service.test_awq_model import PROJECTIONS

    quantize, qconfig = _quantizer(fmt)
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(src, name), dst)
    out = {}
    with safe_open(os.path.join(src, "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
                out |= quantize(name, t.float())
            else:
                out[name] = t
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": qconfig}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="the folder that gets one directory per format")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    args = ap.parse_args()
    write_formats(args.root, args.formats.split(","), args.layers, args.hidden, args.intermediate)


def write_formats(root: str, formats: list[str], layers: int, hidden: int, intermediate: int) -> None:
    """One directory per format under `root`; the bfloat16 one is written first where it is missing."""
    bf16 = os.path.join(root, "bf16")
    for fmt in formats:
        if fmt == "bf16" or not os.path.isfile(os.path.join(bf16, "config.json")):
            size = write_bf16(bf16, layers, hidden, intermediate)
            print(f"{bf16}: {size / 1e9:.2f} GB of bfloat16 weights", flush=True)
        if fmt != "bf16":
            write_quantized(bf16, os.path.join(root, fmt), fmt)
            print(f"{os.path.join(root, fmt)} written", flush=True)


if __name__ == "__main__":
    main()
