"""The target's token embedding and LM head as a speculative head (EAGLE-3, MTP) reads them.

On one rank they are the target's own. Under tensor parallelism the target holds one vocabulary shard per rank and
its lookups end in an all-reduce; the head runs on rank 0 alone (its drafts reach the other ranks as the next step's
tokens), so rank 0 gathers whole copies of both once at start: every rank takes part in that gather.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from common.config import ConfigError
from worker_svc.model.config import ModelConfig
from worker_svc.model.decoder import LlamaModel
from worker_svc.model.layers.linear import pack_linear_weight
from worker_svc.model.quant import QuantizedWeight


@dataclass
class TargetVocab:
    embed_tokens: Callable[[torch.Tensor], torch.Tensor]  # token ids -> [rows, hidden], as the target embeds them
    lm_head: Any  # the matmul weight of the target's LM head, [vocab, hidden] (dense or packed)


def of_target(target: LlamaModel) -> TargetVocab:
    return TargetVocab(target.embed_tokens, target.lm_head)


def gathered(target: LlamaModel, config: ModelConfig, weights: dict[str, Any], group: Any,
             flag: str) -> TargetVocab | None:
    """Whole copies on rank 0 of the vocabulary shards every rank holds (None on the other ranks); every rank
    calls it. weights: this rank's loaded shard (an untied LM head is kept packed by the model)."""
    embed = target.embed
    lm_head = embed if config.tie_word_embeddings else weights.get("lm_head.weight")
    if isinstance(embed, QuantizedWeight) or isinstance(lm_head, QuantizedWeight) or lm_head is None:
        raise ConfigError(f"{flag} with --tensor-parallel-size {group.size}: the head needs the target's dense "
                          "embedding and LM head (quantized or unnamed ones are not gathered); run with "
                          "--tensor-parallel-size 1")
    if type(target).embed_tokens is not LlamaModel.embed_tokens:
        raise ConfigError(f"{flag} with --tensor-parallel-size {group.size}: {config.architecture} scales its "
                          "embeddings, which a whole copy on rank 0 does not; run with --tensor-parallel-size 1")

    def whole(shard: torch.Tensor) -> torch.Tensor | None:
        # Each rank's rows are padded to the same count, the padding last: gather, then cut at the vocabulary.
        parts = group.gather_to_first(shard.t())
        return None if parts is None else parts.t()[: config.vocab_size].contiguous()

    embed = whole(embed)
    head = embed if lm_head is target.embed else whole(lm_head)
    if group.rank != 0:
        return None
    return TargetVocab(lambda ids: F.embedding(ids, embed),
                       pack_linear_weight(head) if target.prepacked else head)
