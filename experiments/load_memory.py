"""Peak host memory and time of loading an HF checkpoint (bfloat16, float32, FP8, AWQ or GPTQ): a ref's loader
against ours.

Writes a random-weight bfloat16 Llama (safetensors, one file), then in a fresh subprocess per loader loads it the
way the worker does (`load_model_weights`, then `LlamaModel` in bfloat16 on the CPU, prepack off) and reports the
peak resident set (ru_maxrss), the resident set once the load is done (what the process keeps), and the time.
With `--quantization fp8` the projections are written as block-scaled FP8 (`weight_scale_inv` per 128x128 block,
Qwen3-FP8's layout) and the checkpoint carries its `quantization_config`; with `awq` / `gptq` they are random int4
codes in AutoAWQ's GEMM / AutoGPTQ's layout (group 128, float16 scales, zero points). With `--tensor-parallel-size N
--rank R` the process loads rank R's shard (and builds that rank's model), as one worker of a tensor-parallel group.

    python -m experiments.load_memory --layers 16 --ref main     # ~1.2B parameters, 2.5 GB of safetensors
    python -m experiments.load_memory --layers 28 --hidden 3072 --checkpoint /tmp/llama3b   # ~3.2B, 6.4 GB, kept
    python -m experiments.load_memory --layers 8 --hidden 1024 --intermediate 4096 --vocab 32000 --quantization fp8
    python -m experiments.load_memory --layers 8 --vocab 32000 --quantization awq --tensor-parallel-size 2 --rank 0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import torch
from worker_svc.model.loader import load_model_weights
from worker_svc.model.decoder import LlamaModel
from worker_svc.parallel.sharding import Shard, local_config
shard = Shard(int(sys.argv[3]), int(sys.argv[2]))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
try:  # the worker's allocator setting while it loads (load_heap.py)
    from worker_svc.model.load_heap import bounded_heap
except ImportError:  # a tree without it: glibc's defaults
    import contextlib
    bounded_heap = contextlib.nullcontext
with bounded_heap():
    try:
        from worker_svc.model.safetensors_stream import Placement
        config, weights = load_model_weights(sys.argv[1], shard, placement=Placement(torch.bfloat16))
    except ImportError:  # a loader without placements
        config, weights = load_model_weights(sys.argv[1], shard)
    model = LlamaModel(local_config(config, shard.size), weights, torch.bfloat16, "cpu", prepack=False)
    del weights
seconds = time.perf_counter() - start
kept = int(open("/proc/self/statm").read().split()[1]) * 4096
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forked parent (which may have just written the
# checkpoint), so it can report the parent's high-water mark instead of this process's.
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"peak_rss": peak, "kept_rss": kept, "before_load_rss": base * 1024, "seconds": seconds}))
"""


def _fp8_block(w):
    """float8_e4m3fn codes and one float32 scale per 128x128 block (w = codes * scale_inv)."""
    import torch

    out, inp = w.shape
    blocks = w.float().reshape(out // 128, 128, inp // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    codes = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(out, inp)
    return codes, scale


AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column held by each nibble of an AWQ int32
INT4_GROUP = 128


def _pack8(codes, order=tuple(range(8))):
    """uint8 codes [rows, cols] in 0..15 -> int32 [rows, cols / 8]: nibble i holds column 8k + order[i]."""
    import torch

    c = codes.to(torch.int32).reshape(codes.shape[0], -1, 8)
    packed = torch.zeros(c.shape[:2], dtype=torch.int32)
    for nibble, column in enumerate(order):
        packed |= c[..., column] << (4 * nibble)
    return packed


def _int4_layer(method: str, out: int, inp: int, gen) -> dict:
    """One linear layer's tensors in AWQ's or GPTQ's layout: random codes and zeros, scales near 0.02 / 8."""
    import torch

    groups = inp // INT4_GROUP
    codes = torch.randint(0, 16, (inp, out), generator=gen, dtype=torch.uint8)  # [in, out], as both store them
    zeros = torch.randint(0, 16, (groups, out), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(groups, out, generator=gen) * 0.005 + 0.0005).half()
    if method == "awq":  # packed along the output dim in AWQ's order
        return {"qweight": _pack8(codes, AWQ_PACK_ORDER), "qzeros": _pack8(zeros, AWQ_PACK_ORDER), "scales": scales}
    # GPTQ: qweight packed along the input dim (nibble i of row k holding row 8k + i), zeros stored minus one
    qweight = _pack8(codes.T.contiguous()).T.contiguous()
    return {"qweight": qweight, "qzeros": _pack8((zeros.int() - 1).clamp(min=0).to(torch.uint8)), "scales": scales,
            "g_idx": (torch.arange(inp) // INT4_GROUP).to(torch.int32)}


def write_checkpoint(path: str, layers: int, hidden: int, intermediate: int, vocab: int,
                     quantization: str | None = None, dtype: str = "bfloat16") -> int:
    """A random Llama in `dtype` (Llama-3.2-1B's shape at 16 layers), its projections FP8, AWQ or GPTQ int4 with
    `quantization` "fp8", "awq" or "gptq"; returns its bytes of weights."""
    import torch
    import transformers
    from safetensors.torch import save_file

    heads, kv_heads = hidden // 64, max(1, hidden // 256)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   tie_word_embeddings=True, torch_dtype=dtype, architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(path)
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: (torch.randn(*shape, generator=gen) * 0.02).to(getattr(torch, dtype))  # noqa: E731
    tensors = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": rand(hidden)}
    kv = kv_heads * 64
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (hidden, hidden)), ("self_attn.k_proj", (kv, hidden)),
                            ("self_attn.v_proj", (kv, hidden)), ("self_attn.o_proj", (hidden, hidden)),
                            ("mlp.gate_proj", (intermediate, hidden)), ("mlp.up_proj", (intermediate, hidden)),
                            ("mlp.down_proj", (hidden, intermediate))):
            if quantization in ("awq", "gptq"):
                tensors |= {p + name + "." + k: v for k, v in _int4_layer(quantization, *shape, gen).items()}
            elif quantization == "fp8":
                tensors[p + name + ".weight"], tensors[p + name + ".weight_scale_inv"] = _fp8_block(rand(*shape))
            else:
                tensors[p + name + ".weight"] = rand(*shape)
        tensors[p + "input_layernorm.weight"] = rand(hidden)
        tensors[p + "post_attention_layernorm.weight"] = rand(hidden)
    qc = {"fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
          "awq": {"quant_method": "awq", "bits": 4, "group_size": INT4_GROUP, "zero_point": True, "version": "gemm"},
          "gptq": {"quant_method": "gptq", "bits": 4, "group_size": INT4_GROUP, "sym": False, "desc_act": False,
                   "checkpoint_format": "gptq"}}.get(quantization)
    if qc is not None:
        config = json.load(open(os.path.join(path, "config.json")))
        config["quantization_config"] = qc
        json.dump(config, open(os.path.join(path, "config.json"), "w"))
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def measure(tree: str, model: str, size: int = 1, rank: int = 0) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    run = subprocess.run([sys.executable, "-c", _CHILD, model, str(size), str(rank)], env=env, cwd=tree,
                         capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"loading with the tree at {tree} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--ref", default="main", help="the git ref whose loader is the baseline")
    ap.add_argument("--checkpoint", default=None, metavar="DIR",
                    help="keep the checkpoint here and reuse it when present (default: a temporary one)")
    ap.add_argument("--quantization", choices=["fp8", "awq", "gptq"], default=None,
                    help="write the projections quantized")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="load one rank's shard of this many")
    ap.add_argument("--rank", type=int, default=0, help="the rank whose shard is loaded (with --tensor-parallel-size)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON here")
    ap.add_argument("--checkpoint-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="the dtype of the checkpoint's (non-quantized) tensors; the model is built in bfloat16")
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        model, old = args.checkpoint or os.path.join(tmp, "model"), os.path.join(tmp, "old")
        os.makedirs(old)
        weights = os.path.join(model, "model.safetensors")
        if os.path.isfile(weights):
            size = os.path.getsize(weights)  # the header's few KB aside
            with open(os.path.join(model, "config.json")) as f:  # the label from the checkpoint, not the flags
                args.quantization = (json.load(f).get("quantization_config") or {}).get("quant_method")
        else:
            size = write_checkpoint(model, args.layers, args.hidden, args.intermediate, args.vocab, args.quantization,
                                    args.checkpoint_dtype)
        archive = subprocess.run(["git", "-C", here, "archive", args.ref], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
        tp = (args.tensor_parallel_size, args.rank)
        rows = {args.ref: measure(old, model, *tp), "this tree": measure(here, model, *tp)}
    kind = f"{args.quantization} projections, {args.checkpoint_dtype} rest" if args.quantization else \
        f"{args.checkpoint_dtype} weights"
    shard = f", rank {args.rank} of {args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    print(f"checkpoint: {size / 1e9:.2f} GB of {kind}, {args.layers} layers, hidden {args.hidden}{shard}")
    print(f"{'loader':<12} {'peak RSS GB':>12} {'kept RSS GB':>12} {'peak/kept':>10} {'peak/ckpt':>10} {'s':>7}")
    for name, r in rows.items():
        print(f"{name:<12} {r['peak_rss'] / 1e9:12.2f} {r['kept_rss'] / 1e9:12.2f} "
              f"{r['peak_rss'] / r['kept_rss']:10.2f} {r['peak_rss'] / size:10.2f} {r['seconds']:7.1f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"checkpoint_bytes": size, "kind": kind, "layers": args.layers, "hidden": args.hidden,
                       "intermediate": args.intermediate, "vocab": args.vocab,
                       "tensor_parallel_size": args.tensor_parallel_size, "rank": args.rank, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
