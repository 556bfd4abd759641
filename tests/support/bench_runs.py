"""Running a bench script the way its smoke tests do: `python -m PACKAGE.NAME` (or `llmserve bench ...`) from the
repository root; and the commands the Markdown files document, each turned into its smoke-size run."""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The package of the development experiments: `python -m PACKAGE.NAME`. Every smoke test reaches a script through
# this name, so renaming the folder means changing it here.
PACKAGE = "experiments"

# Per documented command (a script NAME of PACKAGE, or "llmserve bench SUB"): the arguments that make a run small.
# They replace a documented command's own values for the same flags; "{tmp}" is the test's temporary directory.
_JSON = ["--json", "{tmp}/out.json"]
_LOAD = ["--request-rate", "inf", "--num-requests", "2", "--prompt-len", "8:16", "--long-prompt-len", "32:48",
         "--output-len", "4", "--warmup", "1", "--max-model-len", "512",
         "--server-args=--num-gpu-blocks-override 128", "--no-progress", "--result-dir", "{tmp}"]
SMOKE_ARGS: dict[str, list[str]] = {
    "gpu_serve": ["--smoke"],
    "forward_modes": ["--batch-sizes", "1", "--context", "16", "--repeats", "1", "--threads", "1"],
    "kernels_gpu": ["--smoke", *_JSON],
    "realistic_checkpoints": ["--root", "{tmp}/ckpt", "--formats", "fp8,awq", "--layers", "1", "--hidden", "128",
                              "--intermediate", "256"],
    "quantized_formats": ["--root", "{tmp}/ckpt", "--formats", "fp8", "--layers", "1", "--hidden", "128",
                          "--intermediate", "256", "--batch-sizes", "1", "--context", "8", "--repeats", "1",
                          "--dtype", "float32", *_JSON],
    "quantized_forward": ["--batch-sizes", "1", "--context", "16", "--repeats", "1", "--prompts", "1", "--tokens", "4",
                          *_JSON],
    "model_families": ["--families", "qwen3,gemma2", "--batch-sizes", "1,2", "--context", "20", "--reps", "1", *_JSON],
    "moe_forward": ["--layers", "1", "--hidden", "64", "--vocab", "256", "--expert-intermediate", "64",
                    "--context", "16", "--batch-sizes", "1,4", "--repeats", "1", "--warmup", "1", "--threads", "1",
                    *_JSON],
    "fp8_matmul_cost": ["--hidden", "128", "--intermediate", "256", "--kv", "128", "--layers", "1", "--repeats", "1"],
    "load_memory": ["--layers", "1", "--hidden", "128", "--intermediate", "256", "--vocab", "256", "--ref", "HEAD",
                    *_JSON],
    "hybrid_forward": ["--families", "qwen3_5", "--batch", "2", "--context", "8", "--layers", "2", "--hidden", "64",
                       "--reps", "1"],
    "hybrid_serving": ["--layers", "4", "--hidden", "128", "--context", "4096", "--kv-budget-mib", "64", "--prompt-len",
                       "40", "--answer-len", "10", "--turn-len", "9", "--reps", "1"],
    "hybrid_peers": ["--write", "{tmp}/ckpt", "--layers", "4", "--hidden", "64", "--ttft", "{tmp}/ckpt/qwen3_5",
                     "--servers", "llmserve", "--prompt-len", "40", "--answer-len", "10", "--turn-len", "9", "--reps",
                     "1", "--result-dir", "{tmp}/out", *_JSON],
    "train_eagle3": ["--prompts", "2", "--new-tokens", "4", "--gen-batch", "2", "--minutes", "0.05", "--draft-vocab",
                     "64", "--out", "{tmp}"],
    "hybrid_compiled_decode": ["--batch", "1", "--context", "8", "--layers", "4", "--hidden", "64", "--reps", "1"],
    "hybrid_rollback_cost": ["--layers", "4", "--hidden", "128", "--batch", "2", "--prompt-len", "16", "--period", "4",
                             "--max-tokens", "8"],
    "chaos": ["--primary-kills", "1", "--primary-stops", "0", "--scheduler-kills", "1", "--worker-kills", "1",
              "--concurrency", "4", "--durability", "none", "--max-tokens", "16", "--gap-s", "3", "--warmup-s", "3",
              "--duration-s", "0", *_JSON],
    "redis_durability": ["--running", "2", "--repeats", "1", "--max-tokens", "8", *_JSON],
    "paged_attention_cpu": ["--cases", "1x16", "--repeats", "1", "--dtypes", "float32", *_JSON],
    "dense_matmul": ["--rows", "1,7", "--shapes", "100x96", "--repeats", "3", *_JSON],
    "decode_attention_layers": ["--cases", "2x40", "--repeats", "2"],
    "layer_ops": ["--steps", "decode:2@40,prefill:1@32", "--repeats", "1"],
    "compute_roof": ["--seconds", "0.05", *_JSON],
    "quant_matmul_rate": ["--shapes", "o", "--repeats", "3", "--rotate-mb", "2", *_JSON],
    "lora_throughput": ["--ranks", "8", "--adapters", "0,1", "--repeats", "1", "--output-tokens", "3", "--concurrency",
                        "4", "--prompt-tokens", "16", "--threads", "2", *_JSON],
    "prefix_cache": ["--num-requests", "2", "--zero-hit-requests", "2", "--repeats", "1", "--prefix-len", "32",
                     "--question-len", "16", "--max-tokens", "4", "--max-model-len", "256", *_JSON],
    "results": ["--smoke", "--out", "{tmp}/out", "--page", "{tmp}/RESULTS.md"],
    "scheduler_overhead": ["--running", "2", "--repeats", "1", "--warmup", "2", "--measure", "20", "--tail-tokens",
                           "16", *_JSON],
    "serve_throughput": ["--num-requests", "2", "--hf-requests", "1", "--max-tokens", "4", "--min-prompt", "8",
                         "--max-prompt", "16", *_JSON],
    "speculative": ["--batches", "1", "--batch1-requests", "1", "--repetitive-tokens", "12", "--repeats", "1", *_JSON],
    "step_profile": ["--smoke"],
    "stream_cpu": ["--concurrency", "2", "--num-requests", "2", "--output-len", "4", *_JSON],
    "structured_outputs": ["--num-requests", "2", "--max-tokens", "8", "--rows", "4", "--repeats", "2", *_JSON],
    "tensor_parallel": ["--batch-sizes", "1,4", "--steps", "2", "--warmup", "1", "--layers", "2", *_JSON],
    "tracing_overhead": ["--running", "2", "--repeats", "1", "--warmup", "2", "--measure", "5", "--tail-tokens", "16",
                         *_JSON],
    "worker_forward": ["--batch-sizes", "1", "--repeats", "1", "--warmup", "0", "--context", "16", "--prefill-tokens",
                       "16", "--threads", "2", "--profile-steps", "1", *_JSON],
    "worker_host_path": ["--smoke", *_JSON],
    "worker_wire": ["--smoke", *_JSON],
    "llmserve bench serve": _LOAD,
    "llmserve bench sweep": ["--request-rates", "inf", *_LOAD[2:]],
    "llmserve bench kv-waste": ["--num-requests", "16", *_JSON],
    "llmserve bench fleet": ["--pools", "2", "--num-docs", "2", "--long-share", "1", *_LOAD],
}
# Smaller values for flags only some documented commands use. A baseline revision is this checkout's HEAD; a
# server named by --target is one the test started ({target}, {metrics_url}).
SMOKE_VALUES: dict[tuple[str, str], list[str]] = {
    ("worker_forward", "--profile"): ["1"],
    ("hybrid_serving", "--attention-every"): ["4"],  # the smoke size has 4 layers
    ("worker_host_path", "--baseline-ref"): ["HEAD"],
    ("worker_host_path", "--rounds"): ["1"],
    ("worker_wire", "--baseline-ref"): ["HEAD"],
    ("llmserve bench serve", "--target"): ["{target}"],
    ("llmserve bench serve", "--metrics-url"): ["{metrics_url}"],
    ("llmserve bench serve", "--max-concurrency"): ["2"],
    ("llmserve bench serve", "--max-num-seqs"): ["2"],
}
# Flags whose documented value is kept and the smoke value appended to it (the server's own flags).
JOINED = ("--server-args",)


def scripts() -> list[str]:
    """The runnable scripts of PACKAGE (every module but the package's own)."""
    return sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, PACKAGE, "*.py"))
                  if not p.endswith("__init__.py"))


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """Every `python -m PACKAGE.NAME ...` and `llmserve bench SUB ...` in the repository's Markdown (README,
    PACKAGE/*.md, docs/): (file, NAME or "llmserve bench SUB", arguments); comments and continuations handled."""
    found = []
    rest = r"\b([^\n`|#]*)"  # up to the end of the line, the code span, the table cell or a comment
    patterns = (re.compile(rf"python -m {re.escape(PACKAGE)}\.([a-z_][a-z0-9_]*){rest}"),  # NAME: a placeholder
                re.compile(rf"(llmserve bench [a-z][a-z-]*){rest}"))
    paths = [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, PACKAGE, "*.md")),
             *glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)]
    for path in sorted(paths):
        with open(path, encoding="utf-8") as f:
            text = f.read().replace("\\\n", " ")
        for pattern in patterns:
            for m in pattern.finditer(text):
                found.append((os.path.relpath(path, ROOT), m.group(1), shlex.split(m.group(2))))
    return found


def _options(args: list[str]) -> list[tuple[str, list[str]]]:
    """`--flag v1 v2 --other --x=y` -> [("--flag", ["v1", "v2"]), ("--other", []), ("--x", ["y"])]."""
    out: list[tuple[str, list[str]]] = []
    for a in args:
        if a.startswith("--"):
            flag, eq, value = a.partition("=")
            out.append((flag, [value] if eq else []))
        elif out:
            out[-1][1].append(a)
        else:
            raise ValueError(f"a positional argument {a!r}: not a flag")
    return out


def smoke_argv(command: str, documented: list[str]) -> list[str]:
    """A documented command in its smoke size: its own flags where SMOKE_ARGS does not set them (SMOKE_VALUES shrinks
    some), then SMOKE_ARGS. Placeholders ({tmp}, ...) are left for the caller."""
    base = _options(SMOKE_ARGS[command])
    own = dict(_options(documented))

    def emit(flag: str, values: list[str]) -> list[str]:  # a value that looks like a flag goes after "="
        return [f"{flag}={' '.join(values)}"] if any(v.startswith("-") for v in values) else [flag, *values]

    argv = []
    for flag, values in own.items():
        if flag not in dict(base):
            argv += emit(flag, SMOKE_VALUES.get((command, flag), values))
    for flag, values in base:
        argv += emit(flag, [*own.get(flag, []), *values] if flag in JOINED else values)
    return argv


def run_command(command: str, args: list[str], timeout: float) -> str:
    """`command` (a script NAME of PACKAGE, or "llmserve bench SUB") with `args`; its stdout."""
    if command.startswith("llmserve bench "):
        return run_llmserve_bench(command.split()[2], *args, timeout=timeout)
    return run_bench(command, *args, timeout=timeout)


def run_bench(name: str, *args, timeout: float = 240) -> str:
    """Run PACKAGE.NAME without the caller's OTLP settings (a bench starts its own receiver where it needs one);
    fail with its stderr when it exits non-zero; return its stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = subprocess.run([sys.executable, "-m", f"{PACKAGE}.{name}", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{PACKAGE}.{name} exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc.stdout


def run_llmserve_bench(*args, timeout: float = 300) -> str:
    """`llmserve bench ARGS` (the CLI from this tree); fail with its stderr when it exits non-zero; its stdout."""
    proc = subprocess.run([sys.executable, "-m", "llmserve.cli", "bench", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"llmserve bench {args[0]} exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc.stdout


def require_git_checkout() -> None:
    """A baseline revision is checked out into a temporary git worktree: only possible from a git checkout."""
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
