"""The worker's settings (`WorkerConfig`, one field each); the model's architecture (`ModelConfig`) lives in
worker_svc/model/config.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common import config as c
from common.config import setting
from common.json_flag import JsonFlagError, key_error, parse_json_object
from common.speculative_config import speculative_config_setting
from common.structured_outputs import StructuredOutputsConfig
from worker_svc.cpu import binding as cpu_binding
from worker_svc.sampling.pooler_config import PoolerConfig


@dataclass(frozen=True)
class CompilationConfig:
    """vLLM's `--compilation-config` keys that apply here (the compiled forward, worker_svc/model/compiled.py)."""

    # Step sizes (tokens) the compiled forward pads to; None: 1, 2, 4, then multiples of 8 up to the max.
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_cudagraph_capture_size: int = 64
    cache_dir: str | None = None  # inductor's cache (default ~/.cache/llmserve/inductor)

    def sizes(self) -> tuple[int, ...]:
        if self.cudagraph_capture_sizes is not None:
            return self.cudagraph_capture_sizes
        m = self.max_cudagraph_capture_size
        return tuple(n for n in (1, 2, 4) if n <= m) + tuple(range(8, m + 1, 8))

    @staticmethod
    def parse(text: str | None) -> CompilationConfig:
        """From the flag's JSON (None or "": the defaults); JsonFlagError naming the flag and the key when wrong."""
        flag = "--compilation-config"
        d = parse_json_object(flag, text, {"cudagraph_capture_sizes": (list, type(None)),
                                           "max_cudagraph_capture_size": (int,), "cache_dir": (str, type(None))},
                              '{"cudagraph_capture_sizes": [1, 2, 4, 8]}')
        if d is None:
            return CompilationConfig()
        sizes = d.get("cudagraph_capture_sizes")
        if sizes is not None:
            if not sizes or not all(type(n) is int and n >= 1 for n in sizes):
                raise key_error(flag, "cudagraph_capture_sizes", "a non-empty list of integers >= 1", sizes)
            sizes = tuple(sorted(set(sizes)))
        top = d.get("max_cudagraph_capture_size", 64)
        if top < 1:
            raise key_error(flag, "max_cudagraph_capture_size", "an integer >= 1", top)
        return CompilationConfig(sizes, top, d.get("cache_dir"))


def _json_flag_problem(parse: Callable[[str | None], object]) -> Callable[[str | None], str | None]:
    """A setting's check from a JSON flag's parser: the parser's problem (the settings check names the flag)."""
    def check(text: str | None) -> str | None:
        try:
            parse(text)
        except JsonFlagError as e:
            return e.problem
        return None
    return check


# vLLM's other names of two dtypes (its --dtype also takes them).
_VLLM_DTYPE_NAMES = {"half": "float16", "float": "float32"}


def vllm_dtype(text: str) -> str:
    return _VLLM_DTYPE_NAMES.get(text, text)


def _check_optimization_level(level: int | None) -> str | None:
    return None if level is None or 0 <= level <= 3 else f"must be 0, 1, 2 or 3, got {level}"


@dataclass(frozen=True)
class WorkerConfig:
    """The worker's settings (`llmserve worker`, and the worker `llmserve serve` starts): one field each."""

    host: str = setting("127.0.0.1", "address of the worker's gRPC server")
    port: int = setting(50061, "port of the worker's gRPC server (0 picks a free one)")
    model: str | None = setting(None, "GGUF file or Hugging Face directory (default: bundled SmolLM2-135M)")
    dtype: str = setting("auto", "weights and KV cache dtype (auto: bfloat16 on CUDA and on a CPU with AVX512-BF16 "
                         "or AMX, float32 elsewhere; vLLM's half and float name float16 and float32)",
                         choices=("auto", "float32", "bfloat16", "float16"), parse=vllm_dtype)
    device: str = setting("auto", "auto, cpu, cuda, cuda:N")
    block_size: int = setting(16, "tokens per KV block", check=c.is_power_of_two)
    kv_cache_memory: int = setting(2 << 30, "KV pool bytes on CPU", check=c.at_least(1))
    gpu_memory_utilization: float = setting(0.9, "share of the GPU's memory this process may use (weights, "
                                            "activations, KV pool)", aliases=("--device-memory-utilization",),
                                            check=c.between(0, 1))
    num_gpu_blocks_override: int | None = setting(None, "KV pool size in blocks (skips the memory-based sizing)",
                                                  check=c.at_least(1))
    max_model_len: int | None = setting(None, "longest sequence (prompt + output) in tokens, 4096 or 4k / 4K as "
                                        "vLLM reads them (default: the model's)", check=c.at_least(1),
                                        parse=c.human_readable_int)
    max_num_batched_tokens: int | None = c.max_num_batched_tokens()
    attention_backend: str = setting("auto", "paged-attention kernels: auto = triton on CUDA, torch on CPU",
                                     choices=("auto", "triton", "torch"))
    quantization: str | None = setting(
        None, "gguf: keep a GGUF's quantized weights quantized (int4 / int8 weight-only matmuls; activations in "
        "--dtype, auto as without it, bfloat16 where the CPU kernels are not built) instead of dequantizing them "
        "at load; fp8, compressed-tensors, awq, gptq: the format of an HF checkpoint's quantization_config (detected "
        "without the flag; a mismatch is refused), FP8 weights kept FP8 and dequantized in each matmul (CUDA; the "
        "CPU's FP8 kernel, float32 or bfloat16 activations; where it is not built, dequantized into --dtype as "
        "they load), AWQ / GPTQ int4 on the int4 kernels, mxfp4 (gpt-oss) experts "
        "kept packed and dequantized per expert in its matmul",
        aliases=("-q",), choices=("gguf", "fp8", "compressed-tensors", "awq", "gptq", "mxfp4"))
    activation_quantization: str | None = setting(
        None, "with --quantization gguf on CPU, each 32-value group of a matmul's input is made integers (one scale a "
        "group) so the int4 / int8 weights multiply in integer instructions: int16 (logits within ~0.01 of float "
        "activations) or int8 (as llama.cpp does: faster still, logits move by up to a few units); default: "
        "activations stay in --dtype. docs/benchmarks.md has the speed and agreement", choices=("int16", "int8"))
    otlp_traces_endpoint: str | None = c.otlp_traces_endpoint()
    worker_token: str | None = c.worker_token()
    tls_cert: str | None = c.tls_cert()
    tls_key: str | None = c.tls_key()
    tls_client_ca: str | None = c.tls_client_ca()
    tensor_parallel_size: int = setting(
        1, "shard the model over this many rank processes (torch.distributed: nccl on CUDA, gloo on CPU); on one "
        "host the worker starts them itself, across hosts see --nnodes", aliases=("-tp",), check=c.at_least(1))
    nnodes: int = setting(1, "hosts the tensor-parallel ranks are spread over (each runs this command with its "
                          "--node-rank; or start every rank with torchrun)", aliases=("-n",), check=c.at_least(1))
    node_rank: int = setting(0, "this host's index in [0, --nnodes); host 0 serves gRPC", aliases=("-r",),
                             check=c.at_least(0))
    master_addr: str = setting("127.0.0.1", "rendezvous address of the tensor-parallel group (the host of "
                               "--node-rank 0)")
    master_port: int | None = setting(None, "rendezvous port (default: a free one; needed with --nnodes > 1)")
    distributed_timeout: float = setting(
        120.0, "seconds a rank waits for the others (joining, or inside a step) before the group ends",
        aliases=("--distributed-timeout-seconds",))
    structured_outputs_config: str | None = setting(
        None, 'structured outputs (vLLM\'s flag): {"backend": "xgrammar"} (the only one; "auto" means it), '
        '"disable_any_whitespace": true for JSON without optional whitespace', metavar="JSON",
        check=_json_flag_problem(StructuredOutputsConfig.parse))
    pooler_config: str | None = setting(
        None, 'embeddings (vLLM\'s flag): {"pooling_type": "LAST"} (the last prompt token; or "MEAN", "CLS") of the '
        'final hidden state after the last norm, "normalize": true (L2; the default)', metavar="JSON",
        check=_json_flag_problem(PoolerConfig.parse))
    speculative_config: str | None = speculative_config_setting()  # read for draft_model, eagle3, mtp
    allow_kv_pool_below_max_model_len: bool = setting(
        False, "start even if the KV pool cannot hold one --max-model-len sequence (such requests are then refused "
        "at admission; for tests and tiny pools)")
    enable_lora: bool = c.enable_lora()
    lora_modules: list[str] | None = c.lora_modules()
    max_loras: int = c.max_loras()
    max_lora_rank: int = setting(16, "largest LoRA rank served; adapters above it are refused at load",
                                 check=c.at_least(1))
    max_cpu_loras: int | None = setting(None, "LoRA adapters kept in host memory, LRU (default: --max-loras)",
                                        check=c.at_least(1))
    enforce_eager: bool = setting(False, "always run the eager forward (no torch.compile, no CUDA graphs), whatever "
                                  "-O says")
    optimization_level: int | None = setting(
        None, "0: eager forward; 1-3: torch.compile (inductor) of the decoder layers, steps padded to the "
        "--compilation-config sizes and compiled during start-up (a hybrid model's recurrent ops and attention stay "
        "eager between the compiled parts); on CUDA, 2-3 also replay CUDA graphs for decode-only steps (not on a "
        "hybrid model)", aliases=("-O",), device_default={"cpu": 0, "cuda": 0}, check=_check_optimization_level)
    compilation_config: str | None = setting(
        None, 'compiled forward (vLLM\'s flag): {"cudagraph_capture_sizes": [1, 2, 4, 8]} (the step sizes compiled; '
        'default 1, 2, 4, then multiples of 8 up to "max_cudagraph_capture_size", default 64; larger steps run '
        'eager), "cache_dir" (inductor\'s cache, default ~/.cache/llmserve/inductor)', metavar="JSON",
        aliases=("-cc",), check=_json_flag_problem(CompilationConfig.parse))
    num_state_slots: int = setting(
        0, "hybrid models (Gated DeltaNet / Mamba2 layers): recurrent-state slots, one per running sequence or "
        "prefix-cache snapshot (0 = auto: --max-num-seqs slots for the running sequences plus room for the "
        "--state-snapshot-share of snapshots, i.e. max-num-seqs / (1 - share), at most half the KV memory budget; "
        "the state pool's bytes come out of that budget); ignored for other models", check=c.at_least(0))
    max_num_seqs: int | None = c.max_num_seqs()
    state_snapshot_share: float = c.state_snapshot_share()
    mamba_ssm_cache_dtype: str = setting(
        "auto", "dtype of a hybrid model's recurrent state matrices (vLLM's flag; auto = float32); the conv windows "
        "stay in --dtype", choices=("auto", "float32", "bfloat16", "float16"))
    cpu_omp_threads_bind: str = setting(
        "auto", "CPU cores of the model's threads, one thread per core (vLLM's VLLM_CPU_OMP_THREADS_BIND): auto = an "
        "equal share of this process's cores for each tensor-parallel rank on this host (when the rank runs a thread "
        "on each; with fewer, as OMP_NUM_THREADS sets, none), nobind = the OS places them, or a core list per local "
        "rank such as 0-3|4-7", check=cpu_binding.check)
