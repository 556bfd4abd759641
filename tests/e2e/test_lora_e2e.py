"""Multi-LoRA with real processes: redis-server, a worker with the bundled model and --enable-lora, schedulers and
the HTTP API. Adapters are random PEFT directories written by the module.

- the OpenAI `model` field picks an adapter, /v1/models lists them with the base as parent, unknown names are 404
  model_not_found (gRPC NOT_FOUND);
- the prefix cache never shares KV between adapters (or an adapter and the base model);
- /v1/load_lora_adapter and /v1/unload_lora_adapter under 16 streams: loaded adapters serve at once; unloading one
  with requests in flight lets them finish with it (same tokens as alone) and refuses new ones;
- each refusal at load names the file and the module;
- scheduler SIGKILL with adapter requests in flight: clients re-attach and get the uninterrupted tokens.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
import uuid
from types import SimpleNamespace

import grpc
import pytest

from protos import llmserve_pb2 as pb
from protos import llmserve_pb2_grpc as pb_grpc
from tests.support import cluster
from tests.support.lora_adapters import write_adapter

MAX_TOKENS = 24
# The bundled SmolLM2-135M's shapes, as transformers' config spells them (write_adapter reads these).
BUNDLED = SimpleNamespace(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                          num_key_value_heads=3, head_dim=64)
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"]


class Pool:
    def __init__(self, redis_url: str, root: str):
        self.redis_url = redis_url
        self.adapters = {n: write_adapter(f"{root}/{n}", BUNDLED, rank=r, alpha=2 * r, seed=s, std_b=0.3)
                         for n, r, s in (("a", 8, 1), ("b", 16, 2), ("c", 8, 3))}
        self.bad_rank = write_adapter(f"{root}/big", BUNDLED, rank=32, alpha=32, seed=4, layers=[0],
                                      modules=("q_proj",))
        self.bad_shape = write_adapter(f"{root}/wide", SimpleNamespace(**{**vars(BUNDLED), "hidden_size": 640}),
                                       rank=4, alpha=4, seed=5, layers=[3], modules=("v_proj",))
        self.modules = [f"a={self.adapters['a']}", f"b={self.adapters['b']}"]  # vLLM's form: one word per adapter
        self.worker = cluster.start_worker(["--device", "cpu", "--num-gpu-blocks-override", 512, "--max-model-len", 512,
                                            "--enable-lora", "--max-loras", 4, "--max-lora-rank", 16,
                                            "--lora-modules", *self.modules])
        self.procs = [self.worker]

    def scheduler(self, namespace: str, *flags, port: int | None = None) -> cluster.Proc:
        extra = ["--enable-lora", "--max-loras", 4, "--lora-modules", *self.modules, *flags]
        proc = cluster.start_scheduler(self.redis_url, self.worker.address,
                                       extra + (["--port", port] if port else []), namespace=namespace)
        self.procs.append(proc)
        cluster.wait_healthy(proc.address, timeout=120, proc=proc)
        return proc


@pytest.fixture(scope="module")
def pool(redis_server, tmp_path_factory):
    p = Pool(redis_server, str(tmp_path_factory.mktemp("adapters")))
    yield p
    for proc in reversed(p.procs):
        cluster.stop(proc)


def generate(address: str, prompt: str, lora: str = "", rid: str = "") -> list[int]:
    req = pb.GenerateRequest(request_id=rid, text=prompt, lora_name=lora,
                             sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    with grpc.insecure_channel(address) as ch:
        return [t for m in pb_grpc.LLMServeStub(ch).Generate(req, timeout=300) for t in m.token_ids]


def post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))


def test_model_field_selects_adapters_and_isolates_the_prefix_cache(pool):
    metrics_port = cluster.free_port()
    sched = pool.scheduler(cluster.new_namespace("lora-http"), "--metrics-port", metrics_port)
    api = cluster.start_api(sched.address)
    pool.procs.append(api)
    url = f"http://127.0.0.1:{api.port}"
    try:
        models = json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=30).read())["data"]
        base = models[0]["id"]
        assert {m["id"]: m["parent"] for m in models[1:]} == {"a": base, "b": base}
        assert models[1]["root"] == pool.adapters["a"]

        prompt = "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with ends"
        hits = lambda: metric(metrics_port, "vllm:prefix_cache_hits_total")  # noqa: E731
        outs = {}
        for model in (base, "a", "b", "a"):  # each adapter's first run finds nothing cached by another
            before = hits()
            status, text = post(f"{url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                          "temperature": 0, "ignore_eos": True})
            assert status == 200, text
            body = json.loads(text)
            assert body["model"] == model
            found = hits() - before
            assert (found > 0) == (model in outs), (model, found)  # only a repeat of the same adapter hits
            assert outs.setdefault(model, body["choices"][0]["text"]) == body["choices"][0]["text"]
        assert len(set(outs.values())) == 3, "each adapter (and the base) must answer differently"

        status, text = post(f"{url}/v1/chat/completions", {"model": "nope", "messages": [{"role": "user",
                                                                                            "content": "hi"}]})
        assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found", text
        with pytest.raises(grpc.RpcError) as e:
            generate(sched.address, "hi", lora="nope")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in e.value.details()
        # Runtime updates are off by default: vLLM does not serve these routes then.
        status, _ = post(f"{url}/v1/load_lora_adapter", {"lora_name": "c", "lora_path": pool.adapters["c"]})
        assert status == 404
    finally:
        cluster.stop(api)
        cluster.stop(sched)


def test_runtime_load_and_unload_under_16_streams(pool):
    ns = cluster.new_namespace("lora-rt")
    sched = pool.scheduler(ns, "--allow-runtime-lora-updating")
    api = cluster.start_api(sched.address)
    pool.procs.append(api)
    url = f"http://127.0.0.1:{api.port}"
    try:
        # Alone first: the reference tokens of each (adapter, prompt).
        alone = {(m, p): generate(sched.address, p, m) for m in ("", "a", "b") for p in PROMPTS[:2]}
        # Refusals at load, each naming the file and the module.
        status, text = post(f"{url}/v1/load_lora_adapter", {"lora_name": "big", "lora_path": pool.bad_rank})
        assert status == 400 and "adapter_config.json: r=32 exceeds --max-lora-rank 16" in text, text
        status, text = post(f"{url}/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": pool.bad_shape})
        assert status == 400 and "adapter_model.safetensors" in text and "v_proj, layer 3" in text, text
        status, text = post(f"{url}/v1/load_lora_adapter", {"lora_name": "a", "lora_path": pool.adapters["c"]})
        assert status == 400 and "already loaded" in text, text

        results: dict[int, list[int]] = {}
        jobs = [("" if i % 3 == 0 else "a" if i % 3 == 1 else "b", PROMPTS[i % 2]) for i in range(16)]

        def run(i: int) -> None:
            results[i] = generate(sched.address, jobs[i][1], jobs[i][0], rid=f"rt-{i}-{uuid.uuid4().hex[:6]}")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # the 16 streams are admitted; now change the adapters under them
        status, text = post(f"{url}/v1/load_lora_adapter", {"lora_name": "c", "lora_path": pool.adapters["c"]})
        assert status == 200 and "c" in text, text
        b_jobs = [i for i, job in enumerate(jobs) if job[0] == "b"]
        in_flight = [i for i in b_jobs if i not in results]
        status, text = post(f"{url}/v1/unload_lora_adapter", {"lora_name": "b"})
        assert status == 200, text
        assert in_flight, "no request of b was in flight at the unload: the test would prove nothing"
        c_out = generate(sched.address, PROMPTS[0], "c")  # served at once, beside the 16
        for t in threads:
            t.join(300)
        for i, (model, prompt) in enumerate(jobs):  # b's in-flight requests finished with b
            assert results[i] == alone[(model, prompt)], (i, model)
        assert c_out not in (alone[("", PROMPTS[0])], alone[("a", PROMPTS[0])])
        with pytest.raises(grpc.RpcError) as e:
            generate(sched.address, PROMPTS[0], "b")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        status, text = post(f"{url}/v1/unload_lora_adapter", {"lora_name": "b"})
        assert status == 404, text
        models = json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=30).read())["data"]
        assert [m["id"] for m in models[1:]] == ["a", "c"]
    finally:
        cluster.stop(api)
        cluster.stop(sched)
        import redis  # the registry is per namespace: leave the module's others as they were

        redis.Redis.from_url(pool.redis_url).delete(f"{ns}:lora_adapters")


# slow: kill -9 crossed with LoRA. Each half runs by default: the scheduler kill -9 and re-attach in
# tests/e2e/test_recovery.py::test_scheduler_sigkill_clients_reattach_and_lose_nothing, the ledger record keeping
# its adapter in tests/unit/test_lora_scheduling.py::test_ledger_record_keeps_the_adapter, adapter selection and
# isolation in the two tests above.
@pytest.mark.slow
def test_scheduler_sigkill_with_adapter_requests_resumes_identical_streams(pool):
    ns = cluster.new_namespace("lora-kill")
    port = cluster.free_port()
    first = pool.scheduler(ns, port=port)
    jobs = [(m, p) for m in ("a", "b", "") for p in PROMPTS[:2]]
    reference = {job: generate(first.address, job[1], job[0]) for job in jobs}
    ledger = cluster.ledger(pool.redis_url, ns)
    streams: dict[int, list[int]] = {i: [] for i in range(len(jobs))}
    rids = [f"k-{i}-{uuid.uuid4().hex[:6]}" for i in range(len(jobs))]
    problems: list[str] = []

    def follow(i: int) -> None:  # a client that re-attaches by request id after UNAVAILABLE
        lora, prompt = jobs[i]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            req = pb.GenerateRequest(request_id=rids[i], text=prompt, lora_name=lora,
                                     resume_from_token=len(streams[i]),
                                     sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                ignore_eos=True))
            try:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                    for m in pb_grpc.LLMServeStub(ch).Generate(req, timeout=300):
                        streams[i].extend(m.token_ids)
                        if m.finish_reason:
                            return
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    problems.append(f"{rids[i]}: {e.code().name} {e.details()}")
                    return
                time.sleep(0.2)
        problems.append(f"{rids[i]}: no end")

    threads = [threading.Thread(target=follow, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while True:  # mid-generation: every request has committed tokens, none has finished
        reqs = [ledger.get_request(r) for r in rids]
        if all(r is not None and len(r.output_ids) >= 3 for r in reqs):
            break
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.02)
    assert all(len(r.output_ids) < MAX_TOKENS for r in reqs), "a request finished before the kill"
    assert {r.lora_name for r in reqs} == {"a", "b", ""}, "the ledger keeps each request's adapter"
    cluster.kill(first)
    second = pool.scheduler(ns, port=port)
    for t in threads:
        t.join(300)
    try:
        assert not problems, problems
        for i, job in enumerate(jobs):
            assert streams[i] == reference[job], (rids[i], job)
    finally:
        cluster.stop(second)
