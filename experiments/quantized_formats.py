"""One model in several checkpoint formats (experiments/realistic_checkpoints.py: bfloat16, FP8 128x128 blocks, AWQ
and GPTQ int4, compressed-tensors W8A8 int8), each loaded in a fresh subprocess as the worker loads it, activations
in --dtype (bfloat16 by default; float32 where the CPU has no native bf16): the resident memory it keeps, the peak
while loading, the load time, and decode tokens/s at a few batch sizes (one step = one token for each of B
sequences with C cached tokens; median of the repeats).

    python -m experiments.quantized_formats --root /tmp/llama1b                         # every format in the folder
    python -m experiments.quantized_formats --root /tmp/llama1b --formats fp8 --ref main  # FP8, main beside it

--ref REF adds a row per format measured with that git ref's tree (the code before a change), in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from experiments.realistic_checkpoints import FORMATS, write_formats

_CHILD = r"""
import gc, json, resource, statistics, sys, time
import torch
from experiments.quantized_forward import Decoder
from worker_svc.model import families
from worker_svc.model.loader import load_model_weights
from worker_svc.model.safetensors_stream import Placement

path, batches = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
context, repeats, dtype = int(sys.argv[3]), int(sys.argv[4]), getattr(torch, sys.argv[5])
start = time.perf_counter()
config, weights = load_model_weights(path, placement=Placement(dtype))
model = families.by_name(config.architecture)(config, weights, dtype, "cpu")
del weights
gc.collect()
load_s = time.perf_counter() - start
kept = int(open("/proc/self/statm").read().split()[1]) * 4096
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
steps = {}
for batch in batches:
    d = Decoder(model, context + repeats + 4, batch)
    d.step({s: [1 + s] * context for s in range(batch)})
    d.step({s: [5] for s in range(batch)})  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        d.step({s: [7] for s in range(batch)})
        times.append(time.perf_counter() - t)
    steps[batch] = statistics.median(times)
    del d
print(json.dumps({"kept_rss": kept, "peak_rss": peak, "load_s": load_s, "step_s": steps}))
"""


def measure(tree: str, model: str, batches: str, context: int, repeats: int, dtype: str) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    run = subprocess.run([sys.executable, "-c", _CHILD, model, batches, str(context), str(repeats), dtype], env=env,
                         cwd=tree, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"{model} with the tree at {tree} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="one directory per format, as realistic_checkpoints.py writes them;"
                    " a format missing there is written first, at the shape below")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--ref", default=None, help="also measure with this git ref's tree")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    missing = [f for f in args.formats.split(",") if not os.path.isfile(os.path.join(args.root, f, "config.json"))]
    if missing:
        write_formats(args.root, missing, args.layers, args.hidden, args.intermediate)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = []
    with tempfile.TemporaryDirectory() as old:
        trees = [("this tree", here)]
        if args.ref:
            archive = subprocess.run(["git", "-C", here, "archive", args.ref], check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
            trees.append((args.ref, old))
        for fmt in args.formats.split(","):
            for tree_name, tree in trees:
                r = measure(tree, os.path.join(args.root, fmt), args.batch_sizes, args.context, args.repeats,
                            args.dtype)
                rows.append({"format": fmt, "tree": tree_name, **r})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    batches = args.batch_sizes.split(",")
    print("| format | code | kept RSS GB | peak RSS GB | load s | " + " | ".join(
        f"batch {b} tok/s" for b in batches) + " |")
    print("|---|---|---:|---:|---:|" + "---:|" * len(batches))
    for r in rows:
        rates = " | ".join(f"{int(b) / r['step_s'][b]:.1f}" for b in batches)
        print(f"| {r['format']} | {r['tree']} | {r['kept_rss'] / 1e9:.2f} | {r['peak_rss'] / 1e9:.2f} | "
              f"{r['load_s']:.1f} | {rates} |")


if __name__ == "__main__":
    main()
