"""Which proposer drafts a step's tokens, for the runner: n-gram prompt lookup (worker_svc/core/ngram_drafts.py) or
a draft model (worker_svc/core/draft_model.py), and the sampler's draw that verifies them."""

from __future__ import annotations

import numpy as np
import torch

from common.config import ConfigError
from common.speculative_config import parse_speculative_config
from worker_svc.config import WorkerConfig
from worker_svc.core import ngram_drafts
from worker_svc.core.draft_model import DraftModel, Proposal, verifier
from worker_svc.core.persistent_batch import Schedule
from worker_svc.core.plan import StepPlan
from worker_svc.model.config import ModelConfig
from worker_svc.model.loader import default_model_path
from worker_svc.sampling.sampler import Draw, plain_draw


def load_draft(opts: WorkerConfig, target: ModelConfig, dtype: torch.dtype, device: torch.device,
               attention_backend: str, tp_size: int) -> DraftModel | None:
    """The draft model of --speculative-config method draft_model (None for other methods, or none)."""
    spec = parse_speculative_config(opts.speculative_config)
    if spec is None or spec.method != "draft_model":
        return None
    if tp_size > 1:
        raise ConfigError("--speculative-config method draft_model runs with --tensor-parallel-size 1")
    return DraftModel(spec, target, opts.model or default_model_path(), dtype, device, attention_backend,
                      opts.block_size)


def propose(draft: DraftModel | None, s: Schedule, plan: StepPlan, block_size: int, max_model_len: int,
            eos_token_ids: np.ndarray) -> tuple[np.ndarray | None, Proposal | None]:
    """The drafts each chunk verifies (None: none this step), written past the rows' tokens; a draft model also
    sees the chunks that draft nothing (its KV follows the target's)."""
    b, ends = s.inputs, s.starts + s.lengths
    if draft is None:
        if s.draft_slots is None:
            return None, None
        return ngram_drafts.propose(b, s.rows, ends, s.draft_slots, block_size, max_model_len,
                                    plan.prompt_lookup_min, plan.prompt_lookup_max), None
    caps = np.zeros(len(s), dtype=np.int64) if s.draft_slots is None else \
        ngram_drafts.draft_caps(b, s.rows, ends, s.draft_slots, block_size, max_model_len)
    proposal = draft.propose(b, s, caps, eos_token_ids)
    return (None if s.draft_slots is None else proposal.num_drafts), proposal


def verifying_draw(proposal: Proposal | None, rows: np.ndarray, num_drafts: np.ndarray | None) -> Draw:
    """Rejection sampling for a draft model's drafts (they come with their distribution q); plain sampling
    otherwise, which verifies an n-gram's point-mass drafts exactly (ngram_drafts.py)."""
    return plain_draw if proposal is None or num_drafts is None else verifier(proposal, rows, num_drafts)
