"""The worker's persistent input batch: one row per request, its state as columns of numpy arrays.

A plan carries only deltas (requests that join, new blocks, how many tokens to compute), so the state lives here
between steps, as in vLLM's InputBatch: a request takes the row of its slot (the scheduler's address for it on the
wire) when it joins and frees it when it is dropped, finishes, or the batch is reset. A step then reads the
scheduled rows with a few vectorized gathers instead of walking Python objects per request and per token. Arrays
start small and double when a row, a sequence or a block table outgrows them
(max_model_len may be huge where it is only a bound).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from common.sampling_fields import SamplingParams
from worker_svc.core.step_output import FINISH_EOS, FINISH_MAX_TOKENS, FINISH_NONE, FINISH_STOP_TOKEN
from worker_svc.sampling.sampler import BATCH_COLUMNS, SAMPLING_COLUMNS, SamplingBatch, output_tails, right_aligned

# Per-row columns: name -> (dtype, value of a free row).
_COLUMNS: dict[str, tuple[type, object]] = {
    "num_tokens": (np.int64, 0),  # prompt + output so far
    "num_prompt_tokens": (np.int64, 0),
    "num_computed_tokens": (np.int64, 0),
    # A draft model's KV covers positions below this (worker_svc/core/draft_model.py); it catches up from there.
    "num_draft_computed": (np.int64, 0),
    "num_blocks": (np.int64, 0),
    "live": (np.bool_, False),  # the row holds a request
    "state_slot": (np.int64, -1),  # hybrid models: the row's recurrent-state slot (worker_svc/state_cache.py)
    # sampling parameters: the table's scalar columns (SAMPLING_COLUMNS, added below)
    "plain": (np.bool_, False),  # SamplingParams.plain: sampling is an argmax
    "constrained": (np.bool_, False),  # structured output: matchers[row] masks and follows its tokens
    "has_logit_bias": (np.bool_, False),  # logit_bias_ids[row] / logit_bias_values[row] hold its biases
    "has_bad_words": (np.bool_, False),  # bad_words[row] holds its sequences
}
_COLUMNS.update(SAMPLING_COLUMNS)


def _grown(a: np.ndarray, shape: tuple[int, ...], fill: object) -> np.ndarray:
    out = np.full(shape, fill, dtype=a.dtype)
    out[tuple(slice(0, n) for n in a.shape)] = a
    return out


def _capacity(current: int, need: int, limit: int | None = None) -> int:
    cap = max(current, 1)
    while cap < need:
        cap *= 2
    return min(cap, limit) if limit is not None else cap


class InputBatch:
    """Rows of requests: the columns of _COLUMNS ([num_rows]) and token_ids, block_table, stop_token_ids,
    logit_bias_ids / _values ([num_rows, capacity]) and bad_words ([num_rows, K, L]); row_of maps a request id to its
    row (for logs and tools; the step uses rows)."""

    num_tokens: np.ndarray
    num_prompt_tokens: np.ndarray
    num_computed_tokens: np.ndarray
    num_draft_computed: np.ndarray
    num_blocks: np.ndarray
    live: np.ndarray
    state_slot: np.ndarray
    plain: np.ndarray
    constrained: np.ndarray
    has_logit_bias: np.ndarray
    has_bad_words: np.ndarray
    max_tokens: np.ndarray  # and the other columns of SAMPLING_COLUMNS, one per scalar sampling field

    def __init__(self, max_model_len: int, *, rows: int = 64, tokens: int = 512, blocks: int = 32):
        self.max_model_len = max_model_len
        self.row_of: dict[str, int] = {}
        self.request_ids: list[str | None] = [None] * rows
        self.params: list[SamplingParams | None] = [None] * rows  # the objects behind the sampling columns
        self.matchers: list[object | None] = [None] * rows  # xgrammar matchers of constrained rows (worker_svc/grammar)
        for name, (dtype, fill) in _COLUMNS.items():
            setattr(self, name, np.full(rows, fill, dtype=dtype))
        self.token_ids = np.zeros((rows, min(tokens, max_model_len)), dtype=np.int32)
        self.block_table = np.zeros((rows, blocks), dtype=np.int64)  # 0 past num_blocks, as the kernels expect
        self.stop_token_ids = np.full((rows, 1), -1, dtype=np.int32)  # -1 padded
        # logit_bias as token ids (-1 padded) and biases; bad_words as [rows, K, L] right-aligned sequences. Grown
        # only by requests that carry them.
        self.logit_bias_ids = np.full((rows, 1), -1, dtype=np.int32)
        self.logit_bias_values = np.zeros((rows, 1), dtype=np.float32)
        self.bad_words = np.full((rows, 1, 1), -1, dtype=np.int32)

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)

    def __len__(self) -> int:
        return len(self.row_of)

    # -- rows ---------------------------------------------------------------------------------

    def add(self, row: int, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
            params: SamplingParams, block_ids: Sequence[int], num_computed_tokens: int, matcher: object = None,
            state_slot: int = -1) -> int:
        """Put a request into free row `row` (its slot), growing the arrays to hold it (`matcher`: its grammar
        matcher, already at the state after its output tokens)."""
        if row >= self.num_rows:
            self._grow_rows(_capacity(self.num_rows, row + 1))
        assert not self.live[row], f"row {row} is taken"
        self.live[row] = True
        self.row_of[request_id] = row
        self.request_ids[row] = request_id
        self.params[row] = params
        n = len(token_ids)
        self.reserve_tokens(n)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.num_computed_tokens[row] = self.num_draft_computed[row] = num_computed_tokens  # cached blocks hold both
        self.set_blocks(row, block_ids)
        self._set_sampling(row, params)
        self.matchers[row] = matcher
        self.constrained[row] = matcher is not None
        self.state_slot[row] = state_slot
        return row

    def free(self, row: int) -> None:
        del self.row_of[self.request_ids[row]]
        self.request_ids[row] = self.params[row] = self.matchers[row] = None
        self.block_table[row, : self.num_blocks[row]] = 0
        for name, (_, fill) in _COLUMNS.items():
            getattr(self, name)[row] = fill

    def clear(self) -> None:
        for row in list(self.row_of.values()):
            self.free(row)

    # -- per-row state ------------------------------------------------------------------------

    def set_blocks(self, row: int, block_ids: Sequence[int]) -> None:
        """Replace the row's block table (never by a shorter one: the plan check refuses that)."""
        n, held = len(block_ids), int(self.num_blocks[row])
        self._reserve_blocks(n)
        self.block_table[row, :n] = block_ids
        self.block_table[row, n:held] = 0
        self.num_blocks[row] = n

    def append_blocks(self, rows: np.ndarray, counts: np.ndarray, block_ids: np.ndarray) -> None:
        """Row rows[i] (distinct) gets the next counts[i] of `block_ids` appended to its table."""
        if not len(block_ids):
            return
        each = np.repeat(rows, counts)
        cols = self.num_blocks[each] + np.arange(len(block_ids)) - np.repeat(np.cumsum(counts) - counts, counts)
        self._reserve_blocks(int(cols.max()) + 1)
        self.block_table[each, cols] = block_ids
        self.num_blocks[rows] += counts

    def append_tokens(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """One new token for each of `rows` (distinct)."""
        if len(rows):
            ends = self.num_tokens[rows]
            self.reserve_tokens(int(ends.max()) + 1)
            self.token_ids[rows, ends] = tokens
            self.num_tokens[rows] = ends + 1

    def reserve_tokens(self, n: int) -> None:
        if n > self.token_ids.shape[1]:
            cap = _capacity(self.token_ids.shape[1], n, max(n, self.max_model_len))
            self.token_ids = _grown(self.token_ids, (self.num_rows, cap), 0)

    def _reserve_blocks(self, n: int) -> None:
        if n > self.block_table.shape[1]:
            self.block_table = _grown(self.block_table, (self.num_rows, _capacity(self.block_table.shape[1], n)), 0)

    def _grow_rows(self, rows: int) -> None:
        old = self.num_rows
        for name, (_, fill) in _COLUMNS.items():
            setattr(self, name, _grown(getattr(self, name), (rows,), fill))
        self.token_ids = _grown(self.token_ids, (rows, self.token_ids.shape[1]), 0)
        self.block_table = _grown(self.block_table, (rows, self.block_table.shape[1]), 0)
        self.stop_token_ids = _grown(self.stop_token_ids, (rows, self.stop_token_ids.shape[1]), -1)
        self.logit_bias_ids = _grown(self.logit_bias_ids, (rows, self.logit_bias_ids.shape[1]), -1)
        self.logit_bias_values = _grown(self.logit_bias_values, (rows, self.logit_bias_values.shape[1]), 0)
        self.bad_words = _grown(self.bad_words, (rows, *self.bad_words.shape[1:]), -1)
        self.request_ids += [None] * (rows - old)
        self.params += [None] * (rows - old)
        self.matchers += [None] * (rows - old)

    def _set_sampling(self, row: int, p: SamplingParams) -> None:
        for name, (_, unset) in SAMPLING_COLUMNS.items():
            value = getattr(p, name)
            getattr(self, name)[row] = unset if value is None else value
        self.plain[row] = p.plain
        self.has_logit_bias[row] = bool(p.logit_bias)
        if p.logit_bias:
            n = len(p.logit_bias)
            if n > self.logit_bias_ids.shape[1]:
                self.logit_bias_ids = _grown(self.logit_bias_ids, (self.num_rows, n), -1)
                self.logit_bias_values = _grown(self.logit_bias_values, (self.num_rows, n), 0)
            self.logit_bias_ids[row] = -1
            self.logit_bias_ids[row, :n] = list(p.logit_bias)
            self.logit_bias_values[row, :n] = list(p.logit_bias.values())
        self.has_bad_words[row] = bool(p.bad_words)
        if p.bad_words:
            k, width = len(p.bad_words), max(len(w) for w in p.bad_words)
            _, k0, w0 = self.bad_words.shape
            if k > k0 or width > w0:  # grown on the left too: sequences stay right-aligned
                grown = np.full((self.num_rows, max(k, k0), max(width, w0)), -1, dtype=np.int32)
                grown[:, :k0, grown.shape[2] - w0:] = self.bad_words
                self.bad_words = grown
            self.bad_words[row] = -1
            self.bad_words[row, :k] = right_aligned(p.bad_words, self.bad_words.shape[2])
        stop = sorted(p.stop_token_ids)
        if len(stop) > self.stop_token_ids.shape[1]:
            self.stop_token_ids = _grown(self.stop_token_ids, (self.num_rows, len(stop)), -1)
        self.stop_token_ids[row] = -1
        self.stop_token_ids[row, : len(stop)] = stop

    # -- sampling -----------------------------------------------------------------------------

    def sampling_batch(self, rows: np.ndarray, eos_token_ids: np.ndarray,
                       offsets: np.ndarray | None = None) -> SamplingBatch:
        """The sampler's view of `rows` (which sample this step); tokens only for the rows with penalties.
        `offsets`: speculative verification samples a row at several positions; entry i then samples the token
        after the row's tokens plus its next offsets[i] draft tokens (written past num_tokens)."""
        n = self.num_tokens[rows] if offsets is None else self.num_tokens[rows] + offsets
        b = SamplingBatch(
            **{name: getattr(self, name)[rows] for name in BATCH_COLUMNS},
            position=n, num_output=n - self.num_prompt_tokens[rows], stop_token_ids=self.stop_token_ids[rows],
            eos_token_ids=np.broadcast_to(eos_token_ids, (len(rows), len(eos_token_ids))),
        )
        bias = np.flatnonzero(self.has_logit_bias[rows])
        if len(bias):
            b.bias_rows, b.bias_ids, b.bias_values = bias, self.logit_bias_ids[rows[bias]], \
                self.logit_bias_values[rows[bias]]
        bad = np.flatnonzero(self.has_bad_words[rows])
        if len(bad):
            r = rows[bad]
            b.bad_words_rows, b.bad_words = bad, self.bad_words[r]
            b.bad_words_tail = output_tails(self.token_ids, r, n[bad], self.num_prompt_tokens[r],
                                            self.bad_words.shape[2] - 1)
        uses = b.uses_penalties
        pen = rows[uses]
        if len(pen):
            b.penalty_num_tokens = n[uses]
            b.penalty_num_prompt = self.num_prompt_tokens[pen]
            b.penalty_tokens = self.token_ids[pen, : int(b.penalty_num_tokens.max())]
        return b

    # -- finishing ----------------------------------------------------------------------------

    def finish_reasons(self, rows: np.ndarray, eos_token_ids: np.ndarray) -> np.ndarray:
        """The FINISH_* reason of each of `rows` after its last token was appended (0: still running).

        min_tokens holds back EOS and stop tokens, not the length limits; EOS wins over a stop token, both over
        the length.
        """
        n = self.num_tokens[rows]
        tok = self.token_ids[rows, n - 1]
        n_out = n - self.num_prompt_tokens[rows]
        allowed = n_out >= self.min_tokens[rows]
        eos = allowed & ~self.ignore_eos[rows] & (tok[:, None] == eos_token_ids).any(axis=1)
        stop = allowed & (self.stop_token_ids[rows] == tok[:, None]).any(axis=1)
        max_tokens = self.max_tokens[rows]
        length = ((max_tokens > 0) & (n_out >= max_tokens)) | (n >= self.max_model_len)
        reason = np.where(length, FINISH_MAX_TOKENS, FINISH_NONE)
        reason[stop] = FINISH_STOP_TOKEN
        reason[eos] = FINISH_EOS
        return reason
