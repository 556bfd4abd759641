"""The worker's wire conversions (protos/worker.proto <-> the core's plain data): a StepPlan message becomes the
core's plan (worker_svc/core/plan.py, sampling records converted once, here), the runner's StepOutput becomes a
StepResult field by field, and a refused plan's PlanError (worker_svc/core/errors.py) becomes its gRPC status code and
`common.plan_errors` trailing metadata. With worker_svc/server.py the only worker modules that import protos."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
import numpy as np

from common import plan_errors
from common.sampling_fields import SamplingParams
from common.sampling_wire import record_from_wire, record_to_wire
from protos import worker_pb2 as pb
from worker_svc.core import plan as core
from worker_svc.core.errors import InvalidPlan, PlanError
from worker_svc.core.step_output import StepOutput

if TYPE_CHECKING:  # torch loads only in the worker process
    from worker_svc.core.runner import ModelRunner


def sampling_from_wire(p: pb.SamplingParams) -> SamplingParams:
    """The wire's values; top_p and repetition_penalty 0 read as 1 (unset); an unset seed is drawn once."""
    return record_from_wire(p)


def sampling_to_wire(s: SamplingParams) -> pb.SamplingParams:
    return record_to_wire(s, pb.SamplingParams())


def step_plan(p: pb.StepPlan) -> core.StepPlan:
    """The core's plan from the wire message (sampling parameters converted once, here)."""
    c = p.cached

    def ids(values) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    return core.StepPlan(
        step_id=p.step_id, fencing_token=p.fencing_token, expected_epoch=p.expected_epoch,
        reset_batch=p.reset_batch, dropped_slots=ids(p.dropped_slots),
        new_requests=[core.JoiningRequest(r.slot, r.request_id, ids(r.prompt_token_ids), len(r.prompt_token_ids),
                                          sampling_from_wire(r.sampling), list(r.block_ids),
                                          r.num_computed_tokens, r.num_scheduled_tokens, r.lora_name, r.lora_path,
                                          _state_slot(r))
                      for r in p.new_requests],
        resumed_requests=[core.JoiningRequest(r.slot, r.request_id, ids(r.token_ids), r.num_prompt_tokens,
                                              sampling_from_wire(r.sampling), list(r.block_ids),
                                              r.num_computed_tokens, r.num_scheduled_tokens, r.lora_name,
                                              r.lora_path, _state_slot(r))
                          for r in p.resumed_requests],
        cached=core.CachedRequests(ids(c.slots), ids(c.num_scheduled_tokens), ids(c.num_new_blocks),
                                   ids(c.new_block_ids), ids(c.num_draft_slots)),
        replaced_tables=[(t.slot, list(t.block_ids)) for t in p.replaced_tables],
        copy_src=ids([b.src for b in p.copy_blocks]), copy_dst=ids([b.dst for b in p.copy_blocks]),
        prompt_lookup_min=p.prompt_lookup_min, prompt_lookup_max=p.prompt_lookup_max,
        state_copy_src=ids(p.state_copy_src), state_copy_dst=ids(p.state_copy_dst),
        state_save_src=ids(p.state_save_src), state_save_dst=ids(p.state_save_dst),
    )


def _state_slot(r: pb.NewRequest | pb.ResumedRequest) -> int:
    """The joining request's state slot; -1 when the scheduler sent none (a model without recurrent layers)."""
    return r.state_slot if r.HasField("state_slot") else -1


def step_result(out: StepOutput) -> pb.StepResult:
    lp = out.logprobs
    result = pb.StepResult(
        step_id=out.step_id, previous_step_id=out.previous_step_id, num_scheduled_tokens=out.num_scheduled_tokens,
        slots=out.slots.tolist(), token_ids=out.token_ids.tolist(),
        logprob_indices=lp.indices.tolist(), logprobs=lp.logprobs.tolist(), num_top_logprobs=lp.num_top.tolist(),
        top_logprob_token_ids=lp.top_token_ids.tolist(), top_logprobs=lp.top_logprobs.tolist(),
        spec_slots=out.spec_slots.tolist(), spec_num_draft_tokens=out.spec_num_draft_tokens.tolist(),
        spec_num_accepted_tokens=out.spec_num_accepted_tokens.tolist(), num_constrained=out.num_constrained,
        mask_seconds=out.mask_seconds, prepare_seconds=out.prepare_seconds, forward_seconds=out.forward_seconds,
        sample_seconds=out.sample_seconds,
    )
    if out.finish_reasons.any():  # empty: every request still runs
        result.finish_reasons.extend(out.finish_reasons.tolist())
    if out.prompt_logprobs is not None:
        pl = out.prompt_logprobs
        result.prompt_lp_slots.extend(pl.slots.tolist())
        result.prompt_lp_starts.extend(pl.starts.tolist())
        result.prompt_lp_counts.extend(pl.counts.tolist())
        result.prompt_lp_num_top.extend(pl.num_top.tolist())
        result.prompt_lp_values.extend(pl.values.tolist())
        result.prompt_lp_top_token_ids.extend(pl.top_token_ids.tolist())
        result.prompt_lp_top_values.extend(pl.top_values.tolist())
    if out.pooled is not None and len(out.pooled.slots):
        result.pooled_slots.extend(out.pooled.slots.tolist())
        result.pooled.extend(out.pooled.vectors.ravel().tolist())
        result.embedding_dim = out.pooled.vectors.shape[1]
    return result


def plan_error_code(e: PlanError) -> grpc.StatusCode:
    return grpc.StatusCode.INVALID_ARGUMENT if isinstance(e, InvalidPlan) else grpc.StatusCode.FAILED_PRECONDITION


def plan_error_metadata(e: PlanError) -> tuple[tuple[str, str], ...]:
    md = ((plan_errors.REASON_KEY, e.reason),)
    if e.slot is not None:
        md += ((plan_errors.SLOT_KEY, str(e.slot)),)
    return md + ((plan_errors.REQUEST_ID_KEY, e.request_id),) if e.request_id else md


def worker_info(runner: ModelRunner) -> pb.WorkerInfo:
    cfg = runner.config
    model = pb.ModelInfo(
        name=cfg.name, architecture=cfg.architecture, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        eos_token_ids=cfg.eos_token_ids, path=runner.opts.model,
    )
    if cfg.bos_token_id is not None:
        model.bos_token_id = cfg.bos_token_id
    return pb.WorkerInfo(
        model=model, dtype=str(runner.dtype).removeprefix("torch."), device=str(runner.device),
        block_size=runner.block_size, num_blocks=runner.num_blocks, max_model_len=runner.max_model_len,
        epoch=runner.epoch, attention_backend=runner.attention_backend,
        kv_bytes_per_block=runner.kv_bytes_per_block, last_step_id=runner.batch.last_step_id,
        fencing_token=runner.batch.fencing_token,
        tensor_parallel_size=runner.group.size if runner.group is not None else 1,
        rank_num_blocks=runner.rank_num_blocks, rank_kv_bytes_per_block=runner.rank_kv_bytes_per_block,
        num_state_slots=runner.num_state_slots, state_bytes_per_slot=runner.state_bytes_per_slot,
    )


def skip_finished_requests(plan: pb.StepPlan, finished: set[int]) -> None:
    """A pipelined plan may hold a request the step before it finished: the scheduler learns of the finish only
    from that step's result. Such an entry (by its slot, which the scheduler has not reused yet) is dropped here
    instead of failing the whole plan as unknown."""
    c = plan.cached
    if not finished or not c.slots:
        return
    slots = np.array(c.slots, dtype=np.int64)
    gone = np.isin(slots, list(finished))
    if not gone.any():
        return
    keep = ~gone
    counts = np.array(c.num_new_blocks, dtype=np.int64) if c.num_new_blocks else np.zeros(len(slots), np.int64)
    blocks = np.array(c.new_block_ids, dtype=np.int64)
    kept = pb.CachedRequests(slots=slots[keep].tolist(),
                             num_scheduled_tokens=np.array(c.num_scheduled_tokens)[keep].tolist(),
                             num_new_blocks=counts[keep].tolist() if c.num_new_blocks else [],
                             new_block_ids=blocks[np.repeat(keep, counts)].tolist())
    plan.cached.CopyFrom(kept)
    tables = [t for t in plan.replaced_tables if t.slot not in finished]
    if len(tables) < len(plan.replaced_tables):
        del plan.replaced_tables[:]
        plan.replaced_tables.extend(tables)
