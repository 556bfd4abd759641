"""The model registry: Hugging Face architecture name -> the class that runs it.

A family is one file in this package: a subclass of worker_svc.model.LlamaModel (or of another family) that says
how its config.json reads (`hf_config`, refusing what it would ignore), its GGUF names, and overrides the forward
where its layers differ. Adding one = that file + a line here + its tests (docs/architecture.md).
"""

from __future__ import annotations

from worker_svc.model.decoder import LlamaModel
from worker_svc.model.families.gemma import Gemma2, Gemma3
from worker_svc.model.families.gpt_oss import GptOss
from worker_svc.model.families.granite_hybrid import GraniteMoeHybrid
from worker_svc.model.families.llama import Llama, Mistral, Qwen2
from worker_svc.model.families.mixtral import Mixtral
from worker_svc.model.families.nemotron_h import NemotronH
from worker_svc.model.families.qwen3 import Qwen3
from worker_svc.model.families.qwen3_moe import Qwen3Moe
from worker_svc.model.families.qwen3_next import Qwen3_5, Qwen3Next

MODELS: dict[str, type[LlamaModel]] = {
    "LlamaForCausalLM": Llama,
    "MistralForCausalLM": Mistral,
    "Qwen2ForCausalLM": Qwen2,
    "Qwen3ForCausalLM": Qwen3,
    "Gemma2ForCausalLM": Gemma2,
    "Gemma3ForCausalLM": Gemma3,
    "MixtralForCausalLM": Mixtral,
    "Qwen3MoeForCausalLM": Qwen3Moe,
    "Qwen3NextForCausalLM": Qwen3Next,
    "Qwen3_5ForCausalLM": Qwen3_5,
    "NemotronHForCausalLM": NemotronH,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybrid,
    "GptOssForCausalLM": GptOss,
}


def model_class(architectures: list[str]) -> type[LlamaModel]:
    """The class for config.json's `architectures`; ValueError naming the field when none is supported."""
    for a in architectures:
        if a in MODELS:
            return MODELS[a]
    raise ValueError(f"config.json field architectures={architectures!r} is not supported: expected one of "
                     f"{', '.join(sorted(MODELS))}")


def by_name(name: str) -> type[LlamaModel]:
    """The class for a family's short name (ModelConfig.architecture, GGUF's general.architecture)."""
    for cls in MODELS.values():
        if cls.name == name:
            return cls
    raise ValueError(f"unknown model architecture {name!r}: expected one of "
                     f"{', '.join(sorted({c.name for c in MODELS.values()}))}")


def gguf_class(arch: str) -> type[LlamaModel]:
    """The class for a GGUF's general.architecture; ValueError naming the field when not supported."""
    names = sorted({c.name for c in MODELS.values() if c.gguf})
    if arch not in names:
        raise ValueError(f"unsupported GGUF general.architecture {arch!r}: expected one of {', '.join(names)}")
    return by_name(arch)
