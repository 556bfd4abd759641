"""A generation request as the scheduler sees it: tokens, progress, blocks, status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from common.sampling_fields import SamplingParams
from scheduler_svc.core.block_pool import hash_block


class Status(enum.StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# Client-facing finish reasons (vLLM's names).
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams  # sampling.max_tokens is always set (> 0) by admission
    priority: int = 0
    arrival_time: float = 0.0
    arrival_seq: int = 0
    # Text-level options, applied by the detokenizer on the way out.
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    scheduled_time: float | None = field(default=None, compare=False)  # first step (queue-time metric); not persisted
    cache_salt: str = ""  # tenant isolation: requests with different salts never share cached blocks
    lora_name: str = ""  # the LoRA adapter it runs with ("": the base model); also salts its prefix-cache hashes
    lora_path: str = ""  # the adapter's PEFT directory when admitted (the worker loads it from there)
    fork_of: str = ""  # n > 1: the sibling whose prompt blocks this sequence shares once they are computed
    error: str = ""  # why the worker rejected this request (finish reason "rejected"); not persisted
    # Prefix-cache bookkeeping (derived from the tokens, not persisted).
    block_hashes: list[bytes] = field(default_factory=list, repr=False)  # of full blocks, chained
    num_registered_blocks: int = 0  # leading blocks already offered to the cache index
    num_cached_tokens: int = 0  # prompt tokens taken from the cache at the last admission
    # Worker protocol bookkeeping (not persisted: a new scheduler resumes everything anyway).
    on_worker: bool = False  # the worker holds this request's state
    needs_resume: bool = False  # the worker must rebuild it from the full token list
    # Pipelined scheduling (not persisted): tokens a step in flight samples for this request, not yet received.
    num_pending_tokens: int = 0
    # Speculative decoding (not persisted): draft positions granted to steps in flight. Each may have advanced the
    # worker's copy by that many accepted tokens more than this side knows, so the next step's blocks cover them.
    num_draft_slots_in_flight: int = 0
    # Hybrid models (not persisted: a new scheduler resumes everything by recompute): the worker's state slot it
    # holds while in the batch (-1: none), and its latest snapshot at a block boundary past the prompt's (slot, key;
    # a later one replaces it, so that a finished sequence leaves the last boundary it reached in the prefix cache).
    state_slot: int = -1
    decode_snapshot: tuple[int, bytes] | None = field(default=None, repr=False)
    # Prompt results (not persisted; recomputed on resume: scheduler_svc/core/prompt_results.py): the prompt tokens'
    # logprobs by position (index 0 stays None), and an embed request's pooled vector.
    prompt_logprobs: list[Any] | None = field(default=None, repr=False)
    embedding: list[float] | None = field(default=None, repr=False)
    # Read back from the ledger only (a request that asked for logprobs): its output tokens' logprobs, which a new
    # leader re-sends with the tokens; a running request's go from the step result to the stream, not through here.
    output_logprobs: list[Any] | None = field(default=None, repr=False, compare=False)
    # Tracing (never persisted): the caller's W3C context from Generate, and this request's open span.
    trace_context: Any = field(default=None, repr=False, compare=False)
    span: Any = field(default=None, repr=False, compare=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens known, counting those a step in flight is sampling (their KV is computed by the next step)."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending_tokens

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def prefix_salt(self) -> str:
        """The cache salt, and the adapter: the same prompt under two adapters (or one and the base) has other KV."""
        return f"{self.cache_salt}\x00lora:{self.lora_name}" if self.lora_name else self.cache_salt

    def full_block_hashes(self, block_size: int) -> list[bytes]:
        """Chained content hashes of every full block of the known tokens (memoized, extended as tokens come)."""
        tokens = self.all_token_ids
        for i in range(len(self.block_hashes), len(tokens) // block_size):
            parent = self.block_hashes[-1] if self.block_hashes else None
            block = tuple(tokens[i * block_size : (i + 1) * block_size])
            self.block_hashes.append(hash_block(parent, block, self.prefix_salt))
        return self.block_hashes
