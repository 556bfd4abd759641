"""The model architecture description shared by the loaders, the model and Describe (`ModelConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    # gpt-oss's experts: the clamped SwiGLU's sigmoid gain and clamp (families/gpt_oss.py); 0: not that block.
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    # Hybrid models (worker_svc/model/families/hybrid.py): layer_types also names recurrent layers ("linear_attention":
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
