"""Hybrid models' forward (Qwen3.5: Gated DeltaNet; Nemotron-H: Mamba2) against Hugging Face transformers, same
process, same dtype, and the share of our step in the recurrent layers.

A random-weight checkpoint of each family is written by transformers (default: 8 layers, hidden 512, every 4th layer
attention), then loaded by our loader and registry. Cases:
  - "prefill B x C": one step computing C prompt tokens for each of B sequences from zero state;
  - "decode B": one step producing one token for each of B sequences whose state slots and KV hold C tokens (the
    step rewrites the same positions, so the context stays C).
HF runs `model(input_ids)` for the prefill and one cached step (`DynamicCache` after C tokens, copied per run
outside the timer) for decode. Runs alternate; the table shows medians; tokens/s = tokens / median seconds.
"recurrent %" is the share of our step inside the recurrent mixers (timed around them).

    .venv/bin/python -m experiments.hybrid_forward
    .venv/bin/python -m experiments.hybrid_forward --families qwen3_5 --batch 32 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see experiments/worker_forward.py

import torch
import transformers

import kernels
from worker_svc.core.state_cache import StateCache, StateStep
from worker_svc.model import families as models
from worker_svc.model.families import nemotron_h, qwen3_next
from worker_svc.model.loader import load_hf_dir

BLOCK = 16


def checkpoint(family: str, layers: int, hidden: int, path: str) -> torch.nn.Module:
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    common = dict(vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 3, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    if family == "qwen3_5":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
            **common, num_hidden_layers=layers, layer_types=types, linear_num_key_heads=4, linear_num_value_heads=8,
            linear_key_head_dim=64, linear_value_head_dim=64))
    else:
        model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(
            **common, layers_block_type=types, ssm_state_size=64, mamba_num_heads=16, mamba_head_dim=64, n_groups=4))
    model.eval().save_pretrained(path)
    return model


class MixerTimer:
    """Seconds spent inside the recurrent mixers (wrapped where the families call them)."""

    def __init__(self):
        self.seconds = 0.0
        for module, name in ((qwen3_next, "deltanet_mixer"), (nemotron_h, "mamba2_mixer")):
            setattr(module, name, self._timed(getattr(module, name)))

    def _timed(self, fn):
        def run(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds += time.perf_counter() - t
            return out
        return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="+", default=["qwen3_5", "nemotron_h"], choices=["qwen3_5", "nemotron_h"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    timer = MixerTimer()
    print(f"| family | case | ours tok/s | HF tok/s | ours / HF | recurrent % |  (threads {args.threads})")
    print("|---|---|---|---|---|---|")
    for family in args.families:
        run_family(family, args, timer)

def run_family(family: str, args: argparse.Namespace, timer: MixerTimer) -> None:
    b, c = args.batch, args.context
    with tempfile.TemporaryDirectory() as path:
        hf = checkpoint(family, args.layers, args.hidden, path)
        config, weights = load_hf_dir(path)
    ours = models.by_name(config.architecture)(config, weights, torch.float32, "cpu")
    pool = StateCache(ours.state_shape(), b, torch.float32, torch.float32, torch.device("cpu"))
    blocks = -(-(c + 1) // BLOCK)
    kv = torch.zeros(ours.kv_cache_shape(b * blocks, BLOCK))
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(b)]
    ids = torch.randint(0, 8192, (b, c))

    def ours_step(n: int, start: int) -> None:
        meta = kernels.build_attention_metadata([n] * b, [start + n] * b, tables, BLOCK, "cpu")
        tokens = ids[:, start:start + n].reshape(-1) if n > 1 else ids[:, 0]
        state = StateStep(pool, torch.arange(b), meta.cu_seqlens_q.long())
        ours.forward(tokens, torch.arange(start, start + n).repeat(b), kv, meta, torch.arange(1, b + 1) * n - 1,
                     state=state)

    with torch.inference_mode():
        cache = hf(ids, use_cache=True).cache
    cases = {"prefill": (b * c, lambda: ours_step(c, 0), lambda: hf(ids)),
             "decode": (b, lambda: ours_step(1, c - 1), None)}
    for case, (tokens, ours_run, hf_run) in cases.items():
        ours_s, hf_s, shares = [], [], []
        for _ in range(args.reps):
            timer.seconds = 0.0
            t = time.perf_counter()
            ours_run()
            ours_s.append(time.perf_counter() - t)
            shares.append(timer.seconds / ours_s[-1])
            with torch.inference_mode():
                if hf_run is None:
                    step_cache = copy.deepcopy(cache)
                    t = time.perf_counter()
                    hf(ids[:, :1], cache=step_cache, use_cache=True)
                else:
                    t = time.perf_counter()
                    hf_run()
                hf_s.append(time.perf_counter() - t)
        o, h = statistics.median(ours_s), statistics.median(hf_s)
        name = f"prefill {b} x {c}" if case == "prefill" else f"decode {b}"
        print(f"| {family} | {name} | {tokens / o:.0f} | {tokens / h:.0f} | {h / o:.2f}x | "
              f"{100 * statistics.median(shares):.0f}% |", flush=True)

if __name__ == "__main__":
    main()
