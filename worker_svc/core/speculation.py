"""Which proposer drafts a step's tokens, for the runner, by --speculative-config's method: n-gram prompt lookup
(worker_svc/core/ngram_drafts.py), a draft model (worker_svc/core/draft_model.py), or an EAGLE-3 / MTP head over the
target's hidden states (worker_svc/core/hidden_drafts.py); and the sampler's draw that verifies them."""

from __future__ import annotations

from typing import Any

import numpy as np

from common.config import ConfigError
from common.speculative_config import parse_speculative_config
from worker_svc.config import WorkerConfig
from worker_svc.core import grammar_drafts, hidden_drafts, ngram_drafts
from worker_svc.core.draft_model import DraftModel, Proposal, verifier
from worker_svc.core.hidden_drafts import HiddenDrafts
from worker_svc.core.persistent_batch import Schedule
from worker_svc.core.plan import StepPlan
from worker_svc.model import target_vocab
from worker_svc.model.config import ModelConfig
from worker_svc.model.decoder import LlamaModel
from worker_svc.model.loader import default_model_path
from worker_svc.sampling.sampler import Draw, plain_draw


def load(opts: WorkerConfig, target: LlamaModel, config: ModelConfig, attention_backend: str, group: Any,
         weights: dict[str, Any]) -> tuple[DraftModel | None, HiddenDrafts | None]:
    """The proposer --speculative-config's method needs loaded: (a draft model, None) for draft_model, (None, a head)
    for eagle3 / mtp, (None, None) for ngram or none. Called before the target is compiled (a head hooks it;
    the compiled forward hands out the same states).

    Under tensor parallelism (`group`) the proposer runs whole on rank 0, over the target's replicated hidden states
    for a head; its drafts reach the other ranks as the verifying step's tokens, so they hold no proposer. weights:
    this rank's loaded shard (a head's vocabulary is gathered from every rank's, target_vocab.gathered)."""
    try:
        spec = parse_speculative_config(opts.speculative_config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if spec is None or spec.method == "ngram":
        return None, None
    rank = group.rank if group is not None else 0
    if spec.method != "draft_model":
        hidden_drafts.refuse_uncomposed(spec, target)
        flag = f"--speculative-config method {spec.method}"
        vocab = target_vocab.of_target(target) if group is None else \
            target_vocab.gathered(target, config, weights, group, flag)
        return None, (hidden_drafts.load(spec, opts, target, config, vocab, attention_backend) if rank == 0 else None)
    if rank:
        return None, None
    return DraftModel(spec, config, opts.model or default_model_path(), target.dtype, target.device,
                      attention_backend, opts.block_size), None


def kv_bytes_per_block(draft: DraftModel | None, heads: HiddenDrafts | None) -> int:
    """A block's share of the proposer's own KV pool (a draft model's, a head's): one block id indexes both pools."""
    return (draft.bytes_per_block() if draft else 0) + (heads.bytes_per_block() if heads else 0)


def allocate(draft: DraftModel | None, heads: HiddenDrafts | None, num_blocks: int) -> None:
    for proposer in (draft, heads):
        if proposer is not None:
            proposer.allocate(num_blocks)


def copy_blocks(draft: DraftModel | None, heads: HiddenDrafts | None, copies: tuple[np.ndarray, np.ndarray]) -> None:
    """Copy-on-write of the proposer's own KV (a draft model's, a head's) with the target's."""
    if draft is not None:
        draft.copy_blocks(*copies)
    if heads is not None:
        heads.before_step(copies)


def propose(draft: DraftModel | None, heads: HiddenDrafts | None, s: Schedule, plan: StepPlan, block_size: int,
            max_model_len: int, eos_token_ids: np.ndarray) -> tuple[np.ndarray | None, Proposal | None]:
    """The drafts each chunk verifies (None: none this step), written past the rows' tokens; a draft model also
    sees the chunks that draft nothing (its KV follows the target's). A head's drafts were made after the previous
    step (hidden_drafts.after_step). A constrained request's drafts are cut where its grammar rejects one
    (grammar_drafts.py). On a hybrid model the runner takes rejected drafts of every method back out of the
    recurrent state (draft_rollback.py)."""
    num_drafts, proposal = _propose(draft, heads, s, plan, block_size, max_model_len, eos_token_ids)
    grammar_drafts.cut(s.inputs, s.rows, num_drafts, frozenset(eos_token_ids.tolist()))
    return num_drafts, proposal


def _propose(draft: DraftModel | None, heads: HiddenDrafts | None, s: Schedule, plan: StepPlan, block_size: int,
             max_model_len: int, eos_token_ids: np.ndarray) -> tuple[np.ndarray | None, Proposal | None]:
    b, ends = s.inputs, s.starts + s.lengths
    if heads is not None:
        if s.draft_slots is None:
            return None, None
        return heads.take(b, s.rows, ends, s.draft_slots, max_model_len), None
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
    """Rejection sampling for a draft model's drafts (they come with their distribution q); plain sampling for the
    point-mass drafts of n-gram lookup and of an eagle3 / mtp head (their greedy tokens). For a point mass at x the
    rejection sampler accepts with p(x) and else draws from p without x: exactly what drawing from p and comparing
    does (ngram_drafts.verify), which also keeps a seeded request's tokens those of decoding without drafts."""
    return plain_draw if proposal is None or num_drafts is None else verifier(proposal, rows, num_drafts)
