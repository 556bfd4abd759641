"""compose.yaml: valid against the compose specification's JSON schema, and its commands and health checks run
outside Docker against real processes (hosts and ports swapped for local ones, secrets from the environment)."""

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import yaml

from tests.support import cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
COMPOSE = yaml.safe_load(open(os.path.join(ROOT, "compose.yaml")))
PASSWORD = "test-pass"
TOKEN = "test-token"
BUDGET = "${LLMSERVE_MAX_NUM_BATCHED_TOKENS:-8192}"  # the scheduler's and the worker's, one variable
TOKENIZER = "${LLMSERVE_TOKENIZER:-${LLMSERVE_MODEL:-/models/model.gguf}}"  # the api's: the model file by default


def env() -> dict:
    return dict(os.environ, PATH=BIN + os.pathsep + os.environ["PATH"], REDIS_PASSWORD=PASSWORD,
                LLMSERVE_WORKER_TOKEN=TOKEN, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")


def unescape(arg: str) -> str:
    return arg.replace("$$", "$")  # compose's escape for a `$` the container's shell expands


def run_check(service: str, replace: dict) -> subprocess.CompletedProcess:
    test = COMPOSE["services"][service]["healthcheck"]["test"]
    if test[0] == "CMD-SHELL":
        argv = ["sh", "-c", unescape(test[1])]
    else:
        assert test[0] == "CMD"
        argv = [unescape(a) for a in test[1:]]
    argv = [_sub(a, replace) for a in argv]
    return subprocess.run(argv, env=env(), capture_output=True, text=True, timeout=30, cwd=ROOT)


def _sub(arg: str, replace: dict) -> str:
    for old, new in replace.items():
        arg = arg.replace(old, new)
    return arg


def test_compose_file_matches_the_compose_spec():
    exe = shutil.which("check-jsonschema", path=BIN) or shutil.which("check-jsonschema")
    if exe is None:
        pytest.fail("check-jsonschema is not installed: pip install -e '.[test]'")
    proc = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", os.path.join(ROOT, "compose.yaml")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_services_and_policies():
    svc = COMPOSE["services"]
    assert {"redis", "scheduler", "worker", "api", "otel-collector"} <= set(svc)
    assert svc["otel-collector"]["profiles"] == ["tracing"]
    for name in ("redis", "scheduler", "worker", "api"):
        assert svc[name]["restart"] in ("unless-stopped", "always", "on-failure"), name
        assert "healthcheck" in svc[name], name
    assert svc["worker"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert any(v.endswith(":ro") for v in svc["worker"]["volumes"])
    # the worker warms up with the scheduler's step size before it sizes its KV pool: both get the one variable
    for worker, scheduler in (("worker", "scheduler"), ("worker-b", "scheduler-b")):
        w = svc[worker]["command"]
        assert w[w.index("--max-num-batched-tokens") + 1] == BUDGET, worker
        assert f"--max-num-batched-tokens {BUDGET}" in svc[scheduler]["command"][-1], scheduler
    assert "--appendonly yes" in svc["redis"]["command"][-1] and "--requirepass" in svc["redis"]["command"][-1]


def test_fleet_profile_smg_and_two_pools():
    svc = COMPOSE["services"]
    for name in ("worker-b", "scheduler-b", "smg"):
        assert svc[name]["profiles"] == ["fleet"], name
        assert svc[name]["restart"] == "unless-stopped" and "healthcheck" in svc[name], name
    # two pools, each its own scheduler, worker and Redis namespace
    a, b = svc["scheduler"]["command"][-1], svc["scheduler-b"]["command"][-1]
    assert "--namespace" not in a and "--namespace pool-b" in b  # pool A keeps the default namespace "llmserve"
    assert "--worker-address worker:50061" in a and "--worker-address worker-b:50061" in b
    cmd = svc["smg"]["command"]
    assert svc["smg"]["entrypoint"] == ["smg"] and cmd[:3] == ["launch", "--backend", "vllm"]
    urls = cmd[cmd.index("--worker-urls") + 1:]
    assert urls == ["grpc://scheduler:50051", "grpc://scheduler-b:50051"]
    assert "--policy" in cmd and "8080" in svc["smg"]["healthcheck"]["test"][-1]
    assert set(svc["smg"]["depends_on"]) == {"scheduler", "scheduler-b"}


def test_fleet_smg_command_parses():
    """The smg command line of the fleet profile is one the installed smg accepts (its own parser, --help)."""
    cmd = [unescape(a) for a in COMPOSE["services"]["smg"]["command"]]
    cmd = [_sub(a, {"${SMG_POLICY:-cache_aware}": "cache_aware"}) for a in cmd]
    import argparse

    from smg.router_args import RouterArgs  # the wheel's own argument definitions

    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser)
    args = parser.parse_args(cmd[1:])
    assert args.policy == "cache_aware" and len(args.worker_urls) == 2


@pytest.fixture(scope="module")
def stack():
    """The compose commands, run locally: redis (password), worker (token), scheduler (both)."""
    svc = COMPOSE["services"]
    tmp = tempfile.mkdtemp(prefix="llmserve-compose-")
    rport = cluster.free_port()
    redis_cmd = [unescape(a) for a in svc["redis"]["command"]]
    redis_cmd[-1] += f" --port {rport} --bind 127.0.0.1 --dir {tmp}"
    redis = subprocess.Popen(redis_cmd, env=env(), cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                             start_new_session=True)
    procs = [redis]
    try:
        deadline = time.monotonic() + 20
        while run_check("redis", {"redis-cli": f"redis-cli -p {rport}"}).returncode != 0:
            assert time.monotonic() < deadline and redis.poll() is None, "redis did not start"
            time.sleep(0.2)
        # The worker's command, with a free port and the bundled model, plus a test-sized pool.
        from worker_svc.model.loader import default_model_path

        wargs = [_sub(unescape(a), {"50061": "0", "${LLMSERVE_MODEL:-/models/model.gguf}": default_model_path(),
                                           "${LLMSERVE_TENSOR_PARALLEL_SIZE:-1}": "1", BUDGET: "256"})
                 for a in svc["worker"]["command"]]
        assert wargs[0] == "worker"
        w = cluster.start_worker([*wargs[1:], "--host", "127.0.0.1", "--device", "cpu",
                                  "--num-gpu-blocks-override", "64", "--max-model-len", "512",
                                  "--worker-token", TOKEN])
        sport, mport = cluster.free_port(), cluster.free_port()
        scmd = [_sub(unescape(a), {"--port 50051": f"--port {sport}", "--metrics-port 9090": f"--metrics-port {mport}",
                                   "worker:50061": w.address, "@redis:6379": f"@127.0.0.1:{rport}",
                                   "0.0.0.0": "127.0.0.1", BUDGET: "256"}) for a in svc["scheduler"]["command"]]
        log = open(os.path.join(tmp, "scheduler.log"), "wb")
        sched = subprocess.Popen(scmd, env=env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        procs.append(sched)
        yield {"redis_port": rport, "worker": w, "scheduler_port": sport, "scheduler": sched, "tmp": tmp}
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        cluster.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


def test_redis_requires_the_password(stack):
    proc = subprocess.run(["redis-cli", "-p", str(stack["redis_port"]), "ping"], capture_output=True, text=True,
                          timeout=10)
    assert "NOAUTH" in proc.stdout + proc.stderr
    assert run_check("redis", {"redis-cli": f"redis-cli -p {stack['redis_port']}"}).returncode == 0


def test_worker_healthcheck(stack):
    proc = run_check("worker", {"127.0.0.1:50061": stack["worker"].address})
    assert proc.returncode == 0 and "SERVING" in proc.stdout, proc.stdout + proc.stderr


def test_scheduler_healthcheck(stack):
    addr = f"127.0.0.1:{stack['scheduler_port']}"
    deadline = time.monotonic() + 90
    while (proc := run_check("scheduler", {"127.0.0.1:50051": addr})).returncode != 0:
        log = open(os.path.join(stack["tmp"], "scheduler.log"), errors="replace").read()
        assert stack["scheduler"].poll() is None, log[-4000:]
        assert time.monotonic() < deadline, proc.stdout + log[-4000:]
        time.sleep(0.5)
    assert proc.stdout.strip() == "SERVING"


def test_api_command_and_healthcheck(stack, bundled_model_path):
    """The api service's command (local ports, the bundled model as --tokenizer) serves OpenAI's API, and its
    health check passes once the scheduler behind it is SERVING."""
    import httpx

    hport = cluster.free_port()
    cmd = [_sub(unescape(a), {"8000": str(hport), "scheduler:50051": f"127.0.0.1:{stack['scheduler_port']}",
                              "0.0.0.0": "127.0.0.1", TOKENIZER: bundled_model_path,
                              "@redis:6379": f"@127.0.0.1:{stack['redis_port']}"})
           for a in COMPOSE["services"]["api"]["command"]]
    assert cmd[:2] == ["sh", "-c"] and cmd[2].startswith("exec llmserve api ")  # the Redis URL built in its shell
    api = subprocess.Popen(cmd, env=env(), cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while (proc := run_check("api", {"8000": str(hport)})).returncode != 0:
            assert api.poll() is None and time.monotonic() < deadline, proc.stdout + proc.stderr
            time.sleep(0.5)
        models = httpx.get(f"http://127.0.0.1:{hport}/v1/models", timeout=60).json()
        assert models["data"][0]["max_model_len"] == 512
        # It reached the password-protected Redis: a stored response can be fetched back.
        made = httpx.post(f"http://127.0.0.1:{hport}/v1/responses", json={"input": "Hi", "max_output_tokens": 2},
                          timeout=120).json()
        assert httpx.get(f"http://127.0.0.1:{hport}/v1/responses/{made['id']}", timeout=60).json()["id"] == made["id"]
    finally:
        api.terminate()
        api.wait(timeout=15)


def test_healthcheck_fails_when_nothing_listens():
    proc = run_check("scheduler", {"127.0.0.1:50051": f"127.0.0.1:{cluster.free_port()}"})
    assert proc.returncode == 1 and "UNAVAILABLE" in proc.stdout
