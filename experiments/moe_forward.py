"""Sparse MoE forward throughput (Mixtral, Qwen3-MoE) against Hugging Face transformers, same process, same dtype,
and the share of our step spent routing.

A random-weight checkpoint of each family is written by transformers (default: 4 layers, hidden 512, 8 experts of
intermediate 512, top-2, vocabulary 8192; every layer sparse), then loaded by our loader and registry. Case
"decode B": one step producing one token for each of B sequences with C cached tokens.
  - ours: the model's `forward` over B decode rows (paged KV pool prefilled once; the step rewrites the same slot, so
    the context stays C). Attention metadata is built outside the timer.
  - HF: `model(input_ids[B, 1], cache=DynamicCache of C tokens)` (transformers' eager experts loop), cropped back
    to C after each step, outside the timer.
  - routing: `moe.route` (router matmul, softmax, top-k, renormalisation) and the grouping of the pairs by expert
    (`moe.sort_by_expert`; on CUDA the fused kernel's `align_by_expert`), timed inside our step (RoutingTimer), as
    a share of that step.
Runs alternate and the order rotates each repetition; the table shows medians. tokens/s = B / median seconds.

    .venv/bin/python -m experiments.moe_forward                                 # both families, B = 1 and 32
    .venv/bin/python -m experiments.moe_forward --families mixtral --threads 1 --json /tmp/moe.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see experiments/worker_forward.py

import torch

import kernels
from worker_svc.model import families as models
from worker_svc.model.layers import moe
from worker_svc.model.loader import load_hf_dir

BLOCK_SIZE = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="+", default=["mixtral", "qwen3_moe"], choices=["mixtral", "qwen3_moe"])
    p.add_argument("--batch-sizes", default="1,32", help="decode batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=128, help="cached tokens per sequence")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-intermediate", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()})
    return args


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def hf_checkpoint(family: str, a: argparse.Namespace, path: str) -> torch.nn.Module:
    import transformers

    heads = max(1, a.hidden // 64)
    common = dict(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=heads,
                  num_key_value_heads=max(1, heads // 2), num_experts_per_tok=a.top_k, tie_word_embeddings=False,
                  max_position_embeddings=max(512, 2 * a.context))
    if family == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=a.expert_intermediate,
                                         num_local_experts=a.experts)
        model = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(**common, intermediate_size=4 * a.hidden, head_dim=64,
                                          moe_intermediate_size=a.expert_intermediate, num_experts=a.experts,
                                          norm_topk_prob=True)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.5 + torch.rand(p.shape, generator=g) if "norm" in name else 0.05 * torch.randn(p.shape,
                                                                                                  generator=g))
    model.save_pretrained(path, safe_serialization=True)
    model.config._experts_implementation = "eager"  # transformers' default loop over the experts hit
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


class Ours:
    def __init__(self, path: str, dtype: torch.dtype, device: torch.device, seqs: int, context: int):
        config, weights = load_hf_dir(path)
        self.model = models.by_name(config.architecture)(config, weights, dtype, device)
        self.device, self.context = device, context
        per_seq = -(-(context + 1) // BLOCK_SIZE)
        self.kv = torch.zeros(self.model.kv_cache_shape(seqs * per_seq, BLOCK_SIZE), dtype=dtype, device=device)
        self.tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs)]

    def prefill(self, prompts: torch.Tensor) -> torch.Tensor:
        """Prefill every sequence's C tokens, a few sequences a step; returns each one's next token."""
        out = []
        step = max(1, 2048 // self.context)
        for s in range(0, len(prompts), step):
            rows = prompts[s:s + step]
            n = len(rows)
            meta = kernels.build_attention_metadata([self.context] * n, [self.context] * n, self.tables[s:s + n],
                                                    BLOCK_SIZE, self.device)
            positions = torch.arange(self.context, device=self.device).repeat(n)
            last = torch.arange(1, n + 1, device=self.device) * self.context - 1
            logits = self.model.forward(rows.reshape(-1).to(self.device), positions, self.kv, meta, last)
            out.append(logits.argmax(-1))
        return torch.cat(out)

    def decode_inputs(self, tokens: torch.Tensor):
        b = len(tokens)
        meta = kernels.build_attention_metadata([1] * b, [self.context + 1] * b, self.tables[:b], BLOCK_SIZE,
                                                self.device)
        positions = torch.full((b,), self.context, dtype=torch.int64, device=self.device)
        return tokens.to(self.device), positions, meta, torch.arange(b, device=self.device)

    def decode(self, inputs) -> torch.Tensor:
        ids, positions, meta, rows = inputs
        return self.model.forward(ids, positions, self.kv, meta, rows).argmax(-1)


class RoutingTimer:
    """Inside our forward, the wall time of routing: `moe.route` (router matmul, softmax, top-k, renormalisation)
    and the grouping of the pairs by expert (`moe.sort_by_expert`, or the fused kernel's `align_by_expert` on
    CUDA), by wrapping those module functions while `with` is active (synchronising around them on CUDA)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, 0.0
        from kernels import fused_moe

        self.targets = [(moe, "route"), (moe, "sort_by_expert"), (fused_moe, "align_by_expert")]
        self.saved: list = []

    def __enter__(self) -> RoutingTimer:
        for module, name in self.targets:
            fn = getattr(module, name)
            self.saved.append((module, name, fn))

            def wrapped(*args, _fn=fn, **kwargs):
                sync(self.device)
                t0 = time.perf_counter()
                out = _fn(*args, **kwargs)
                sync(self.device)
                self.seconds += time.perf_counter() - t0
                return out

            setattr(module, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for module, name, fn in self.saved:
            setattr(module, name, fn)
        self.saved.clear()


def routing_share(ours: Ours, inputs, repeats: int) -> tuple[float, float]:
    """(routing seconds per step, their share of the step), medians over `repeats` instrumented steps."""
    per_step, shares = [], []
    for _ in range(repeats):
        with RoutingTimer(ours.device) as timer:
            step = timed(lambda: ours.decode(inputs), ours.device)
        per_step.append(timer.seconds)
        shares.append(timer.seconds / step)
    return statistics.median(per_step), statistics.median(shares)


def bench_batch(family: str, b: int, ours: Ours, hf, prompts: torch.Tensor, first: torch.Tensor,
                a: argparse.Namespace, device: torch.device) -> dict:
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    hf_first = hf(prompts[:b].to(device), cache=cache, use_cache=True).logits[:, -1].argmax(-1)
    inputs = ours.decode_inputs(first[:b])
    hf_ids = first[:b].reshape(b, 1).to(device)
    results: dict[str, torch.Tensor] = {}
    times: dict[str, list[float]] = {"ours": [], "hf": []}

    def run_ours():
        results["ours"] = ours.decode(inputs)

    def run_hf():
        results["hf"] = hf(hf_ids, cache=cache, use_cache=True).logits[:, -1].argmax(-1)

    fns = {"ours": run_ours, "hf": run_hf}
    for r in range(a.warmup + a.repeats):
        for name in list(fns)[r % 2:] + list(fns)[:r % 2]:
            gc.collect()
            t = timed(fns[name], device)
            if name == "hf":
                cache.crop(-1)  # back to C tokens
            if r >= a.warmup:
                times[name].append(t)
    ours_s, hf_s = statistics.median(times["ours"]), statistics.median(times["hf"])
    route_s, route_share = routing_share(ours, inputs, a.repeats)
    row = {"family": family, "batch": b, "context": a.context, "ours_tokens_per_s": b / ours_s,
           "hf_tokens_per_s": b / hf_s, "speedup": hf_s / ours_s, "ours_step_ms": 1e3 * ours_s,
           "hf_step_ms": 1e3 * hf_s, "routing_ms": 1e3 * route_s, "routing_share": route_share,
           "first_tokens_agree": bool(torch.equal(hf_first.cpu(), first[:b].cpu())),
           "same_argmax": float((results["ours"].cpu() == results["hf"].cpu()).float().mean())}
    log(f"{family} B={b}: ours {row['ours_tokens_per_s']:.0f} tok/s, HF {row['hf_tokens_per_s']:.0f} tok/s, "
        f"routing {100 * row['routing_share']:.1f}% of our step")
    return row


@torch.inference_mode()
def bench_family(family: str, a: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> list[dict]:
    with tempfile.TemporaryDirectory() as path:
        hf = hf_checkpoint(family, a, path).to(device=device, dtype=dtype)
        ours = Ours(path, dtype, device, max(a.batch_sizes), a.context)
    prompts = torch.randint(0, a.vocab, (max(a.batch_sizes), a.context), generator=torch.Generator().manual_seed(2))
    first = ours.prefill(prompts)
    return [bench_batch(family, b, ours, hf, prompts, first, a, device) for b in a.batch_sizes]


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    rows = [row for family in a.families for row in bench_family(family, a, dtype, device)]
    print(f"device {device}, {a.dtype}, {a.threads} threads, context {a.context}, {a.layers} layers, hidden "
          f"{a.hidden}, {a.experts} experts (intermediate {a.expert_intermediate}), top-{a.top_k}\n")
    print("| family | batch | ours tok/s | HF tok/s | speedup | routing ms | routing share | same argmax |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['batch']} | {r['ours_tokens_per_s']:.0f} | {r['hf_tokens_per_s']:.0f} | "
              f"{r['speedup']:.2f}x | {r['routing_ms']:.3f} | {100 * r['routing_share']:.1f}% | "
              f"{100 * r['same_argmax']:.0f}% |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items() if k != "json"}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
