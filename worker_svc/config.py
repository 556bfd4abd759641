"""The worker's settings (`WorkerConfig`, one field each) and the model architecture description shared by the
loaders, the model and Describe (`ModelConfig`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from common import config as c
from common.config import setting
from worker_svc import cpu_binding
from worker_svc.pooler_config import PoolerConfig


@dataclass
class ModelConfig:
    architecture: str  # the family's short name (worker_svc.models): "llama", "qwen3", "gemma2", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict: {"rope_type": "llama3"|"linear", "factor": ..., ...} or None.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    name: str = ""
    # Per layer "full_attention" or "sliding_attention" (HF's layer_types); None: every layer full.
    layer_types: list[str] | None = None
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma); None: head_dim's
    rope_local_theta: float | None = None  # rope base of sliding layers, unscaled (Gemma 3); None: rope_theta
    # Sparse mixture-of-experts feed-forward (worker_svc.moe; Mixtral, Qwen3-MoE): experts per sparse layer (0: a
    # dense model), experts each token runs, each expert's intermediate size, whether the kept routing weights are
    # renormalised to sum to 1, and which layers are sparse (None: all; the others run the dense MLP).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: list[int] | None = None
    # Hybrid models (worker_svc/models/hybrid.py): layer_types also names recurrent layers ("linear_attention":
    # Gated DeltaNet); their head counts, head sizes and conv kernel; rope on the first partial_rotary_factor of each
    # attention head; a shared expert beside the routed ones (Qwen3-Next; 0: none).
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    partial_rotary_factor: float = 1.0
    shared_expert_intermediate_size: int = 0
    # Mamba2 layers ("mamba" in layer_types; Nemotron-H, Granite 4.0): heads, head size, SSM state size, groups of
    # B / C, conv kernel and its bias, the least time step; the MLP layers' activation ("relu2": Nemotron-H).
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    ssm_state_size: int = 0
    mamba_n_groups: int = 0
    mamba_conv_kernel: int = 0
    mamba_conv_bias: bool = True
    time_step_min: float = 0.0
    mlp_hidden_act: str = "silu"
    # Granite's scalings (embedding_multiplier, residual_multiplier, attention_multiplier, logits_scaling); None:
    # none. use_rope False: attention without rope (Granite 4.0's position_embedding_type other than "rope").
    multipliers: dict | None = None
    use_rope: bool = True
    # A GGUF's tokenizer entries as spelled, control tokens blanked, and xgrammar's vocab type (for structured
    # outputs, read while the file is open anyway); None: read from the HF directory's tokenizer.json when needed.
    vocabulary: tuple[list[str], str] | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class CompilationConfig:
    """vLLM's `--compilation-config` keys that apply here (the compiled forward, worker_svc/compiled.py)."""

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
        """From the flag's JSON (None or "": the defaults); ValueError naming the key when wrong."""
        if not text:
            return CompilationConfig()
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"must be a JSON object, e.g. '{{\"cudagraph_capture_sizes\": [1, 2, 4, 8]}}': {e}") \
                from None
        if not isinstance(d, dict):
            raise ValueError(f"must be a JSON object, got {text!r}")
        known = {f for f in CompilationConfig.__dataclass_fields__}
        if unknown := sorted(set(d) - known):
            raise ValueError(f"unknown key(s) {', '.join(unknown)}; supported: {', '.join(sorted(known))}")
        sizes = d.get("cudagraph_capture_sizes")
        if sizes is not None:
            if not isinstance(sizes, list) or not sizes or not all(type(n) is int and n >= 1 for n in sizes):
                raise ValueError(f"cudagraph_capture_sizes must be a non-empty list of ints >= 1, got {sizes!r}")
            sizes = tuple(sorted(set(sizes)))
        top = d.get("max_cudagraph_capture_size", 64)
        if type(top) is not int or top < 1:
            raise ValueError(f"max_cudagraph_capture_size must be an int >= 1, got {top!r}")
        cache_dir = d.get("cache_dir")
        if cache_dir is not None and not isinstance(cache_dir, str):
            raise ValueError(f"cache_dir must be a string, got {cache_dir!r}")
        return CompilationConfig(sizes, top, cache_dir)


def _check_pooler_config(text: str | None) -> str | None:
    try:
        PoolerConfig.parse(text)
    except ValueError as e:
        return str(e).removeprefix("--pooler-config").lstrip(": ")
    return None


def _check_compilation_config(text: str | None) -> str | None:
    try:
        CompilationConfig.parse(text)
    except ValueError as e:
        return str(e)
    return None


def _check_optimization_level(level: int | None) -> str | None:
    return None if level is None or 0 <= level <= 3 else f"must be 0, 1, 2 or 3, got {level}"


@dataclass(frozen=True)
class WorkerConfig:
    """The worker's settings (`llmserve worker`, and the worker `llmserve serve` starts): one field each."""

    host: str = setting("127.0.0.1", "address of the worker's gRPC server")
    port: int = setting(50061, "port of the worker's gRPC server (0 picks a free one)")
    model: str | None = setting(None, "GGUF file or Hugging Face directory (default: bundled SmolLM2-135M)")
    dtype: str = setting("auto", "weights and KV cache dtype (auto: bfloat16 on CUDA and on a CPU with AVX512-BF16 "
                         "or AMX, float32 elsewhere)",
                         choices=("auto", "float32", "bfloat16", "float16"))
    device: str = setting("auto", "auto, cpu, cuda, cuda:N")
    block_size: int = setting(16, "tokens per KV block", check=c.is_power_of_two)
    kv_cache_memory: int = setting(2 << 30, "KV pool bytes on CPU", check=c.at_least(1))
    gpu_memory_utilization: float = setting(0.9, "share of the GPU's memory this process may use (weights, "
                                            "activations, KV pool)", check=c.between(0, 1))
    num_gpu_blocks_override: int | None = setting(None, "KV pool size in blocks (skips the memory-based sizing)",
                                                  check=c.at_least(1))
    max_model_len: int | None = setting(None, "longest sequence (prompt + output) in tokens (default: the model's)",
                                        check=c.at_least(1))
    max_num_batched_tokens: int | None = c.max_num_batched_tokens()
    attention_backend: str = setting("auto", "paged-attention kernels: auto = triton on CUDA, torch on CPU",
                                     choices=("auto", "triton", "torch"))
    quantization: str | None = setting(
        None, "gguf: keep a GGUF's quantized weights quantized (int4 / int8 weight-only matmuls; activations in "
        "--dtype, auto as without it, bfloat16 where the CPU kernels are not built) instead of dequantizing them "
        "at load", aliases=("-q",), choices=("gguf",))
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
                          "--node-rank; or start every rank with torchrun)", check=c.at_least(1))
    node_rank: int = setting(0, "this host's index in [0, --nnodes); host 0 serves gRPC", check=c.at_least(0))
    master_addr: str = setting("127.0.0.1", "rendezvous address of the tensor-parallel group (the host of "
                               "--node-rank 0)")
    master_port: int | None = setting(None, "rendezvous port (default: a free one; needed with --nnodes > 1)")
    distributed_timeout: float = setting(
        120.0, "seconds a rank waits for the others (joining, or inside a step) before the group ends")
    structured_outputs_config: str | None = setting(
        None, 'structured outputs (vLLM\'s flag): {"backend": "xgrammar"} (the only one; "auto" means it), '
        '"disable_any_whitespace": true for JSON without optional whitespace', metavar="JSON")
    pooler_config: str | None = setting(
        None, 'embeddings (vLLM\'s flag): {"pooling_type": "LAST"} (the last prompt token; or "MEAN", "CLS") of the '
        'final hidden state after the last norm, "normalize": true (L2; the default)', metavar="JSON",
        check=_check_pooler_config)
    allow_kv_pool_below_max_model_len: bool = setting(
        False, "start even if the KV pool cannot hold one --max-model-len sequence (such requests are then refused "
        "at admission; for tests and tiny pools)")
    enable_lora: bool = c.enable_lora()
    lora_modules: str | None = c.lora_modules()
    max_loras: int = c.max_loras()
    max_lora_rank: int = setting(16, "largest LoRA rank served; adapters above it are refused at load",
                                 check=c.at_least(1))
    max_cpu_loras: int | None = setting(None, "LoRA adapters kept in host memory, LRU (default: --max-loras)",
                                        check=c.at_least(1))
    enforce_eager: bool = setting(False, "always run the eager forward (no torch.compile, no CUDA graphs), whatever "
                                  "-O says")
    optimization_level: int | None = setting(
        None, "0: eager forward; 1-3: torch.compile (inductor) of the decoder layers, steps padded to the "
        "--compilation-config sizes and compiled during start-up; on CUDA, 2-3 also replay CUDA graphs for "
        "decode-only steps", aliases=("-O",), device_default={"cpu": 0, "cuda": 0}, check=_check_optimization_level)
    compilation_config: str | None = setting(
        None, 'compiled forward (vLLM\'s flag): {"cudagraph_capture_sizes": [1, 2, 4, 8]} (the step sizes compiled; '
        'default 1, 2, 4, then multiples of 8 up to "max_cudagraph_capture_size", default 64; larger steps run '
        'eager), "cache_dir" (inductor\'s cache, default ~/.cache/llmserve/inductor)', metavar="JSON",
        check=_check_compilation_config)
    num_state_slots: int = setting(
        0, "hybrid models (Gated DeltaNet / Mamba2 layers): recurrent-state slots, one per running sequence or "
        "prefix-cache snapshot (0 = auto: as many as a quarter of the KV memory budget holds, at least 8, at most "
        "1024; the state pool's bytes come out of that budget); ignored for other models", check=c.at_least(0))
    mamba_ssm_cache_dtype: str = setting(
        "auto", "dtype of a hybrid model's recurrent state matrices (vLLM's flag; auto = float32); the conv windows "
        "stay in --dtype", choices=("auto", "float32", "bfloat16", "float16"))
    cpu_omp_threads_bind: str = setting(
        "auto", "CPU cores of the model's threads, one thread per core (vLLM's VLLM_CPU_OMP_THREADS_BIND): auto = an "
        "equal share of this process's cores for each tensor-parallel rank on this host (when the rank runs a thread "
        "on each; with fewer, as OMP_NUM_THREADS sets, none), nobind = the OS places them, or a core list per local "
        "rank such as 0-3|4-7", check=cpu_binding.check)
