"""TLS between the processes, with real processes and throw-away certificates made here:

- the HTTP API (compose.yaml's api command and TLS variables): HTTPS to an `openai` client trusting the CA, TLS to
  the scheduler, a client certificate for a mutual-TLS scheduler, and a clear 503 when it lacks the CA;

- a worker serving mutual TLS (--tls-cert/--tls-key/--tls-client-ca): a scheduler with the right --worker-tls-*
  drives it end to end; a plaintext scheduler, one trusting another CA, and one without a client certificate
  stay NOT_SERVING and log why;
- the scheduler's public server over TLS: a client trusting the CA gets a generation (gRPC and `llmserve generate`),
  a plaintext client gets UNAVAILABLE, `llmserve health --tls-ca` says SERVING; with --tls-client-ca a client needs
  a certificate;
- Redis: a password and TLS in --redis-url work (the end-to-end scheduler above uses rediss:// with a password);
  a wrong or missing password, plaintext to a TLS-only port or an untrusted certificate end the scheduler at start
  with a message naming --redis-url and never showing the password;
- bad flag combinations fail at start naming the flags.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import tls
from llmserve import processes
from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from scheduler_svc.servers.process import LISTENING_LINE
from tests.support import cli_forks, cluster
from tests.support.cli_forks import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REDIS_PASSWORD = "Redis-pw-7f3a9"  # must never appear in a scheduler's output


# ---- throw-away PKI -------------------------------------------------------------------------------------------

def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, key, issuer: str, issuer_key, *, ca: bool = False, san=None, usage=None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                          content_commitment=False, key_encipherment=False, data_encipherment=False,
                                          key_agreement=False, encipher_only=False, decipher_only=False),
                            critical=True)
    if san:
        b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
    if usage:
        b = b.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(path: Path, obj) -> str:
    if isinstance(obj, x509.Certificate):
        data = obj.public_bytes(serialization.Encoding.PEM)
    else:
        data = obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
    path.write_bytes(data)
    return str(path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """Paths of a CA, a server certificate for localhost/127.0.0.1, a client certificate (both signed by the CA)
    and an unrelated CA. Keys live in a temporary directory only."""
    d = tmp_path_factory.mktemp("pki")
    ca_key, other_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(4))
    ca = _issue("llmserve test CA", ca_key, "llmserve test CA", ca_key, ca=True)
    other = _issue("some other CA", other_key, "some other CA", other_key, ca=True)
    server = _issue("localhost", server_key, "llmserve test CA", ca_key, usage=[ExtendedKeyUsageOID.SERVER_AUTH],
                    san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client = _issue("scheduler", client_key, "llmserve test CA", ca_key, usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
    return {"ca": _write(d / "ca.pem", ca), "other_ca": _write(d / "other-ca.pem", other),
            "server_cert": _write(d / "server.pem", server), "server_key": _write(d / "server.key", server_key),
            "client_cert": _write(d / "client.pem", client), "client_key": _write(d / "client.key", client_key)}


# ---- helpers --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def _cli_preloaded():
    """The file's 20 command lines run in processes forked from one that imported the CLI once
    (tests/support/cli_forks.py); started with the module, so that its imports overlap the worker's start."""
    cli_forks.run_cli("--help")


def assert_fails(proc: subprocess.CompletedProcess, *needles: str) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    for n in needles:
        assert n in out, f"{n!r} not in:\n{out[-3000:]}"
    assert "Traceback" not in out, out[-3000:]
    return out


def wait_for_log(proc: cluster.Proc, needle: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while needle not in proc.log_text():
        if not proc.alive() or time.monotonic() > deadline:
            raise AssertionError(f"{needle!r} not in the log of {proc.describe()}:\n{proc.log_tail()}")
        time.sleep(0.1)
    return proc.log_text()


def health(address: str, credentials=None) -> str:
    """grpc.health.v1 status name over TLS (or plaintext with credentials None), or the error code name."""
    with tls.open_channel(address, credentials) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def generate(address: str, credentials) -> list[int]:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3, 4]),
                             sampling=pb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    with tls.open_channel(address, credentials) as channel:
        return [t for msg in pb_grpc.LLMServeStub(channel).Generate(req, timeout=120) for t in msg.token_ids]


def redis_with(tmp: Path, *args: str) -> processes.RedisServer:
    """A redis-server with extra flags (password, TLS ports; "{port}" is its port) on a free loopback port."""
    try:
        return processes.start_redis(str(tmp), extra_args=args)
    except processes.ProcError as e:
        pytest.fail(f"redis-server {' '.join(args)} did not start: {e}", pytrace=False)


@pytest.fixture(scope="module")
def redis_pw(tmp_path_factory):
    """Plaintext Redis that requires REDIS_PASSWORD; yields its port."""
    proc = redis_with(tmp_path_factory.mktemp("redis-pw"), "--requirepass", REDIS_PASSWORD)
    yield proc.port
    processes.kill(proc)


@pytest.fixture(scope="module")
def redis_tls(tmp_path_factory, pki):
    """TLS-only Redis (no plaintext port) that also requires REDIS_PASSWORD; yields its port."""
    proc = redis_with(tmp_path_factory.mktemp("redis-tls"), "--port", "0", "--tls-port", "{port}",
                       "--tls-cert-file", pki["server_cert"], "--tls-key-file", pki["server_key"],
                       "--tls-ca-cert-file", pki["ca"], "--tls-auth-clients", "no", "--requirepass", REDIS_PASSWORD)
    yield proc.port
    processes.kill(proc)


@pytest.fixture(scope="module")
def worker(pki):
    """One worker serving mutual TLS: clients need a certificate signed by the test CA."""
    w = cluster.start_worker(["--device", "cpu", "--num-gpu-blocks-override", "32", "--max-model-len", "256",
                              "--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"],
                              "--tls-client-ca", pki["ca"]])
    yield w
    cluster.stop_all()


def worker_tls_args(pki) -> list[str]:
    return ["--worker-tls-ca", pki["ca"], "--worker-tls-cert", pki["client_cert"], "--worker-tls-key",
            pki["client_key"]]


# ---- the worker's TLS -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["plaintext", "other CA", "no client certificate"])
def test_scheduler_that_cannot_pass_the_workers_tls_stays_not_serving(redis_tls, pki, worker, case):
    url = f"rediss://:{REDIS_PASSWORD}@127.0.0.1:{redis_tls}/0?ssl_ca_certs={pki['ca']}"
    args, why = {
        "plaintext": ([], "if it serves TLS, give --worker-tls-ca"),
        "other CA": (["--worker-tls-ca", pki["other_ca"], "--worker-tls-cert", pki["client_cert"],
                      "--worker-tls-key", pki["client_key"]], "CERTIFICATE_VERIFY_FAILED"),
        "no client certificate": (["--worker-tls-ca", pki["ca"]], "needs a client certificate"),
    }[case]
    s = cluster.start_scheduler(url, worker, args)
    try:
        log = wait_for_log(s, "waiting for worker")
        assert why in log, log[-3000:]
        assert health(s.address) == "NOT_SERVING"
        assert s.alive()
    finally:
        cluster.stop(s)
    if case == "no client certificate":  # the worker says why on its side (gRPC's handshake log)
        assert "PEER_DID_NOT_RETURN_A_CERTIFICATE" in worker.log_text()


@pytest.fixture(scope="module")
def tls_scheduler(redis_tls, pki, worker):
    """Public server over TLS, worker over mutual TLS, Redis over TLS with a password: the whole path encrypted."""
    url = f"rediss://:{REDIS_PASSWORD}@localhost:{redis_tls}/0?ssl_ca_certs={pki['ca']}&ssl_cert_reqs=required"
    s = cluster.start_scheduler(url, worker, [*worker_tls_args(pki), "--worker-tls-server-name", "localhost",
                                              "--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"],
                                              "--max-num-batched-tokens", "64"])
    creds = tls.channel_credentials(pki["ca"])
    deadline = time.monotonic() + 90
    while (status := health(s.address, creds)) != "SERVING":
        if not s.alive() or time.monotonic() > deadline:
            raise AssertionError(f"scheduler not SERVING (last {status}):\n{s.log_tail()}")
        time.sleep(0.2)
    yield s
    cluster.stop(s)


def test_tls_everywhere_serves_a_generation(tls_scheduler, pki):
    assert len(generate(tls_scheduler.address, tls.channel_credentials(pki["ca"]))) == 4
    log = tls_scheduler.log_text()
    assert "(TLS; worker" in log and "over TLS" in log
    assert REDIS_PASSWORD not in log and ":***@" in log


def test_public_tls_refuses_plaintext_and_untrusting_clients(tls_scheduler, pki):
    with pytest.raises(grpc.RpcError) as err:
        generate(tls_scheduler.address, None)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert health(tls_scheduler.address) == "UNAVAILABLE"
    # A client that does not trust the server's CA cannot connect either.
    assert health(tls_scheduler.address, tls.channel_credentials(pki["other_ca"])) == "UNAVAILABLE"


def test_cli_health_and_generate_over_tls(tls_scheduler, pki):
    ok = run_cli("health", "--address", tls_scheduler.address, "--tls-ca", pki["ca"])
    assert (ok.returncode, ok.stdout.strip()) == (0, "SERVING"), ok.stderr
    plain = run_cli("health", "--address", tls_scheduler.address)
    assert (plain.returncode, plain.stdout.strip()) == (1, "UNAVAILABLE")
    gen = run_cli("generate", "--server", f"localhost:{tls_scheduler.port}", "--tls-ca", pki["ca"], "--json",
                  "--max-tokens", 4, "--ignore-eos", "--temperature", 0, "Hello")
    assert gen.returncode == 0, gen.stderr
    assert '"finish_reason": "length"' in gen.stdout.splitlines()[-1]
    refused = run_cli("generate", "--server", tls_scheduler.address, "--retry-seconds", 0, "Hello")
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr


def test_public_mutual_tls_needs_a_client_certificate(redis_pw, pki):
    """--tls-client-ca on the scheduler: no certificate, no answer (the worker address is unused: NOT_SERVING)."""
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis_pw}/0"
    s = cluster.start_scheduler(url, f"127.0.0.1:{cluster.free_port()}",
                                ["--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"],
                                 "--tls-client-ca", pki["ca"]])
    try:
        assert health(s.address, tls.channel_credentials(pki["ca"])) == "UNAVAILABLE"
        with_cert = tls.channel_credentials(pki["ca"], pki["client_cert"], pki["client_key"])
        assert health(s.address, with_cert) == "NOT_SERVING"
        out = run_cli("health", "--address", s.address, "--tls-ca", pki["ca"], "--tls-cert", pki["client_cert"],
                      "--tls-key", pki["client_key"])
        assert out.stdout.strip() == "NOT_SERVING"
    finally:
        cluster.stop(s)


# ---- Redis: password and TLS in --redis-url -------------------------------------------------------------------

def test_redis_password_in_the_url_works(redis_pw):
    ns = cluster.new_namespace("tls")
    s = cluster.start_scheduler(f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis_pw}/0",
                                f"127.0.0.1:{cluster.free_port()}", namespace=ns)
    try:
        wait_for_log(s, "waiting for worker")  # it took the lease in Redis, then looked for the worker
        with redis.Redis(port=redis_pw, password=REDIS_PASSWORD) as c:
            assert any(ns in k.decode() for k in c.keys("*")), "no key of its namespace in Redis"
        assert REDIS_PASSWORD not in s.log_text()
    finally:
        cluster.stop(s)


@pytest.mark.parametrize("case", ["wrong password", "no password", "plaintext to TLS port", "untrusted CA"])
def test_scheduler_exits_when_redis_refuses(redis_pw, redis_tls, pki, case):
    url, needles = {
        "wrong password": (f"redis://:{REDIS_PASSWORD}-wrong@127.0.0.1:{redis_pw}/0",
                           ["--redis-url", ":***@", "refused the credentials"]),
        "no password": (f"redis://127.0.0.1:{redis_pw}/0", ["--redis-url", "refused the credentials"]),
        "plaintext to TLS port": (f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis_tls}/0",
                                  ["--redis-url", ":***@", "rediss://"]),
        "untrusted CA": (f"rediss://:{REDIS_PASSWORD}@127.0.0.1:{redis_tls}/0?ssl_ca_certs={pki['other_ca']}",
                         ["--redis-url", "CERTIFICATE_VERIFY_FAILED", "ssl_ca_certs"]),
    }[case]
    proc = run_cli("scheduler", "--host", "127.0.0.1", "--port", 0, "--redis-url", url, "--worker-address",
                   "127.0.0.1:1")
    out = assert_fails(proc, *needles)
    assert REDIS_PASSWORD not in out
    # At start, not after a retry loop: it never listened, and no iteration ran to fail and retry.
    assert LISTENING_LINE.split()[0] not in out and "retrying" not in out, out[-3000:]


# ---- flag combinations ----------------------------------------------------------------------------------------

def test_tls_flags_that_cannot_work_fail_at_start(pki):
    redis_url = "redis://127.0.0.1:1/0"  # never reached: the flags are checked first
    assert_fails(run_cli("worker", "--port", 0, "--tls-cert", pki["server_cert"]), "--tls-cert", "--tls-key")
    assert_fails(run_cli("worker", "--port", 0, "--tls-client-ca", pki["ca"]), "--tls-client-ca", "--tls-cert")
    assert_fails(run_cli("worker", "--port", 0, "--tls-cert", pki["server_cert"], "--tls-key", pki["client_key"]),
                 "--tls-cert", "--tls-key", "cannot use")
    assert_fails(run_cli("scheduler", "--redis-url", redis_url, "--tls-key", pki["server_key"]),
                 "--tls-key", "--tls-cert")
    assert_fails(run_cli("scheduler", "--redis-url", redis_url, "--worker-tls-cert", pki["client_cert"],
                         "--worker-tls-key", pki["client_key"]), "--worker-tls-cert", "--worker-tls-ca")
    assert_fails(run_cli("scheduler", "--redis-url", redis_url, "--worker-tls-ca", "/nonexistent/ca.pem"),
                 "--worker-tls-ca", "/nonexistent/ca.pem")
    assert_fails(run_cli("serve", "--redis-url", redis_url, "--worker-tls-ca", pki["ca"]),
                 "--worker-tls-ca", "llmserve serve")


def test_serve_parses_the_tls_flags_and_keeps_its_worker_plaintext():
    """`llmserve serve` has the scheduler's and the worker's flags on one parser: --tls-* secure its public server;
    its loopback worker gets none of them."""
    from common.config import from_namespace
    from llmserve.cli import build_parser
    from llmserve.serve import worker_argv
    from worker_svc.config import WorkerConfig

    args = build_parser().parse_args(["serve", "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem",
                                      "--worker-token", "t"])
    assert (args.tls_cert, args.tls_key, args.tls_client_ca, args.worker_tls_ca) == ("c.pem", "k.pem", "ca.pem", None)
    argv = worker_argv(from_namespace(WorkerConfig, args), 50061)
    assert not any(a.startswith("--tls") for a in argv) and argv[argv.index("--worker-token") + 1] == "t"


def test_redact_url_hides_every_password():
    from scheduler_svc.servers.process import redact_url

    assert redact_url("redis://:hunter2@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("rediss://user:hunter2@h:6380/1?ssl_ca_certs=/c/ca.pem&ssl_password=hunter2") == \
        "rediss://user:***@h:6380/1?ssl_ca_certs=/c/ca.pem&ssl_password=***"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"


# ---- the HTTP API: TLS to the scheduler, HTTPS to its clients (compose.yaml's api command) ----------------------

def start_compose_api(scheduler_port: int, redis_port: int, model: str, tmp: Path, **tls_env: str):
    """compose.yaml's api command, run here (local ports, the scheduler on localhost: its certificate's name), with
    its TLS variables from `tls_env` as .env would give them. Returns (process, port, log path)."""
    import yaml

    from tests.e2e.test_compose import TOKENIZER, unescape

    port = cluster.free_port()
    command = yaml.safe_load(open(os.path.join(ROOT, "compose.yaml")))["services"]["api"]["command"]
    argv = [unescape(a).replace("8000", str(port)).replace("scheduler:50051", f"localhost:{scheduler_port}")
            .replace("0.0.0.0", "127.0.0.1").replace(TOKENIZER, model) for a in command]
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], PYTHONPATH=ROOT,
               REDIS_URL=f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis_port}/0", **tls_env)
    log = tmp / f"api-{port}.log"
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, port, log


def trusting(ca: str):
    import ssl

    return ssl.create_default_context(cafile=ca)


def wait_health(proc, url: str, verify, log: Path, want: int = 200, timeout: float = 90):
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.get(url, verify=verify, timeout=5)
            if r.status_code == want:
                return r
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
        time.sleep(0.3)


def stop_proc(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_openai_client_over_https_through_a_tls_scheduler(tls_scheduler, redis_pw, pki, bundled_model_path, tmp_path):
    import httpx
    import openai

    proc, port, log = start_compose_api(tls_scheduler.port, redis_pw, bundled_model_path, tmp_path,
                                        LLMSERVE_SCHEDULER_TLS_CA=pki["ca"], LLMSERVE_SSL_CERTFILE=pki["server_cert"],
                                        LLMSERVE_SSL_KEYFILE=pki["server_key"])
    try:
        wait_health(proc, f"https://localhost:{port}/health", trusting(pki["ca"]), log)
        client = openai.OpenAI(base_url=f"https://localhost:{port}/v1", api_key="none",
                               http_client=httpx.Client(verify=trusting(pki["ca"])))
        reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4, temperature=0,
                                               messages=[{"role": "user", "content": "Hello"}])
        assert reply.choices[0].finish_reason in ("length", "stop") and reply.usage.completion_tokens >= 1
        with pytest.raises(httpx.HTTPError):  # a client that does not trust the CA is refused
            httpx.get(f"https://localhost:{port}/health", verify=trusting(pki["other_ca"]), timeout=5)
        assert "https://" in log.read_text() and "over TLS" in log.read_text()
    finally:
        stop_proc(proc)


def test_api_without_the_ca_says_why(tls_scheduler, redis_pw, pki, bundled_model_path, tmp_path):
    import httpx

    proc, port, log = start_compose_api(tls_scheduler.port, redis_pw, bundled_model_path, tmp_path)
    try:
        r = wait_health(proc, f"http://127.0.0.1:{port}/health", None, log, want=503)
        assert "--scheduler-tls-ca" in r.text, r.text
        chat = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                          json={"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert chat.status_code == 503 and "--scheduler-tls-ca" in chat.text, chat.text
    finally:
        stop_proc(proc)


def test_api_presents_a_client_certificate_to_a_mutual_tls_scheduler(redis_pw, pki, bundled_model_path, tmp_path):
    """The scheduler has --tls-client-ca (no worker: it stays NOT_SERVING, which the API can only learn over the
    mutual-TLS handshake); without a client certificate the API cannot reach it and says what to give."""
    s = cluster.start_scheduler(f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis_pw}/0", f"127.0.0.1:{cluster.free_port()}",
                                ["--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"],
                                 "--tls-client-ca", pki["ca"]])
    try:
        for env, needle in (({"LLMSERVE_SCHEDULER_TLS_CERT": pki["client_cert"],
                              "LLMSERVE_SCHEDULER_TLS_KEY": pki["client_key"]}, "is NOT_SERVING"),
                            ({}, "--scheduler-tls-cert")):
            proc, port, log = start_compose_api(s.port, redis_pw, bundled_model_path, tmp_path,
                                                LLMSERVE_SCHEDULER_TLS_CA=pki["ca"], **env)
            try:
                deadline = time.monotonic() + 60
                while needle not in (r := wait_health(proc, f"http://127.0.0.1:{port}/health", None, log,
                                                      want=503)).text:
                    assert time.monotonic() < deadline, r.text
                    time.sleep(0.5)
            finally:
                stop_proc(proc)
    finally:
        cluster.stop(s)


def test_api_tls_flags_that_cannot_work_fail_at_start(pki):
    assert_fails(run_cli("api", "--port", 0, "--ssl-keyfile", pki["server_key"]), "--ssl-keyfile", "--ssl-certfile")
    assert_fails(run_cli("api", "--port", 0, "--ssl-certfile", pki["server_cert"], "--ssl-keyfile", pki["client_key"]),
                 "cannot use", "--ssl-certfile")
    assert_fails(run_cli("api", "--port", 0, "--scheduler-tls-cert", pki["client_cert"], "--scheduler-tls-key",
                         pki["client_key"]), "--scheduler-tls-cert", "--scheduler-tls-ca")
    assert_fails(run_cli("api", "--port", 0, "--scheduler-tls-ca", "/nonexistent/ca.pem"), "--scheduler-tls-ca")


# ---- `llmserve serve` with TLS: its own HTTP API behind it ----------------------------------------------------

def test_serve_with_mutual_tls_answers_a_chat_completion_over_https(pki):
    """`serve --tls-cert/--tls-key/--tls-client-ca` (gRPC) and `--ssl-certfile/--ssl-keyfile` (HTTPS): its own API
    reaches the scheduler (a loopback listener: it has no client certificate) and answers an `openai` client that
    trusts the CA, while the public gRPC port still wants TLS and a client certificate."""
    import httpx
    import openai

    s = cluster.start_serve(["--device", "cpu", "--num-gpu-blocks-override", 32, "--max-model-len", 256,
                             "--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"],
                             "--tls-client-ca", pki["ca"], "--ssl-certfile", pki["server_cert"],
                             "--ssl-keyfile", pki["server_key"]])
    try:
        base = f"https://localhost:{s.extra['http_port']}/v1"
        assert f"OpenAI API on https://127.0.0.1:{s.extra['http_port']}/v1" in s.log_text()
        client = openai.OpenAI(base_url=base, api_key="none", http_client=httpx.Client(verify=trusting(pki["ca"])))
        reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4, temperature=0,
                                               extra_body={"ignore_eos": True},
                                               messages=[{"role": "user", "content": "Hello"}])
        assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("length", 4)
        with pytest.raises(httpx.HTTPError):  # HTTPS only, for clients trusting the CA
            httpx.get(f"{base}/models", verify=trusting(pki["other_ca"]), timeout=5)
        assert health(s.address) == "UNAVAILABLE"
        assert health(s.address, tls.channel_credentials(pki["ca"])) == "UNAVAILABLE"
        with_cert = tls.channel_credentials(pki["ca"], pki["client_cert"], pki["client_key"])
        assert health(s.address, with_cert) == "SERVING"
    finally:
        assert cluster.stop(s, timeout=30) == 0, s.log_tail()


def test_serve_checks_its_https_files_at_start(pki):
    assert_fails(run_cli("serve", "--redis-url", "redis://127.0.0.1:1/0", "--ssl-certfile", pki["server_cert"]),
                 "--ssl-keyfile", "--ssl-certfile")
