"""Batched sampling: logit bias, bad words, penalties, temperature, top-k / top-p / min-p, seeded draws, logprobs.

The random draw for a request's token at position p is a pure function of (seed, p): a hash of (seed, p) keys one
Exp(1) variable per vocabulary entry, and the token is argmax(weight / noise) (the exponential race, which samples
from the softmax; `draw_tokens`). So a request's text depends neither on its batch companions nor on preemption and
recompute.

Everything is array operations over the rows that sample this step; greedy rows cost nothing per row. The per-row
sampler this replaced is kept as the oracle (tests/support/legacy_host_path.py) and agrees bit for bit.

`pack_logprobs` lays a sample's logprobs out as the step's output wants them, for plain sampling and speculative
verification alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.sampling_fields import FIELDS
from kernels import cpu_ops
from worker_svc.core.step_output import Logprobs


def _splitmix64(x: np.ndarray) -> np.ndarray:
    # uint64 arithmetic wraps modulo 2**64
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def draw_keys(seeds: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray) -> np.ndarray:
    """[rows] uint64 keys: row i's is a pure function of (seeds[i], positions[i]), and keys its Exp(1) draws."""
    seeds = np.asarray(seeds, dtype=np.uint64)
    positions = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    return _splitmix64(seeds ^ _splitmix64(positions))


def exponential_noise(keys: np.ndarray, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] float32 Exp(1) draws of each key: a 32-bit hash (lowbias32) of (key, token id) gives 24
    uniform bits u in (0, 1), never 0, and the draw is -ln u. The C++ `sample_rows` computes the same draws."""
    u32 = np.uint32
    x = np.arange(vocab_size, dtype=u32)[None] * u32(0x9E3779B9) + (keys & np.uint64(0xFFFFFFFF)).astype(u32)[:, None]
    x ^= (keys >> np.uint64(32)).astype(u32)[:, None]
    x ^= x >> u32(16)
    x *= u32(0x7FEB352D)
    x ^= x >> u32(15)
    x *= u32(0x846CA68B)
    x ^= x >> u32(16)
    u = ((x >> u32(8)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -24)
    return -torch.log(torch.from_numpy(u))


def draw_tokens(scaled: torch.Tensor, keys: np.ndarray) -> np.ndarray:
    """Each row's token by the exponential race: argmax of softmax weight / Exp(1) draw, which samples from the
    softmax, and where masking a token that would not have won (-inf) never changes the winner (logit bias, bad
    words and grammars change only the draws they must). The C++ kernel (kernels/cpu_ops.py) takes ~0.12 ms a row of
    49k (2-core AVX2 box); the torch form below, the same draws up to the last bits of exp and ln, is the fallback."""
    scaled = scaled.float().contiguous()
    if scaled.device.type == "cpu" and (ops := cpu_ops.load()) is not None:
        return ops.sample_rows(scaled, torch.from_numpy(keys.view(np.int64))).numpy()
    weights = (scaled - scaled.amax(dim=-1, keepdim=True)).exp().nan_to_num_(nan=0.0)  # all -inf: all 0
    return (weights / exponential_noise(keys, scaled.shape[1]).to(scaled.device)).argmax(dim=-1).cpu().numpy()


@dataclass
class SamplingBatch:
    """The rows that sample this step: their parameters as columns (numpy, one entry per row) and, for the rows
    with penalties only, their tokens."""

    temperature: np.ndarray  # float32
    top_k: np.ndarray  # int64, <= 0: off
    top_p: np.ndarray  # float32
    min_p: np.ndarray  # float32
    repetition_penalty: np.ndarray  # float32
    presence_penalty: np.ndarray  # float32
    frequency_penalty: np.ndarray  # float32
    seed: np.ndarray  # uint64
    position: np.ndarray  # int64: index the new token will have in prompt + output
    num_output: np.ndarray  # int64: output tokens so far
    min_tokens: np.ndarray  # int64
    ignore_eos: np.ndarray  # bool
    logprobs: np.ndarray  # int64, -1: none
    stop_token_ids: np.ndarray  # int [rows, S], -1 padded
    eos_token_ids: np.ndarray  # int [rows, E], -1 padded (a broadcast view when every row has the same)
    # Rows with penalties (see uses_penalties), in row order: prompt + output tokens [P, L] and their lengths.
    penalty_tokens: np.ndarray | None = None
    penalty_num_prompt: np.ndarray | None = None
    penalty_num_tokens: np.ndarray | None = None
    # Rows with a logit_bias (indices into this batch): token ids [rows, B] (-1 padded) and their biases.
    bias_rows: np.ndarray | None = None
    bias_ids: np.ndarray | None = None
    bias_values: np.ndarray | None = None
    # Rows with bad_words: the sequences [rows, K, L] (right-aligned, -1 padded) and each row's last L - 1 output
    # tokens [rows, L - 1] (-1 where the output is shorter).
    bad_words_rows: np.ndarray | None = None
    bad_words: np.ndarray | None = None
    bad_words_tail: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.temperature)

    @property
    def greedy(self) -> np.ndarray:
        return (self.temperature <= 0.0) | (self.top_k == 1)

    @property
    def uses_penalties(self) -> np.ndarray:
        return (self.repetition_penalty != 1.0) | (self.presence_penalty != 0.0) | (self.frequency_penalty != 0.0)


# A column per scalar sampling field the sampler reads (common/sampling_fields.py): name -> (dtype, unset value).
SAMPLING_COLUMNS: dict[str, tuple[type, object]] = {
    f.name: (np.dtype(f.column).type, f.default if f.column_fill is None else f.column_fill)
    for f in FIELDS if f.column is not None}
BATCH_COLUMNS = [name for name in SAMPLING_COLUMNS if name in SamplingBatch.__dataclass_fields__]


@dataclass
class BatchSample:
    token_ids: np.ndarray  # [rows] int64
    logprob_rows: list[int]  # rows that asked for logprobs
    logprobs: list[float]  # the sampled token's, per logprob row
    top_logprobs: list[list[tuple[int, float]]]  # the top n (token, logprob), per logprob row


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> None:
    """vLLM semantics: repetition over prompt + output; presence and frequency over output only.

    One scatter over the padded token arrays of the penalized rows; padding points at a spare column V.
    """
    rows = torch.from_numpy(np.flatnonzero(b.uses_penalties))
    if not len(rows):
        return
    vocab = logits.shape[1]
    tokens = torch.from_numpy(b.penalty_tokens.astype(np.int64))
    col = torch.arange(tokens.shape[1])
    prompt = col < torch.from_numpy(b.penalty_num_prompt)[:, None]
    output = ~prompt & (col < torch.from_numpy(b.penalty_num_tokens)[:, None])
    spare = torch.full_like(tokens, vocab)
    counts = torch.zeros(len(rows), vocab + 1, dtype=logits.dtype)
    counts.scatter_add_(1, torch.where(output, tokens, spare), output.to(logits.dtype))
    counts = counts[:, :vocab]
    in_prompt = torch.zeros(len(rows), vocab + 1, dtype=torch.bool)
    in_prompt.scatter_(1, torch.where(prompt, tokens, spare), True)
    seen = (counts > 0) | in_prompt[:, :vocab]

    x = logits[rows]
    rep = torch.from_numpy(b.repetition_penalty)[rows][:, None]
    # rep == 1 leaves x unchanged (x / 1 and x * 1 are exact), so rows without it can share the formula
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    freq = torch.from_numpy(b.frequency_penalty)[rows][:, None]
    presence = torch.from_numpy(b.presence_penalty)[rows][:, None]
    x -= freq * counts + presence * (counts > 0).to(logits.dtype)
    logits[rows] = x


def apply_logit_bias(logits: torch.Tensor, b: SamplingBatch) -> None:
    """OpenAI semantics: each row's biases are added to its logits (one scatter for the batch)."""
    if b.bias_rows is None:
        return
    r, c = np.nonzero(b.bias_ids >= 0)
    index = (torch.from_numpy(b.bias_rows[r]), torch.from_numpy(b.bias_ids[r, c].astype(np.int64)))
    logits.index_put_(index, torch.from_numpy(b.bias_values[r, c]).to(logits.dtype), accumulate=True)


def apply_bad_words(logits: torch.Tensor, b: SamplingBatch) -> None:
    """vLLM semantics: a bad word's last token is banned where the output ends with the tokens before it (a
    one-token word: always). All rows' sequences are compared with their output tails at once."""
    if b.bad_words_rows is None:
        return
    last = b.bad_words[:, :, -1]
    prefix = b.bad_words[:, :, :-1]
    hit = (last >= 0) & ((prefix < 0) | (prefix == b.bad_words_tail[:, None, :])).all(axis=2)
    r, k = np.nonzero(hit)
    logits[torch.from_numpy(b.bad_words_rows[r]), torch.from_numpy(last[r, k].astype(np.int64))] = float("-inf")


def right_aligned(seqs: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """Token sequences as rows of `width` columns, each ending in the last column, -1 before it."""
    out = np.full((len(seqs), width), -1, dtype=np.int64)
    for i, seq in enumerate(seqs):
        out[i, width - len(seq):] = seq
    return out


def output_tails(token_ids: np.ndarray, rows: np.ndarray, num_tokens: np.ndarray, num_prompt: np.ndarray,
                 width: int) -> np.ndarray:
    """[len(rows), width]: the last `width` tokens of each of token_ids' `rows` before its num_tokens, -1 where they
    are not output tokens (one gather of just those columns)."""
    pos = num_tokens[:, None] - width + np.arange(width)
    return np.where(pos >= num_prompt[:, None], token_ids[rows[:, None], np.maximum(pos, 0)], -1)


def apply_min_tokens(logits: torch.Tensor, b: SamplingBatch) -> None:
    """Rows below min_tokens cannot pick a stop token, nor EOS unless they ignore it."""
    rows = np.flatnonzero(b.num_output < b.min_tokens)
    if not len(rows):
        return
    eos = np.where(b.ignore_eos[rows, None], -1, b.eos_token_ids[rows])
    banned = np.concatenate([b.stop_token_ids[rows], eos], axis=1)
    r, c = np.nonzero(banned >= 0)
    logits[torch.from_numpy(rows[r]), torch.from_numpy(banned[r, c].astype(np.int64))] = float("-inf")


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside top-k, top-p and min-p (all vectorized over rows) with -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    rank = torch.arange(vocab).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, vocab)
    remove = rank >= k[:, None]
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # Drop a token once the mass strictly before it already reaches top_p (always keeps the first).
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= top_p[:, None]
    remove |= probs < (min_p[:, None] * probs[:, :1])
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def greedy_batch(logits: torch.Tensor) -> BatchSample:
    """sample_batch for rows that are greedy with no penalties, min_tokens or logprobs: just the argmax."""
    # numpy's argmax (the first maximum, as torch's) is ~10x faster than torch's on one CPU thread
    return BatchSample(logits.float().numpy().argmax(axis=-1), [], [], [])


def process_logits(logits: torch.Tensor, b: SamplingBatch) -> None:
    """The request's own logit processing before any temperature, in place: bias, bad words, penalties, min_tokens."""
    apply_logit_bias(logits, b)
    apply_bad_words(logits, b)
    apply_penalties(logits, b)
    apply_min_tokens(logits, b)


def scale_and_filter(logits: torch.Tensor, b: SamplingBatch, random_rows: np.ndarray) -> torch.Tensor:
    """The random rows' processed logits after temperature, top-k, top-p and min-p (-inf where filtered out):
    softmax of this is the distribution they sample from."""
    # The random rows' copy and division only where they change something (x / 1 is x): together ~2 ms of a 64-row
    # step at temperature 1, next to the draw's 4 ms.
    scaled = logits if len(random_rows) == len(b) else logits[torch.from_numpy(random_rows)]
    temperature = b.temperature[random_rows]
    if (temperature != 1.0).any():
        scaled = scaled / torch.from_numpy(temperature)[:, None]
    top_k, top_p, min_p = b.top_k[random_rows], b.top_p[random_rows], b.min_p[random_rows]
    # All random rows are filtered when any needs it, as always: the filter is not exactly a no-op for a row
    # without top-k / top-p / min-p (its cumulative mass may round to >= 1 before the tail), so filtering only
    # the rows that ask would change some draws.
    if bool((top_k > 0).any() or (top_p < 1).any() or (min_p > 0).any()):
        scaled = _filter(scaled, torch.from_numpy(top_k), torch.from_numpy(top_p), torch.from_numpy(min_p))
    return scaled


# Draws the random rows' tokens from their scaled logits (scale_and_filter); the default is plain sampling, a
# speculative verifier passes its own (worker_svc/core/draft_model.py: rejection sampling).
Draw = Callable[[torch.Tensor, np.ndarray, SamplingBatch], np.ndarray]


def plain_draw(scaled: torch.Tensor, random_rows: np.ndarray, b: SamplingBatch) -> np.ndarray:
    return draw_tokens(scaled, draw_keys(b.seed[random_rows], b.position[random_rows]))


@torch.inference_mode()  # the model's logits are inference tensors: updating them in place needs this mode
def sample_batch(logits: torch.Tensor, b: SamplingBatch, draw: Draw = plain_draw) -> BatchSample:
    """logits: [len(b), vocab] float32 on the CPU (modified in place)."""
    logits = logits.float()
    lp_rows = np.flatnonzero(b.logprobs >= 0)
    # Logprobs are of the raw distribution: taken before penalties and bans change the logits.
    raw_logprobs = torch.log_softmax(logits[torch.from_numpy(lp_rows)], dim=-1) if len(lp_rows) else None
    process_logits(logits, b)

    greedy = b.greedy
    random_rows = np.flatnonzero(~greedy)
    if not len(random_rows):
        tokens = greedy_batch(logits).token_ids
    else:
        # The argmax only over the greedy rows.
        tokens = np.empty(len(b), dtype=np.int64)
        if len(random_rows) < len(b):
            greedy_rows = np.flatnonzero(greedy)
            tokens[greedy_rows] = greedy_batch(logits[torch.from_numpy(greedy_rows)]).token_ids
        tokens[random_rows] = draw(scale_and_filter(logits, b, random_rows), random_rows, b)

    chosen: list[float] = []
    top: list[list[tuple[int, float]]] = []
    if raw_logprobs is not None:
        chosen = raw_logprobs.gather(1, torch.from_numpy(tokens[lp_rows])[:, None]).squeeze(1).tolist()
        wanted = b.logprobs[lp_rows].tolist()
        max_n = max(wanted)
        if max_n > 0:
            top_vals, top_ids = raw_logprobs.topk(max_n, dim=-1)
            ids, vals = top_ids.tolist(), top_vals.tolist()
            top = [list(zip(ids[i][:n], vals[i][:n], strict=True)) for i, n in enumerate(wanted)]
        else:
            top = [[] for _ in wanted]
    return BatchSample(tokens, lp_rows.tolist(), chosen, top)


def pack_logprobs(s: BatchSample, entry_of: np.ndarray) -> Logprobs:
    """The logprobs of the sampled rows that became output entries (sampled row i is entry entry_of[i]; -1: cut by
    a finish before it), flattened in entry order."""
    if not s.logprob_rows:
        return Logprobs()
    entries = entry_of[np.asarray(s.logprob_rows, dtype=np.int64)]
    keep = np.flatnonzero(entries >= 0).tolist()
    tops = [s.top_logprobs[i] for i in keep]
    return Logprobs(
        indices=entries[keep],
        logprobs=np.asarray(s.logprobs, dtype=np.float32)[keep],
        num_top=np.array([len(t) for t in tops], dtype=np.int64),
        top_token_ids=np.array([t for top in tops for t, _ in top], dtype=np.int64),
        top_logprobs=np.array([v for top in tops for _, v in top], dtype=np.float32),
    )
