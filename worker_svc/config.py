"""Model architecture description shared by loaders, the model and Describe."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2"
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
    # A GGUF's tokenizer entries as spelled, control tokens blanked, and xgrammar's vocab type (for structured
    # outputs, read while the file is open anyway); None: read from the HF directory's tokenizer.json when needed.
    vocabulary: tuple[list[str], str] | None = field(default=None, repr=False, compare=False)
