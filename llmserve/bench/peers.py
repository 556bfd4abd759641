"""`llmserve bench peers`: llmserve against vLLM's CPU build and llama.cpp's server on this machine, one server after
the other, each measured by vLLM's own client (`vllm bench serve`) with the same requests, and one table of ratios.

    llmserve bench peers                                    # float32 + bfloat16, concurrency 1, 16, 64, all peers
    llmserve bench peers --quick                            # a smoke run: short requests, concurrency 1 and 4
    llmserve bench peers --dtypes bfloat16 --concurrency 1,16 --peers llmserve,vllm --num-prompts 32
    llmserve bench peers --install-only                     # the venvs and the model directory, nothing served
    llmserve bench peers --hf-model DIR --peers llmserve,vllm --dtypes bfloat16   # both serve one HF checkpoint
    llmserve bench peers --hf-model DIR --peers llmserve,vllm --interleave-rounds 2   # both up, cells in turns

The peers are installed in their own venvs under --peers-dir (hundreds of MB; a source build of llama.cpp) on first
use (llmserve/bench/peer_env.py). The numbers depend on what else runs on the machine: compare within one run.
On a shared machine, --interleave-rounds N starts llmserve and vLLM once each, side by side, and measures every
cell N times in turns (llmserve, vLLM, then vLLM, llmserve, ...): medians per cell and the ratio within each round,
with the load average at each load's start and end (peer_plan.rounds_table).
A second table gives each server process's CPU time per output token during each load (llmserve's API, scheduler,
worker and Redis; vLLM's API server and engine core) and the client's (llmserve/bench/proc_cpu.py)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import resource
import shlex
import subprocess
import sys
import time

from llmserve.bench import peer_plan, proc_cpu

QUICK = {"concurrency": "1,4", "num_prompts": 4, "input_len": 32, "output_len": 16}


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def add_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("what runs")
    w.add_argument("--peers", type=_names, default=list(peer_plan.PEERS),
                   help=f"comma-separated, from {','.join(peer_plan.PEERS)} (default: all)")
    w.add_argument("--dtypes", type=_names, default=list(peer_plan.DTYPES),
                   help="comma-separated: float32, bfloat16 (llmserve's and vLLM's --dtype; llama.cpp runs the GGUF)")
    w.add_argument("--concurrency", type=_ints, default=None, help="requests in flight, comma-separated (1,16,64)")
    w.add_argument("--num-prompts", type=int, default=None,
                   help="prompts per load (default: --prompts-per-concurrency x concurrency, at least --min-prompts)")
    w.add_argument("--prompts-per-concurrency", type=int, default=4)
    w.add_argument("--min-prompts", type=int, default=8)
    w.add_argument("--input-len", type=int, default=None, help="random prompt tokens (128)")
    w.add_argument("--output-len", type=int, default=None, help="output tokens, EOS ignored (64)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--interleave-rounds", type=int, default=0, metavar="N",
                   help="llmserve and vLLM up at once (per dtype), each cell run N times in turns; 0: one server "
                   "after the other, each cell once (the default)")
    w.add_argument("--warmup-prompts", type=int, default=2,
                   help="with --interleave-rounds: prompts sent to each server once it is ready, not measured")
    w.add_argument("--quick", action="store_true",
                   help=f"smoke sizes unless given: concurrency {QUICK['concurrency']}, {QUICK['num_prompts']} "
                   f"prompts, {QUICK['input_len']} -> {QUICK['output_len']} tokens")

    s = p.add_argument_group("servers")
    s.add_argument("--model", default=None, help="the GGUF (default: the bundled SmolLM2-135M-Instruct)")
    s.add_argument("--hf-model", default=None, metavar="DIR",
                   help="an HF checkpoint directory (with its tokenizer) that llmserve and vLLM both serve, instead "
                   "of the GGUF converted; llama.cpp needs a GGUF and is not run with it")
    s.add_argument("--llmserve-model", default=None,
                   help="what llmserve serves: the GGUF (default), 'hf' for the HF directory vLLM serves, or a path")
    s.add_argument("--served-model-name", default="peer-model", help="the name every server answers to")
    s.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="cores for the model: vLLM's VLLM_CPU_OMP_THREADS_BIND=0-(N-1), llama.cpp's --n_threads")
    s.add_argument("--vllm-kvcache-space", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    s.add_argument("--llamacpp-n-ctx", type=int, default=2048)
    s.add_argument("--llmserve-args", default="", help="more `llmserve serve` flags, one string")
    s.add_argument("--vllm-args", default="", help="more `vllm serve` flags, one string")
    s.add_argument("--llamacpp-args", default="", help="more `python -m llama_cpp.server` flags, one string")
    s.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to get ready")
    s.add_argument("--run-timeout", type=float, default=3600.0, help="seconds one `vllm bench serve` may take")

    o = p.add_argument_group("files")
    o.add_argument("--peers-dir", default=None, help="venvs and the model directory (default ~/.cache/llmserve-peers, "
                   "or $LLMSERVE_PEERS_DIR)")
    o.add_argument("--result-dir", default="bench/out/peers", help="the table, the JSON, the logs")
    o.add_argument("--install-only", action="store_true", help="install the peers and write the model directory")
    o.add_argument("--from-json", nargs="+", metavar="FILE", default=None,
                   help="start nothing: one table from the measurements in these earlier runs' JSON files")


def add_command(subparsers) -> None:
    p = subparsers.add_parser("peers", help="llmserve vs vLLM-CPU vs llama.cpp, measured by `vllm bench serve`")
    add_args(p)
    p.set_defaults(func=main)


def resolve(args: argparse.Namespace) -> tuple[list[peer_plan.ServerRun], peer_plan.Workload]:
    """The plan and the workload the flags ask for (--quick fills what was not given); SystemExit naming the flag."""
    quick = QUICK if args.quick else {}
    concurrency = args.concurrency or _ints(quick.get("concurrency", "1,16,64"))
    fixed = args.num_prompts if args.num_prompts is not None else quick.get("num_prompts")
    workload = peer_plan.Workload(input_len=args.input_len or quick.get("input_len", 128),
                                  output_len=args.output_len or quick.get("output_len", 64), seed=args.seed)
    try:
        plan = peer_plan.build_plan(args.peers, args.dtypes, concurrency, per_slot=args.prompts_per_concurrency,
                                    minimum=args.min_prompts, fixed=fixed)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if getattr(args, "hf_model", None) is not None:
        if any(r.peer == "llamacpp" for r in plan):
            raise SystemExit("--hf-model: llama.cpp serves a GGUF only; drop llamacpp from --peers")
        if not os.path.isfile(os.path.join(args.hf_model, "config.json")):
            raise SystemExit(f"--hf-model {args.hf_model}: no config.json there")
    if getattr(args, "interleave_rounds", 0):
        if any(r.peer == "llamacpp" for r in plan):
            raise SystemExit("--interleave-rounds: llmserve and vLLM only; drop llamacpp from --peers")
        if args.interleave_rounds < 0 or args.warmup_prompts < 0:
            raise SystemExit(f"--interleave-rounds and --warmup-prompts must be >= 0, got {args.interleave_rounds} "
                             f"and {args.warmup_prompts}")
    for name, value in (("--input-len", workload.input_len), ("--output-len", workload.output_len),
                        ("--threads", args.threads)):
        if value < 1:
            raise SystemExit(f"{name} must be >= 1, got {value}")
    return plan, workload


def _machine() -> dict:
    info = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    return info


def _load_average() -> list[float] | None:
    try:
        return [round(x, 1) for x in os.getloadavg()]
    except OSError:
        return None


class _Results:
    """Measurements so far, rewritten as JSON and Markdown after each one (a long run interrupted keeps them)."""

    def __init__(self, result_dir: str, workload: peer_plan.Workload, meta: dict):
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.json_path = os.path.join(result_dir, f"peers-{stamp}.json")
        self.md_path = os.path.join(result_dir, f"peers-{stamp}.md")
        self.workload, self.meta, self.items = workload, meta, []

    def add(self, m: peer_plan.Measurement) -> None:
        m.extra["load_average"] = self.meta["load_average_end"] = _load_average()  # the box's noise, per load
        self.items.append(m)
        with open(self.json_path, "w") as f:
            json.dump({**self.meta, "measurements": [x.to_json() for x in self.items]}, f, indent=1)
        with open(self.md_path, "w") as f:
            f.write(self.markdown())

    def markdown(self) -> str:
        w = self.workload
        return (f"`{self.meta['command']}`\n\n{self.meta['date']}, {self.meta['machine'].get('cpu')}, "
                f"{self.meta['machine']['cpus']} CPUs, load average at start {self.meta['load_average_start']}; "
                f"`vllm bench serve`: random prompts of {w.input_len} tokens, {w.output_len} output tokens, "
                "--ignore-eos, /v1/completions. Cells: output tokens/s (median TPOT, median TTFT).\n\n"
                + self._tables() + peer_plan.cpu_table(self.items) + self._servers())

    def _tables(self) -> str:
        if self.meta.get("interleave_rounds"):
            return peer_plan.rounds_table(self.items)
        return peer_plan.markdown_table(self.items, self.workload.output_len)

    def _servers(self) -> str:
        """Each server's start-up time and host memory once ready (the load's peak: weights and KV cache)."""
        servers = self.meta.get("servers") or {}
        if not servers:
            return ""
        lines = ["", "Servers once ready: start-up seconds, peak / current RSS by process (GB):", ""]
        for name, s in servers.items():
            parts = ", ".join(f"{label} {v['peak_rss'] / 1e9:.2f} / {v['rss'] / 1e9:.2f}"
                              for label, v in sorted(s["memory"].items(), key=lambda kv: -kv[1]["peak_rss"])
                              if v["peak_rss"] > 50e6)
            lines.append(f"- {name}: {s['startup_s']:.0f} s; {parts}")
        return "\n".join(lines) + "\n"


def _run_load(vllm_cli, server, args, run, load, workload, result_dir, tag: str = "",
              idle: dict | None = None) -> peer_plan.Measurement:
    """One `vllm bench serve` load against `server`; `idle` ({name: Started}) are servers left up beside it, whose
    CPU seconds during the load are kept (what an idle server takes from the one measured)."""
    name = f"{run.peer}-{run.dtype}-c{load.concurrency}{tag}.json"
    argv = peer_plan.bench_serve_argv(vllm_cli, server.base_url, args.served_model_name, args.tokenizer_dir, load,
                                      workload, result_dir, name)
    log_path = os.path.join(result_dir, f"client-{run.peer}-{run.dtype}-c{load.concurrency}{tag}.log")
    print(f"[peers] {run.peer} {run.dtype} concurrency {load.concurrency}: {load.num_prompts} prompts",
          file=sys.stderr, flush=True)
    path = os.path.join(result_dir, name)
    if os.path.exists(path):
        os.remove(path)
    load_start = _load_average()
    idle_before = {n: proc_cpu.snapshot(s.proc.pid) for n, s in (idle or {}).items()}
    cpu_before, client_before = proc_cpu.snapshot(server.proc.pid), _children_cpu()
    with open(log_path, "w") as log:
        try:
            done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=args.run_timeout)
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    cpu = proc_cpu.spent(cpu_before, proc_cpu.snapshot(server.proc.pid))
    cpu["client"] = _children_cpu() - client_before
    idle_cpu = {n: round(sum(proc_cpu.spent(idle_before[n], proc_cpu.snapshot(s.proc.pid)).values()), 2)
                for n, s in (idle or {}).items()}
    extra = {"load_average_start": load_start, **({"idle_servers_cpu_s": idle_cpu} if idle else {})}
    if code != 0 or not os.path.exists(path):
        with open(log_path, errors="replace") as f:
            tail = f.read()[-300:].replace("\n", " ")
        return peer_plan.Measurement(run.peer, run.dtype, load.concurrency, load.num_prompts,
                                     error=f"client exit {code}: {tail}", extra={"client_log": log_path, **extra})
    with open(path) as f:
        m = peer_plan.parse_result(json.load(f), run.peer, run.dtype, load)
    m.extra.update(client_log=log_path, **extra)
    m.extra["cpu_us_per_token"] = peer_plan.cpu_per_token(cpu, m)
    return m


def _children_cpu() -> float:
    """User + system CPU seconds of this process's finished children: the client runs one at a time (its start-up,
    imports and tokenizer included)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def merged_table(paths: list[str]) -> str:
    """One table from the measurements of several runs' JSON files (each run's command and date listed above it:
    runs at different times saw different loads on the machine)."""
    items, heads, output_len = [], [], None
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        heads.append(f"- `{run['command']}` ({run['date']}, load average at start {run['load_average_start']})")
        output_len = output_len or run["workload"]["output_len"]
        items += [peer_plan.Measurement(**m) for m in run["measurements"]]
    return "\n".join(heads) + "\n\n" + peer_plan.markdown_table(items, output_len or 0)


def _interleaved(runs: list[peer_plan.ServerRun], spec_of, vllm_cli, args, workload, results: _Results) -> None:
    """The servers of one dtype started one after the other and left up together, each warmed with a few
    unmeasured prompts, then every cell in turns (peer_plan.interleaved_turns). A server that does not start ends
    the dtype's run: a cell with one server has no ratio to give (the error is raised)."""
    from llmserve.bench import peer_servers

    with contextlib.ExitStack() as stack:
        servers = {}
        for run in runs:
            spec = spec_of(run)
            log_path = os.path.join(args.result_dir, f"server-{run.peer}-{run.dtype}.log")
            print(f"[peers] starting {run.peer} ({run.dtype}), log {log_path}", file=sys.stderr, flush=True)
            server = stack.enter_context(peer_servers.started(spec, args.served_model_name, log_path,
                                                              args.start_timeout))
            results.meta.setdefault("servers", {})[f"{run.peer} {run.dtype}"] = {
                "startup_s": round(server.startup_s, 1), "memory": proc_cpu.memory(server.proc.pid),
                "argv": spec.argv, "log": log_path}
            print(f"[peers] {run.peer} ready in {server.startup_s:.0f} s", file=sys.stderr, flush=True)
            servers[run.peer] = (run, server)
        for run, server in servers.values():
            if args.warmup_prompts:
                warm = peer_plan.Load(min(args.warmup_prompts, run.loads[0].concurrency), args.warmup_prompts)
                m = _run_load(vllm_cli, server, args, run, warm, workload, args.result_dir, "-warmup")
                print(f"[peers] {run.peer} warm-up: {m.output_throughput or m.error} tok/s", file=sys.stderr)
        for turn in peer_plan.interleaved_turns(list(servers), runs[0].loads, args.interleave_rounds):
            run, server = servers[turn.peer]
            idle = {f"{peer} {other.dtype}": s for peer, (other, s) in servers.items() if peer != turn.peer}
            m = _run_load(vllm_cli, server, args, run, turn.load, workload, args.result_dir, f"-r{turn.round}",
                          idle=idle)
            m.extra.update(round=turn.round, startup_s=round(server.startup_s, 1))
            results.add(m)


def main(args: argparse.Namespace) -> None:
    from llmserve.bench import peer_env, peer_servers

    if args.from_json:
        print(merged_table(args.from_json))
        return
    plan, workload = resolve(args)
    peers_dir = args.peers_dir or peer_env.default_dir()
    os.makedirs(peers_dir, exist_ok=True)
    os.makedirs(args.result_dir, exist_ok=True)
    gguf = args.model
    if args.hf_model is None and gguf is None:
        from worker_svc.model.loader import default_model_path

        gguf = default_model_path()

    # Installs first, so a broken install ends the run before any server starts. vLLM's client runs every load.
    vllm_cli = peer_env.install_vllm(peers_dir)
    llamacpp_cli = peer_env.install_llamacpp(peers_dir) if any(r.peer == "llamacpp" for r in plan) else None
    args.tokenizer_dir = hf_dir = args.hf_model or peer_env.make_hf_model_dir(peers_dir, gguf)
    if args.install_only:
        print(f"[peers] installed under {peers_dir}; model directory {hf_dir}", file=sys.stderr)
        return
    llmserve_model = {None: gguf or hf_dir, "hf": hf_dir}.get(args.llmserve_model, args.llmserve_model)

    prog = "llmserve" if sys.argv[0].endswith(("llmserve", "cli.py")) else "python -m llmserve.bench.peers"
    meta = {"command": shlex.join([prog, *sys.argv[1:]]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": _machine(), "load_average_start": _load_average(), "workload": workload.__dict__,
            "gguf": gguf, "hf_dir": hf_dir, "llmserve_model": llmserve_model,
            "plan": [{"peer": r.peer, "dtype": r.dtype, "loads": [load.__dict__ for load in r.loads]} for r in plan]}
    meta["interleave_rounds"] = args.interleave_rounds
    results = _Results(args.result_dir, workload, meta)

    def spec_of(run: peer_plan.ServerRun):
        if run.peer == "llmserve":
            return peer_servers.llmserve_spec(llmserve_model, run.dtype, args.served_model_name,
                                              shlex.split(args.llmserve_args), os.path.join(peers_dir, "gguf-cache"))
        if run.peer == "vllm":
            return peer_servers.vllm_spec(vllm_cli, hf_dir, run.dtype, args.served_model_name,
                                          shlex.split(args.vllm_args), threads_bind=f"0-{args.threads - 1}",
                                          kvcache_gib=args.vllm_kvcache_space)
        return peer_servers.llamacpp_spec(llamacpp_cli, gguf, args.served_model_name, shlex.split(args.llamacpp_args),
                                          threads=args.threads, n_ctx=args.llamacpp_n_ctx)

    if args.interleave_rounds:
        for dtype in dict.fromkeys(r.dtype for r in plan):
            _interleaved([r for r in plan if r.dtype == dtype], spec_of, vllm_cli, args, workload, results)
    for run in plan if not args.interleave_rounds else []:
        spec = spec_of(run)
        log_path = os.path.join(args.result_dir, f"server-{run.peer}-{run.dtype}.log")
        print(f"[peers] starting {run.peer} ({run.dtype}), log {log_path}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            with peer_servers.started(spec, args.served_model_name, log_path, args.start_timeout) as server:
                print(f"[peers] {run.peer} ready in {server.startup_s:.0f} s", file=sys.stderr, flush=True)
                for load in run.loads:
                    m = _run_load(vllm_cli, server, args, run, load, workload, args.result_dir)
                    m.extra.update(startup_s=round(server.startup_s, 1), server_log=log_path, server_argv=spec.argv)
                    results.add(m)
        except RuntimeError as e:  # a server that did not start: its loads are reported as failed, the rest go on
            print(f"[peers] {run.peer} ({run.dtype}) failed after {time.monotonic() - t0:.0f} s: {e}",
                  file=sys.stderr, flush=True)
            done = {(m.peer, m.dtype, m.concurrency) for m in results.items}
            for load in run.loads:
                if (run.peer, run.dtype, load.concurrency) not in done:
                    results.add(peer_plan.Measurement(run.peer, run.dtype, load.concurrency, load.num_prompts,
                                                      error=f"server: {str(e).splitlines()[0]}",
                                                      extra={"server_log": log_path}))
    print(results.markdown())
    print(f"[peers] {results.md_path}, {results.json_path}", file=sys.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m llmserve.bench.peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    main(parser.parse_args())
