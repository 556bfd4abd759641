"""The worker's host path as it was before the persistent input batch (commit 6c740a1), kept as the oracle that the
vectorized versions are compared with: per-chunk Python input lists, the torch-built attention metadata and
reference plan, and the per-row sampler. Only tests import this."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from common.sampling_fields import SamplingParams
from kernels.reference import DECODE_GROUP_ROWS, PADDING_LIMIT, AttentionMetadata, ReferencePlan, _Group
from worker_svc.sampling.sampler import draw_keys, draw_tokens

# ------------------------------------------------------------------------------ inputs (runner._prepare)


def prepare(chunks: list[tuple[list[int], int, int, list[int]]], block_size: int, build_plan: bool = True):
    """chunks: (token_ids, start, length, block_ids) per scheduled request, in plan order."""
    ids: list[int] = []
    pos: list[int] = []
    logits_idx: list[int] = []
    samplers: list[int] = []
    for i, (tokens, start, length, _) in enumerate(chunks):
        ids.extend(tokens[start : start + length])
        pos.extend(range(start, start + length))
        if start + length == len(tokens):
            logits_idx.append(len(ids) - 1)
            samplers.append(i)
    meta = build_attention_metadata([c[2] for c in chunks], [c[1] + c[2] for c in chunks], [c[3] for c in chunks],
                                    block_size, "cpu", build_plan=build_plan)
    return (torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), meta,
            torch.tensor(logits_idx, dtype=torch.int64), samplers)


def build_attention_metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                             block_size: int, device: torch.device | str, *,
                             build_plan: bool = True) -> AttentionMetadata:
    num_seqs = len(query_lens)
    max_blocks = max((len(t) for t in block_tables), default=0) or 1
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int64)
    for i, table in enumerate(block_tables):
        tables[i, :len(table)] = torch.tensor(table, dtype=torch.int64)

    q = torch.tensor(query_lens, dtype=torch.int64)
    s = torch.tensor(seq_lens, dtype=torch.int64)
    cu = torch.zeros(num_seqs + 1, dtype=torch.int64)
    torch.cumsum(q, 0, out=cu[1:])
    seq = torch.repeat_interleave(torch.arange(num_seqs), q)
    pos = (s - q)[seq] + torch.arange(int(cu[-1])) - cu[seq]
    slot_mapping = tables[seq, pos // block_size] * block_size + pos % block_size

    device = torch.device(device)
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        block_tables=tables.to(device, torch.int32),
        cu_seqlens_q=cu.to(device, torch.int32),
        seq_lens=s.to(device, torch.int32),
        max_seqlen_q=max(query_lens, default=0),
        max_seqlen_k=max(seq_lens, default=0),
        block_size=block_size,
        plan=build_reference_plan(tables, query_lens, seq_lens, block_size, device) if build_plan else None,
    )


def build_reference_plan(block_tables: Tensor, query_lens: list[int], seq_lens: list[int],
                         block_size: int, device: torch.device | str | None = None) -> ReferencePlan:
    """Precompute gather indices and masks; see `paged_attention` for the meaning of the arguments."""
    device = block_tables.device if device is None else torch.device(device)
    tables = block_tables.to("cpu", torch.int64)
    starts = [0, *accumulate(query_lens)][:-1]
    decodes = [i for i, q in enumerate(query_lens) if q == 1]
    prefills = [i for i, q in enumerate(query_lens) if q > 1]
    # On CPU, slices small enough for a slice's gathered K/V to stay in cache; on CUDA, fewer launches.
    max_rows = DECODE_GROUP_ROWS if device.type == "cpu" else float("inf")
    batches = _split_decodes(decodes, seq_lens, block_size, max_rows)
    groups, empty = [], []
    for ids in (*batches, *_split_prefills(prefills, query_lens, seq_lens)):
        if ids:
            group, group_empty = _build_group(ids, tables, starts, query_lens, seq_lens, block_size, device)
            groups.append(group)
            empty.append(group_empty)
    empty_rows = torch.cat(empty) if empty else torch.empty(0, dtype=torch.int64)
    return ReferencePlan(
        num_tokens=sum(query_lens),
        groups=groups,
        empty_rows=empty_rows.to(device) if len(empty_rows) else None,
    )


def _split_decodes(decodes: list[int], seq_lens: list[int], block_size: int, max_rows: float) -> list[list[int]]:
    """Decodes by increasing context, in groups of at most `max_rows` gathered rows where possible (a sequence is
    never split) whose padding to the group's longest context stays within PADDING_LIMIT: one 2k-token context
    among 200-token ones would otherwise make every member of its group gather and attend 2k rows."""
    groups: list[list[int]] = []
    real = 0
    for i in sorted(decodes, key=lambda i: seq_lens[i]):
        rows = max(1, -(-seq_lens[i] // block_size)) * block_size
        if groups:
            padded = (len(groups[-1]) + 1) * rows  # sorted: this one is the group's longest
            if padded <= max_rows and padded <= PADDING_LIMIT * (real + rows):
                groups[-1].append(i)
                real += rows
                continue
        groups.append([i])
        real = rows
    return groups




def _split_prefills(prefills: list[int], query_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Prefill chunks in groups of similar shape, by increasing context length."""
    groups: list[list[int]] = []
    real = 0
    for i in sorted(prefills, key=lambda i: (seq_lens[i], query_lens[i])):
        if groups:
            g = groups[-1] + [i]
            padded = len(g) * max(query_lens[j] for j in g) * max(seq_lens[j] for j in g)
            if padded <= PADDING_LIMIT * (real + query_lens[i] * seq_lens[i]):
                groups[-1].append(i)
                real += query_lens[i] * seq_lens[i]
                continue
        groups.append([i])
        real = query_lens[i] * seq_lens[i]
    return groups


def _build_group(ids: list[int], tables: Tensor, starts: list[int], query_lens: list[int],
                 seq_lens: list[int], block_size: int, device: torch.device) -> tuple[_Group, Tensor]:
    q = torch.tensor([query_lens[i] for i in ids])
    k = torch.tensor([seq_lens[i] for i in ids])
    start = torch.tensor([starts[i] for i in ids])
    num_seqs, max_q, kv_len = len(ids), int(q.max()), max(1, int(k.max()))
    num_blocks = max(1, -(-kv_len // block_size))
    if tables.shape[1] < num_blocks:
        raise ValueError(f"block_tables has {tables.shape[1]} columns, a sequence of {kv_len} tokens "
                         f"needs {num_blocks} blocks of {block_size}")

    # Entries past a sequence's last block may be garbage or -1: never index with them.
    used = (k + block_size - 1) // block_size
    blocks = tables[torch.tensor(ids), :num_blocks]
    blocks = torch.where(torch.arange(num_blocks) < used[:, None], blocks, 0)

    # Gathered rows at/after seq_len are unwritten (maybe NaN): zero them, masking scores is not enough
    # because softmax weight 0 * NaN = NaN.
    t = torch.arange(kv_len)
    seq, pos_k = (t[None] >= k[:, None]).nonzero(as_tuple=True)
    kv_pad = seq * (num_blocks * block_size) + pos_k

    # Bottom-right causal: query row j sits at absolute position seq_len - query_len + j. Padded rows
    # copy the last real row so they are never fully masked; their output is dropped.
    j = torch.arange(max_q)
    real = j[None] < q[:, None]
    q_pos = torch.where(real, (k - q)[:, None] + j, (k - 1)[:, None])
    mask = t[None, None] <= q_pos[:, :, None]  # implies t < seq_len, so no separate length mask

    token = start[:, None] + j
    rows = token[real]
    q_index = torch.where(real, token, start[:, None]).flatten()
    empty_rows = token[real & (q_pos < 0)]
    real_pos = None if bool(real.all()) else real.flatten().nonzero().squeeze(1)
    first = int(rows[0])
    # Whole prompts of one length: the mask is plain causal, which SDPA skips blocks for.
    causal = max_q > 1 and bool(real.all()) and torch.equal(q, k)
    span = (first, first + len(rows)) if torch.equal(rows, torch.arange(first, first + len(rows))) else None

    group = _Group(
        num_seqs=num_seqs,
        max_q=max_q,
        kv_len=kv_len,
        num_blocks=num_blocks,
        blocks=blocks.flatten().to(device),
        kv_pad=kv_pad.to(device) if len(kv_pad) else None,
        mask=None if causal or bool(mask.all()) else mask[:, None].to(device),
        causal=causal,
        q_index=q_index.to(device),
        real_pos=None if real_pos is None else real_pos.to(device),
        rows=rows.to(device),
        span=span,
        q_pos=q_pos.numpy(),
    )
    return group, empty_rows


# ------------------------------------------------------------------------------------------- sampler


@dataclass
class SampleRow:
    """What the sampler needs to know about one request that samples this step."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    position: int  # index the new token will have in prompt + output
    eos_ids: frozenset[int]


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]]]


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """vLLM semantics: repetition over prompt + output; presence and frequency over output only."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.uses_penalties:
            continue
        out = torch.tensor(row.output_ids, dtype=torch.int64)
        counts = torch.zeros(vocab, dtype=logits.dtype).scatter_add_(0, out, torch.ones(len(out), dtype=logits.dtype))
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.tensor(row.prompt_ids, dtype=torch.int64)] = True
            penalized = torch.where(logits[i] > 0, logits[i] / p.repetition_penalty, logits[i] * p.repetition_penalty)
            logits[i] = torch.where(seen, penalized, logits[i])
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _apply_min_tokens(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    for i, row in enumerate(rows):
        if len(row.output_ids) < row.params.min_tokens:
            banned = set(row.params.stop_token_ids) | (set() if row.params.ignore_eos else set(row.eos_ids))
            if banned:
                logits[i, list(banned)] = float("-inf")


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


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SampleOutput:
    """logits: [len(rows), vocab] float32 (modified in place)."""
    logits = logits.float()
    want_logprobs = [r.params.logprobs is not None for r in rows]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

    if any(r.params.uses_penalties for r in rows):
        _apply_penalties(logits, rows)
    if any(len(r.output_ids) < r.params.min_tokens for r in rows):
        _apply_min_tokens(logits, rows)

    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        sub = [rows[i] for i in random_rows]
        idx = torch.tensor(random_rows)
        temp = torch.tensor([r.params.temperature for r in sub], dtype=torch.float32)
        scaled = logits[idx] / temp[:, None]
        top_k = torch.tensor([r.params.top_k for r in sub])
        top_p = torch.tensor([r.params.top_p for r in sub], dtype=torch.float32)
        min_p = torch.tensor([r.params.min_p for r in sub], dtype=torch.float32)
        if bool((top_k > 0).any() or (top_p < 1).any() or (min_p > 0).any()):
            scaled = _filter(scaled, top_k, top_p, min_p)
        for j, r in enumerate(sub):  # one row at a time
            tokens[random_rows[j]] = int(draw_tokens(scaled[j:j + 1], draw_keys([r.params.seed], [r.position]))[0])

    token_list = tokens.tolist()
    out_lp: list[float | None] = [None] * len(rows)
    out_top: list[list[tuple[int, float]]] = [[] for _ in rows]
    if raw_logprobs is not None:
        max_n = max((r.params.logprobs or 0) for r in rows)
        chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        top_vals, top_ids = raw_logprobs.topk(max_n, dim=-1) if max_n > 0 else (None, None)
        for i, r in enumerate(rows):
            if r.params.logprobs is None:
                continue
            out_lp[i] = chosen[i]
            n = r.params.logprobs
            if n and top_ids is not None:
                out_top[i] = list(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist(), strict=True))
    return SampleOutput(token_list, out_lp, out_top)


# ------------------------------------------------------------------------------- finish (runner._finish_reason)

_FINISH = {"eos": 1, "stop": 2, "length": 3}  # pb.FINISH_REASON_*


def finish_reason(p: SamplingParams, token_ids: list[int], num_prompt_tokens: int, eos_ids: frozenset[int],
                  max_model_len: int) -> int:
    """token_ids: prompt + output, the new token last."""
    tok = token_ids[-1]
    n_out = len(token_ids) - num_prompt_tokens
    reason = None
    if n_out >= p.min_tokens:
        if tok in eos_ids and not p.ignore_eos:
            reason = "eos"
        elif tok in p.stop_token_ids:
            reason = "stop"
    if reason is None and ((p.max_tokens and n_out >= p.max_tokens) or len(token_ids) >= max_model_len):
        reason = "length"
    return _FINISH.get(reason, 0)
