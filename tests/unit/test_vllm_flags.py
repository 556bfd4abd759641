"""The flags llmserve shares with vLLM, in vLLM's spelling and value syntax (`vllm serve --help=all` of vLLM 0.32.0,
compared by scripts/vllm_flags.py), parsed by llmserve's own parsers: each vLLM form must give the same setting.
docs/vllm-flags.md lists every flag compared and what differs on purpose."""

from __future__ import annotations

import argparse
import os

import pytest

from api_svc.server import add_api_args
from common.config import from_namespace
from common.lora import parse_lora_modules
from llmserve.serve import add_serve_args
from scheduler_svc.config import SchedulerConfig
from worker_svc.config import WorkerConfig


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmserve serve", exit_on_error=False)
    add_serve_args(p)
    return p


def api_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmserve api", exit_on_error=False)
    add_api_args(p)
    return p


JSON_LORA = '{"name": "sql", "path": "/a/sql", "base_model_name": "m"}'
# (vLLM's words, the setting they must give) on `llmserve serve` (the scheduler's and the worker's flags).
SERVE_FORMS = [
    (["--max-model-len", "4096"], "max_model_len", 4096),
    (["--max-model-len", "32k"], "max_model_len", 32000),
    (["--max-model-len", "32K"], "max_model_len", 32768),
    (["--max-num-seqs", "64"], "max_num_seqs", 64),
    (["--max-num-batched-tokens", "8192"], "max_num_batched_tokens", 8192),
    (["--max-num-batched-tokens", "8k"], "max_num_batched_tokens", 8000),
    (["--enable-prefix-caching"], "enable_prefix_caching", True),
    (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
    (["--enable-chunked-prefill"], "enable_chunked_prefill", True),
    (["--no-enable-chunked-prefill"], "enable_chunked_prefill", False),
    (["--tensor-parallel-size", "2"], "tensor_parallel_size", 2),
    (["-tp", "2"], "tensor_parallel_size", 2),
    (["--gpu-memory-utilization", "0.85"], "gpu_memory_utilization", 0.85),
    (["--dtype", "bfloat16"], "dtype", "bfloat16"),
    (["--dtype", "auto"], "dtype", "auto"),
    (["--served-model-name", "a", "b"], "served_model_name", ["a", "b"]),
    (["--api-key", "k"], "api_key", "k"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], "tool_call_parser", "hermes"),
    (["--enable-lora", "--lora-modules", "a=/p/a", "b=/p/b"], "lora_modules", ["a=/p/a", "b=/p/b"]),
    (["--enable-lora", "--lora-modules", JSON_LORA], "lora_modules", [JSON_LORA]),
    (["--max-lora-rank", "64"], "max_lora_rank", 64),
    (["--max-loras", "4"], "max_loras", 4),
    (["--max-cpu-loras", "8"], "max_cpu_loras", 8),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'],
     "speculative_config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'),
    (["--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}'],
     "structured_outputs_config", '{"backend": "xgrammar", "disable_any_whitespace": true}'),
    (["--block-size", "32"], "block_size", 32),
    (["--host", "0.0.0.0"], "host", "0.0.0.0"),
    (["--quantization", "gguf"], "quantization", "gguf"),
    (["--enforce-eager"], "enforce_eager", True),
    (["--num-gpu-blocks-override", "100"], "num_gpu_blocks_override", 100),
    (["--long-prefill-token-threshold", "128", "--enable-chunked-prefill"], "long_prefill_token_threshold", 128),
    (["--scheduling-policy", "priority"], "scheduling_policy", "priority"),
    (["--async-scheduling"], "async_scheduling", True),
    (["--otlp-traces-endpoint", "http://c:4317"], "otlp_traces_endpoint", "http://c:4317"),
    (["--tokenizer", "/t"], "tokenizer", "/t"),
    (["--mamba-ssm-cache-dtype", "float32"], "mamba_ssm_cache_dtype", "float32"),
    (["--attention-backend", "triton"], "attention_backend", "triton"),
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "h", "--master-port", "29500"], "master_port", 29500),
    (["-O", "3"], "optimization_level", 3),
    (["--compilation-config", '{"cudagraph_capture_sizes": [1, 2, 4]}'], "compilation_config",
     '{"cudagraph_capture_sizes": [1, 2, 4]}'),
    (["--pooler-config", '{"pooling_type": "MEAN"}'], "pooler_config", '{"pooling_type": "MEAN"}'),
    (["--dtype", "half"], "dtype", "float16"),
    (["--dtype", "float"], "dtype", "float32"),
    (["--model", "/m/model.gguf"], "model", "/m/model.gguf"),
    (["--port", "50052"], "port", 50052),  # serve's gRPC port (docs/vllm-flags.md: different on purpose)
    (["--shutdown-timeout", "30"], "shutdown_timeout", 30),
    (["--optimization-level", "2"], "optimization_level", 2),
    (["-q", "awq"], "quantization", "awq"),
    (["-cc", '{"cache_dir": "/c"}'], "compilation_config", '{"cache_dir": "/c"}'),
    (["-sc", '{"method": "ngram", "num_speculative_tokens": 2}'], "speculative_config",
     '{"method": "ngram", "num_speculative_tokens": 2}'),
    (["-n", "2", "-r", "1", "--master-addr", "h"], "node_rank", 1),
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "h"], "nnodes", 2),
    (["--device-memory-utilization", "0.7"], "gpu_memory_utilization", 0.7),
    (["--distributed-timeout-seconds", "300"], "distributed_timeout", 300),
    (["--no-enable-lora"], "enable_lora", False),
    (["--no-enforce-eager"], "enforce_eager", False),
    (["--no-async-scheduling"], "async_scheduling", False),
    (["--no-enable-auto-tool-choice"], "enable_auto_tool_choice", False),
    (["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--ssl-ca-certs", "ca.pem", "--ssl-cert-reqs", "2"],
     "ssl_cert_reqs", 2),
]
# On `llmserve api` (the HTTP server: vLLM's --port, --ssl-*).
API_FORMS = [
    (["--port", "8001"], "port", 8001),
    (["--host", "::"], "host", "::"),
    (["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"], "ssl_certfile", "c.pem"),
    (["--ssl-ca-certs", "ca.pem"], "ssl_ca_certs", "ca.pem"),
    (["--ssl-cert-reqs", "2"], "ssl_cert_reqs", 2),
    (["--served-model-name", "m"], "served_model_name", ["m"]),
    (["--api-key", "k"], "api_key", "k"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"], "enable_auto_tool_choice", True),
    (["--tokenizer", "/t"], "tokenizer", "/t"),
    (["--log-level", "WARNING"], "log_level", "warning"),  # vLLM's upper-case names, uvicorn's levels
    (["--no-enable-auto-tool-choice"], "enable_auto_tool_choice", False),
    (["--reasoning-parser", "openai_gptoss"], "reasoning_parser", "openai_gptoss"),
]
# Every flag `vllm serve --help=all` (vLLM 0.32.0) and llmserve spell alike, from `python scripts/vllm_flags.py
# --vllm-python VLLM_VENV/bin/python`; each has a form above and a line in docs/vllm-flags.md. (-O is vLLM's too: its
# parser turns -O3 into --optimization-level 3.)
VLLM_SHARED = {
    "--api-key", "--async-scheduling", "--attention-backend", "--block-size", "--compilation-config",
    "--device-memory-utilization", "--distributed-timeout-seconds", "--dtype", "--enable-auto-tool-choice",
    "--enable-chunked-prefill", "--enable-lora", "--enable-prefix-caching", "--enforce-eager",
    "--gpu-memory-utilization", "--host", "--log-level", "--long-prefill-token-threshold", "--lora-modules",
    "--mamba-ssm-cache-dtype", "--master-addr", "--master-port", "--max-cpu-loras", "--max-lora-rank", "--max-loras",
    "--max-model-len", "--max-num-batched-tokens", "--max-num-seqs", "--model", "--nnodes", "--no-async-scheduling",
    "--no-enable-auto-tool-choice", "--no-enable-chunked-prefill", "--no-enable-lora", "--no-enable-prefix-caching",
    "--no-enforce-eager", "--node-rank", "--num-gpu-blocks-override", "--optimization-level",
    "--otlp-traces-endpoint", "--pooler-config", "--port", "--quantization", "--reasoning-parser",
    "--scheduling-policy", "--served-model-name", "--shutdown-timeout", "--speculative-config", "--ssl-ca-certs",
    "--ssl-cert-reqs",
    "--ssl-certfile", "--ssl-keyfile", "--structured-outputs-config", "--tensor-parallel-size", "--tokenizer",
    "--tool-call-parser", "-cc", "-n", "-q", "-r", "-sc", "-tp", "-O",
}
# vLLM flags llmserve does not take (docs/vllm-flags.md says why): they must be refused, not silently ignored.
ABSENT = ["--seed", "--kv-cache-dtype", "--chat-template", "--generation-config", "--max-logprobs",
          "--disable-log-requests", "--kv-cache-memory-bytes", "--uvicorn-log-level"]


@pytest.mark.parametrize(("words", "dest", "value"), SERVE_FORMS, ids=lambda x: " ".join(x) if isinstance(x, list)
                         else None)
def test_vllm_form_parses_on_serve(words, dest, value):
    args = serve_parser().parse_args(words)
    assert getattr(args, dest) == value
    for cls in (SchedulerConfig, WorkerConfig):  # the process that has the setting accepts the value
        if dest in {f.name for f in cls.__dataclass_fields__.values()}:
            assert getattr(from_namespace(cls, args), dest) == value


@pytest.mark.parametrize(("words", "dest", "value"), API_FORMS, ids=lambda x: " ".join(x) if isinstance(x, list)
                         else None)
def test_vllm_form_parses_on_api(words, dest, value):
    assert getattr(api_parser().parse_args(words), dest) == value


@pytest.mark.parametrize("flag", ABSENT)
def test_vllm_flags_llmserve_lacks_are_refused(flag):
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        serve_parser().parse_args([flag, "1"])


def test_lora_modules_forms():
    assert parse_lora_modules(["a=/p/a", "b=/p/b"]) == [("a", "/p/a"), ("b", "/p/b")]
    assert parse_lora_modules(["a=/p/a,b=/p/b"]) == [("a", "/p/a"), ("b", "/p/b")]  # the comma form stays
    assert parse_lora_modules([JSON_LORA, '{"name": "t", "path": "/t"}', "c=/c"]) == \
        [("sql", "/a/sql"), ("t", "/t"), ("c", "/c")]
    assert parse_lora_modules("a=/p/a b=/p/b") == [("a", "/p/a"), ("b", "/p/b")]
    assert parse_lora_modules(None) == []


@pytest.mark.parametrize(("words", "needle"), [
    (["a"], "'a' must be NAME=PATH"),
    (["a=/p", "=x"], "'=x' must be NAME=PATH"),
    (['{"name": "a"'], "is not valid JSON"),
    (['{"name": "a"}'], 'needs a non-empty string "name" and "path"'),
    (['{"name": "a", "path": "/p", "rank": 8}'], "unknown field(s) rank"),
    (["[1]"], "must be NAME=PATH"),
    (["a=/p", '{"name": "a", "path": "/q"}'], "names 'a' twice"),
])
def test_lora_modules_bad_words_name_the_flag_and_the_word(words, needle):
    with pytest.raises(ValueError) as err:
        parse_lora_modules(words)
    assert "--lora-modules" in str(err.value) and needle in str(err.value)


def test_bad_lora_word_fails_the_config_check():
    from common.config import ConfigError

    args = serve_parser().parse_args(["--enable-lora", "--lora-modules", "a=/p", "oops"])
    with pytest.raises(ConfigError, match=r"--lora-modules word 'oops' must be NAME=PATH"):
        from_namespace(SchedulerConfig, args)


def test_serve_forwards_nargs_flags_to_the_worker():
    from llmserve.serve import worker_argv

    args = serve_parser().parse_args(["--enable-lora", "--lora-modules", "a=/p/a", JSON_LORA])
    argv = worker_argv(from_namespace(WorkerConfig, args), 50061)
    i = argv.index("--lora-modules")
    assert argv[i + 1:i + 3] == ["a=/p/a", JSON_LORA]


def test_every_flag_shared_with_vllm_has_a_checked_form_and_a_line_in_the_note():
    checked = {w for words, _, _ in SERVE_FORMS + API_FORMS for w in words if w.startswith("-")}
    assert VLLM_SHARED - checked == set()
    note = open(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs",
                             "vllm-flags.md")).read()
    assert {f for f in VLLM_SHARED if f"`{f}`" not in note} == set()


def test_vllm_value_names_reach_the_process_that_reads_them():
    """vLLM's aliases of values parse to llmserve's own (the worker and the API see only those)."""
    assert from_namespace(WorkerConfig, serve_parser().parse_args(["--dtype", "half"])).dtype == "float16"
    from api_svc.config import APIConfig

    assert from_namespace(APIConfig, api_parser().parse_args(["--log-level", "INFO"])).log_level == "info"
    with pytest.raises(argparse.ArgumentError):
        api_parser().parse_args(["--log-level", "loud"])
