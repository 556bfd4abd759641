"""Produce experiments/RESULTS.md: every run the benchmark issue asks for, on this machine, in one command.

    .venv/bin/python -m experiments.results                 # all sections (about 45 minutes on a 2-core CPU)
    .venv/bin/python -m experiments.results --page-only     # rebuild the page from the JSON files already in --out
    .venv/bin/python -m experiments.results --smoke --out /tmp/r --page /tmp/r/RESULTS.md   # the pipeline in a minute

Each run is a separate `llmserve bench ...` process (a launched server per llmserve mode, the Hugging Face
baselines in the bench process itself), so one run's memory or threads never leak into the next. JSON files, the
sweep's plots and the server logs go under --out (default experiments/out/results/, not tracked); the page keeps
the figures, and the plots it shows are copied beside it (results/sweep/ next to the page), so they can be committed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time

from llmserve.bench import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "experiments", "out", "results")  # ignored: raw results stay out of the tree

MODES = ("naive", "static", "continuous", "chunked")
HF = ("hf-naive", "hf-static", "hf-continuous")
SWEEP_RATES = "0.5,1,2,inf"
# `mixed` sized for this CPU, where prefill runs at roughly 700 tokens/s: one request in 8 has a 1-2k-token prompt
# (the workload's default, one in 4 at 2-4k, would spend most of every run in prefill, and hf-static pads every
# member of a 64-request batch to the longest prompt).
MIXED_SHAPE = ["--long-prompt-len", "1024:2048", "--long-share", "0.125"]


def _bench(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "llmserve.cli", "bench", *args]


# --smoke: one short chat run of the default mode and the KV-waste table, to check the whole pipeline in a minute.
SMOKE_SHAPE = ["--num-requests", "2", "--prompt-len", "16:32", "--output-len", "8", "--warmup", "1",
               "--server-args=--num-gpu-blocks-override 64", "--max-model-len", "512"]


def plan(out: str, n: int, sweep_n: int, smoke: bool = False) -> list[tuple[str, list[str]]]:
    """(section, argv) for every run, in the order they execute."""
    if smoke:
        return [("chat", _bench(["serve", "--mode", "chunked", "--workload", "chat", *SMOKE_SHAPE, "--request-rate",
                                 "inf", "--no-progress", "--result-dir", os.path.join(out, "chat")])),
                ("kv-waste", _bench(["kv-waste", "--json", os.path.join(out, "kv_waste.json")]))]
    runs = []
    for workload in ("chat", "mixed"):
        for run in MODES + HF:
            which = ["--backend", run] if run in HF else ["--mode", run]
            shape = MIXED_SHAPE if workload == "mixed" else []
            runs.append((workload, _bench(["serve", *which, "--workload", workload, *shape, "--num-requests", str(n),
                                           "--request-rate", "inf", "--no-progress",
                                           "--result-dir", os.path.join(out, workload)])))
    runs.append(("sweep", _bench(["sweep", "--workload", "mixed", *MIXED_SHAPE, "--modes", "chunked,continuous",
                                  "--request-rates", SWEEP_RATES, "--num-requests", str(sweep_n), "--no-progress",
                                  "--result-dir", os.path.join(out, "sweep")])))
    for caching in ("on", "off"):
        extra = [] if caching == "on" else ["--server-args=--no-enable-prefix-caching"]
        runs.append((f"rag-{caching}", _bench(["serve", "--mode", "chunked", "--workload", "rag", "--num-requests",
                                               str(sweep_n), "--request-rate", "inf", "--no-progress", *extra,
                                               "--result-dir", os.path.join(out, f"rag-{caching}")])))
    # smg stops routing to a pool that made no token for --worker-wedge-secs (3 s) with requests piling up: sized for
    # GPU prefill, it vetoes a CPU pool in the middle of a 512-token prompt.
    runs.append(("fleet", _bench(["fleet", "--policies", "cache_aware,round_robin", "--pools", "2",
                                  "--smg-args=--worker-wedge-secs 60", "--no-progress",
                                  "--result-dir", os.path.join(out, "fleet")])))
    runs.append(("kv-waste", _bench(["kv-waste", "--json", os.path.join(out, "kv_waste.json")])))
    return runs


def execute(runs: list[tuple[str, list[str]]], out: str) -> list[dict]:
    os.makedirs(out, exist_ok=True)
    done = []
    for section, argv in runs:
        cmd = shlex.join(["llmserve", *argv[3:]])
        print(f"[results] {section}: {cmd}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        proc = subprocess.run(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=None, text=True)
        seconds = time.monotonic() - t0
        done.append({"section": section, "command": cmd, "seconds": round(seconds, 1), "rc": proc.returncode})
        if proc.returncode != 0:
            print(f"[results] FAILED ({proc.returncode}) after {seconds:.0f} s", file=sys.stderr, flush=True)
    path = os.path.join(out, "runs.json")
    rerun = {r["section"] for r in done}
    kept = [r for r in json.load(open(path)) if r["section"] not in rerun] if os.path.exists(path) else []
    with open(path, "w") as f:
        json.dump(kept + done, f, indent=2)
    return done


# ---- the page ------------------------------------------------------------------------------------------------------

def _latest(directory: str) -> dict[str, dict]:
    """label -> the newest run record in `directory` (for a sweep: label@rate)."""
    records: dict[str, dict] = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.json")), key=os.path.getmtime):
        with open(path) as f:
            rec = json.load(f)
        if "backend" not in rec:
            continue
        records[f"{report.run_label(rec)}@{rec['request_rate']}"] = rec
    return records


def _target(value: float | None, base: float | None, goal: float) -> str:
    if not value or not base:
        return "not measured"
    return "met" if value / base >= goal else "MISSED"


def _machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import torch
    import transformers

    return (f"{os.cpu_count()} cores of {cpu}, {mem:.0f} GiB RAM, no GPU; Python {platform.python_version()}, "
            f"torch {torch.__version__}, transformers {transformers.__version__}; model: the bundled "
            "SmolLM2-135M-Instruct GGUF in float32; llmserve's worker uses the torch paged-attention path on CPU")


def _shown(path: str) -> str:
    inside = os.path.abspath(path).startswith(ROOT + os.sep)
    return os.path.relpath(path, ROOT) if inside else path


def page(out: str, page_dir: str) -> str:
    """The page's Markdown; the sweep plots it shows are copied to `page_dir`/results/sweep/, and the hand-written
    analysis is read from `page_dir`/results/ANALYSIS.md."""
    runs_path = os.path.join(out, "runs.json")
    runs = json.load(open(runs_path)) if os.path.exists(runs_path) else []
    lines = ["# llmserve benchmark results", "",
             "Produced by `.venv/bin/python -m experiments.results` (every command it ran is listed at the end). "
             f"Raw JSON per run, plots and server logs: {_shown(out)}/ of the machine that ran it (not tracked).", "",
             f"Machine: {_machine()}.", ""]
    sections: dict[str, dict[str, dict]] = {w: _latest(os.path.join(out, w)) for w in ("chat", "mixed")}
    for workload, recs in sections.items():
        if not recs:
            continue
        first = next(iter(recs.values()))["workload"]
        lines += [f"## `{workload}`: {first['num_requests']} requests, all at once", "",
                  f"Prompts {first['prompt_len']} tokens, outputs {first['output_len']} tokens (ignore_eos)"
                  + (f", every {round(1 / first['long_share'])}th prompt long: {first['long_prompt_len']} tokens"
                     if workload == "mixed" else "") + ". Latencies in ms.", "",
                  report.markdown_table([recs[k] for k in sorted(recs, key=_order)])]
    lines += _ratios(sections, out)
    analysis = os.path.join(page_dir, "results", "ANALYSIS.md")  # hand-written: why each missed target is missed
    if os.path.exists(analysis):
        with open(analysis) as f:
            lines += [f.read(), ""]
    sweep = _latest(os.path.join(out, "sweep"))
    if sweep:
        lines += ["## Rate sweep on `mixed`", "", report.markdown_table(sorted(sweep.values(), key=_sweep_order))]
        plots = os.path.join(page_dir, "results", "sweep")
        for png in sorted(glob.glob(os.path.join(out, "sweep", "*.png")))[-2:]:
            os.makedirs(plots, exist_ok=True)
            shown = os.path.join(plots, os.path.basename(png))
            if os.path.abspath(png) != os.path.abspath(shown):
                shutil.copyfile(png, shown)
            lines += [f"![{os.path.basename(png)}]({os.path.relpath(shown, page_dir)})", ""]
    lines += _rag(out)
    lines += _fleet(out)
    kv_path = os.path.join(out, "kv_waste.json")
    if os.path.exists(kv_path):
        from llmserve.bench import kv_waste

        with open(kv_path) as f:
            table = kv_waste.markdown_table(json.load(f))
        lines += ["## KV waste: paged blocks vs contiguous reservation", "", table, ""]
    if runs:
        lines += ["## Commands", "", "| section | command | seconds | exit |", "|---|---|---|---|"]
        lines += [f"| {r['section']} | `{r['command']}` | {r['seconds']} | {r['rc']} |" for r in runs]
    return "\n".join(lines) + "\n"


def _order(key: str) -> int:
    label = key.split("@")[0]
    return (MODES + HF).index(label) if label in MODES + HF else 99


def _sweep_order(rec: dict) -> tuple[str, float]:
    return (report.run_label(rec), report.rate_value(rec))


def _ratios(sections: dict[str, dict[str, dict]], out: str) -> list[str]:
    lines = ["## The issue's ratios", "", "| ratio | workload | value | target | |", "|---|---|---|---|---|"]
    for workload, recs in sections.items():
        chunked = recs.get("chunked@inf", {}).get("output_throughput")
        for base, goal in (("hf-naive", 5), ("hf-static", 1.5), ("hf-continuous", 2)):
            other = recs.get(f"{base}@inf", {}).get("output_throughput")
            lines.append(f"| CONTINUOUS+CHUNKED / {base} output tok/s | {workload} | {report.ratio(chunked, other)} | "
                         f">= {goal}x | {_target(chunked, other, goal)} |")
    mixed = sections.get("mixed", {})
    cont = mixed.get("continuous@inf", {}).get("itl_ms", {}).get("p99")
    chunk = mixed.get("chunked@inf", {}).get("itl_ms", {}).get("p99")
    lines.append(f"| ITL p99 CONTINUOUS / CONTINUOUS+CHUNKED | mixed, all at once | {report.ratio(cont, chunk)} | "
                 f">= 3x | {_target(cont, chunk, 3)} |")
    sweep = _latest(os.path.join(out, "sweep"))
    for key in sorted((k for k in sweep if k.startswith("continuous@")), key=lambda k: report.rate_value(sweep[k])):
        rate = key.split("@")[1]
        cont = sweep[key]["itl_ms"]["p99"]
        chunk = sweep.get(f"chunked@{rate}", {}).get("itl_ms", {}).get("p99")
        lines.append(f"| ITL p99 CONTINUOUS / CONTINUOUS+CHUNKED | mixed, {rate} req/s | {report.ratio(cont, chunk)} | "
                     f">= 3x | {_target(cont, chunk, 3)} |")
    return lines + [""]


def _rag(out: str) -> list[str]:
    on = next(iter(_latest(os.path.join(out, "rag-on")).values()), None)
    off = next(iter(_latest(os.path.join(out, "rag-off")).values()), None)
    if not on or not off:
        return []
    w = on["workload"]
    lines = ["## RAG: prefix caching on vs off", "",
             f"{w['num_requests']} requests all at once, {w['num_docs']} shared documents of {w['long_prompt_len']} "
             f"tokens, questions {w['prompt_len']} tokens, outputs {w['output_len']} tokens.", "",
             "| | caching on | caching off | on / off |", "|---|---|---|---|"]
    rows = (("TTFT p50 (ms)", lambda r: r["ttft_ms"]["p50"]), ("TTFT p99 (ms)", lambda r: r["ttft_ms"]["p99"]),
            ("output tok/s", lambda r: r["output_throughput"]), ("e2e p50 (ms)", lambda r: r["e2e_ms"]["p50"]))
    for name, pick in rows:
        a, b = pick(on), pick(off)
        lines.append(f"| {name} | {a:.1f} | {b:.1f} | {report.ratio(a, b)} |")
    return lines + [""]


def _fleet(out: str) -> list[str]:
    """The two-pool run behind smg: the newest record of each routing policy, in the order they ran."""
    from llmserve.bench import fleet

    records = sorted(_latest(os.path.join(out, "fleet")).values(), key=lambda r: r["started_at"])
    if not records:
        return []
    w = records[0]["workload"]
    return ["## Two pools behind smg: `cache_aware` vs `round_robin` routing", "",
            f"`llmserve bench fleet`: each policy on {records[0]['fleet']['num_pools']} fresh pools (a launched "
            f"`llmserve serve` each, empty prefix caches) behind the smg gateway. {w['num_requests']} requests "
            + ("all at once" if w["request_rate"] == "inf" else f"at {w['request_rate']} req/s (Poisson)")
            + f", {w['num_docs']} shared documents of {w['long_prompt_len']} tokens, "
            f"questions {w['prompt_len']} tokens, outputs {w['output_len']} tokens. Prefix hit rate: "
            "`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total` summed over the pools.", "",
            fleet.markdown_table(records), ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help="raw results: JSON, plots, logs (default: %(default)s)")
    ap.add_argument("--num-requests", type=int, default=64, help="chat and mixed runs")
    ap.add_argument("--sweep-requests", type=int, default=32, help="each sweep point and each RAG run")
    ap.add_argument("--only", default=None, help="comma-separated sections to run (chat, mixed, sweep, rag-on, "
                    "rag-off, fleet, kv-waste); the page is rebuilt from everything present")
    ap.add_argument("--skip-baselines", action="store_true",
                    help="run only llmserve (the Hugging Face rows already there are kept on the page)")
    ap.add_argument("--page-only", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="only a 2-request chat run (chunked) and the KV-waste table: "
                    "checks the pipeline quickly; use with --out and --page elsewhere")
    ap.add_argument("--page", default=os.path.join(ROOT, "experiments", "RESULTS.md"))
    args = ap.parse_args()
    if not args.page_only:
        runs = plan(args.out, args.num_requests, args.sweep_requests, args.smoke)
        if args.only:
            keep = set(args.only.split(","))
            runs = [r for r in runs if r[0] in keep]
        if args.skip_baselines:
            runs = [r for r in runs if not any(f"hf-{m}" in r[1] for m in ("naive", "static", "continuous"))]
        execute(runs, args.out)
    with open(args.page, "w") as f:
        f.write(page(args.out, os.path.dirname(os.path.abspath(args.page))))
    print(f"[results] wrote {args.page}", file=sys.stderr)


if __name__ == "__main__":
    main()
