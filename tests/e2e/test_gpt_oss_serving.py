"""gpt-oss served end to end by real processes (redis-server, a worker, a scheduler, an API): a transformers-written
random checkpoint (float32, and with MXFP4 experts), concurrent greedy requests in a 32-token step budget (chunked
prefill across the sliding window, mixed prefill + decode) whose tokens equal transformers' wherever its top-2 margin
is clear; and chat completions through the `openai` SDK with `--tool-call-parser openai --reasoning-parser
openai_gptoss`, the prompt rendered in the harmony format by the checkpoint's chat template. Random weights write
random text, so the chat checks are of structure (the parsers are checked on recorded replies in
tests/unit/test_harmony_parser.py)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from tests.e2e.test_moe_serving import MAX_TOKENS, SCHEDULER_ARGS, _generate
from tests.support import cluster
from tests.support import gpt_oss_checkpoints as gc
from tests.support import moe_checkpoints as mc
from tests.support.harmony_template import HARMONY_TEMPLATE

WORKER_ARGS = ["--dtype", "float32", "--num-gpu-blocks-override", 24, "--block-size", 16, "--max-model-len", 256,
               "--allow-kv-pool-below-max-model-len"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


@pytest.mark.parametrize("mxfp4", [False, True], ids=["float32", "mxfp4"])
def test_greedy_tokens_match_transformers(redis_server, tmp_path, mxfp4):
    hf = gc.write_checkpoint(str(tmp_path), mxfp4=mxfp4)
    prompts = gc.prompts(4, seed=5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = [mc.clear_prefix(*mc.hf_greedy(hf, ids, MAX_TOKENS)) for ids in prompts]
    finally:
        torch.set_num_threads(threads)
    assert sum(map(len, expected)) >= 2 * MAX_TOKENS, "too few clear greedy steps to compare"
    worker = cluster.start_worker(["--model", tmp_path, *WORKER_ARGS])
    sched = None
    try:
        sched = cluster.start_scheduler(redis_server, worker, SCHEDULER_ARGS)
        cluster.wait_healthy(sched.address, timeout=120, proc=sched)
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(_generate, [sched.address] * len(prompts), prompts,
                                    [f"gpt-oss-{i}" for i in range(len(prompts))]))
        for i, (want, (tokens, finish)) in enumerate(zip(expected, results, strict=True)):
            assert finish == "length" and len(tokens) == MAX_TOKENS, (i, finish)
            assert tokens[:len(want)] == want, f"request {i}: greedy tokens differ from transformers'"
    finally:
        if sched is not None:
            cluster.stop(sched)
        cluster.stop(worker)


@pytest.fixture(scope="module")
def chat_stack(redis_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt-oss-chat")
    # One token per byte: the harmony system and developer messages alone are some 500 tokens.
    gc.write_checkpoint(str(path), chat_template=HARMONY_TEMPLATE, max_position_embeddings=1024)
    worker = cluster.start_worker(["--model", path, "--dtype", "float32", "--num-gpu-blocks-override", 160,
                                   "--max-model-len", 1024])
    sched = cluster.start_scheduler(redis_server, worker, [])
    cluster.wait_healthy(sched.address, timeout=120, proc=sched)
    api = cluster.start_api(sched.address, ["--enable-auto-tool-choice", "--tool-call-parser", "openai",
                                            "--reasoning-parser", "openai_gptoss"])
    url = f"http://127.0.0.1:{api.port}"
    deadline = time.monotonic() + 60
    while httpx.get(url + "/health").status_code != 200:
        assert time.monotonic() < deadline, api.log_tail()
        time.sleep(0.2)
    client = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=300)
    yield client, url, client.models.list().data[0].id, str(path)
    for proc in (api, sched, worker):
        cluster.stop(proc)


def test_the_prompt_is_harmony(chat_stack):
    from common.tokenizer import Tokenizer

    _, url, model, path = chat_stack
    r = httpx.post(url + "/tokenize", json={"model": model, "messages": [{"role": "user", "content": "Hi"}]})
    ids = r.json()["tokens"]
    text = Tokenizer.from_hf_dir(path).decode(ids, skip_special_tokens=False)
    assert text.startswith("<|start|>system<|message|>") and text.endswith("<|start|>user<|message|>Hi<|end|>"
                                                                           "<|start|>assistant")
    assert sum(i >= gc.BYTES for i in ids) == 7  # the markers are single special tokens


@pytest.mark.parametrize("tools", [True, False], ids=["tools", "no-tools"])
def test_chat_completion_structure_whole_and_streamed(chat_stack, tools):
    client, _, model, _ = chat_stack
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=24,
                  temperature=0, **({"tools": [WEATHER]} if tools else {}))
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason in ("length", "stop", "tool_calls") and whole.usage.completion_tokens <= 24
    message = choice.message
    assert "reasoning_content" in message.model_extra  # the reasoning parser's field, None when there was none
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning is None or isinstance(reasoning, str)
    for call in message.tool_calls or ():
        assert call.function.name and call.id.startswith("call_")
    # The stream's deltas add up to the same message (greedy: the same tokens).
    content, streamed_reasoning, names = "", "", []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        streamed_reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        names += [tc.function.name for tc in delta.tool_calls or () if tc.function and tc.function.name]
    assert content == (message.content or "") and streamed_reasoning == (reasoning or "")
    assert names == [c.function.name for c in message.tool_calls or ()]
