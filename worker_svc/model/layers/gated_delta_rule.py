"""The gated delta rule (Gated DeltaNet's token mixer: Qwen3-Next, Qwen3.5) over a flattened step, from carried states.

Per value head the state is a [key_dim, value_dim] matrix S. Token t (q and k L2-normalised, q scaled by
key_dim^-1/2) does

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

Decode tokens (a sequence with one row in the step) take that update directly, all at once. Longer chunks take the
chunked form: within a block of C tokens the updates are solved together as one unit-lower-triangular system (the
WY form of the delta rule), and only the blocks of a sequence are visited in order, with the blocks of all sequences
at the same index processed together; so the Python loop runs over block indices (ceil(longest chunk / C)), never
over tokens or sequences (the split and the blocks' layout: recurrent_split.py, made once per step). Every sequence
starts from its state slot and leaves its final state there, which is how chunked prefill carries the state across
chunks exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from worker_svc.model.layers.op import LayerOp
from worker_svc.model.layers.recurrent_split import ChunkBlocks, RecurrentSplit


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                     split: RecurrentSplit | None = None,
                     decode_step: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """o [T, Hv, dv] float32 for q, k [T, Hk, dk], v [T, Hv, dv], g (log decay, <= 0) and beta [T, Hv]; each key head
    serves Hv / Hk consecutive value heads. `states` [S, Hv, dk, dv] is read at `slots` [N] and updated in place;
    cu_seqlens [N + 1] gives each sequence's rows, `split` the step's decode rows and chunks (from cu_seqlens where
    None). `decode_step`: what the one-row sequences take (torch's `_recurrent_step` where None; `GatedDeltaRule`
    picks the device's kernel)."""
    split = split or RecurrentSplit.of_cu_seqlens(cu_seqlens)
    heads = v.shape[1]
    q, k = (l2_normalize(x.float()).repeat_interleave(heads // x.shape[1], dim=1) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty_like(v)
    if split.decode_rows is not None:
        rows = split.decode_rows
        step = decode_step or _recurrent_step
        out[rows] = step(q[rows], k[rows], v[rows], g[rows], beta[rows], states, slots[split.decode_seqs])
    if split.chunks is not None:
        _chunked(q, k, v, g, beta, states, slots[split.chunks.seqs], split.chunks, out)
    return out


def _recurrent_step(q, k, v, g, beta, states, slots) -> torch.Tensor:
    """One token per sequence: q, k [N, H, dk], v [N, H, dv], g, beta [N, H]."""
    s = states.index_select(0, slots).float().mul_(g.exp()[..., None, None])  # a copy: updated in place below
    delta = (v - torch.einsum("nhk,nhkv->nhv", k, s)) * beta.unsqueeze(-1)
    s.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    states.index_copy_(0, slots, s.to(states.dtype))
    return torch.einsum("nhk,nhkv->nhv", q, s)


def _chunked(q, k, v, g, beta, states, slots, chunks: ChunkBlocks, out) -> None:
    """The chunked sequences (slots: theirs), block by block as `chunks` lays them out."""
    size, device = chunks.size, q.device
    qb, kb, vb = chunks.gather(q), chunks.gather(k), chunks.gather(v)  # [M, H, C, d]
    gb, bb = chunks.gather(g), chunks.gather(beta)  # [M, H, C]; padding: no decay, no write
    cum = gb.cumsum(-1)
    lower = torch.ones(size, size, dtype=torch.bool, device=device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()  # exp(G_i - G_j), j<=i
    k_beta = kb * bb.unsqueeze(-1)
    system = (k_beta @ kb.transpose(-1, -2)) * decay  # the unit diagonal is implied below
    rhs = torch.cat([vb * bb.unsqueeze(-1), k_beta * cum.exp().unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split([vb.shape[-1], kb.shape[-1]], dim=-1)  # new values; decayed keys reading the old state
    attn = (qb @ kb.transpose(-1, -2)) * decay
    q_decayed = qb * cum.exp().unsqueeze(-1)
    k_decayed = kb * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    block_decay = cum[..., -1].exp()[..., None, None]
    s = states.index_select(0, slots).float()  # [N, H, dk, dv]
    result = torch.empty_like(u)
    for on, m in chunks.rounds:  # the j-th blocks of the sequences that have one
        s_on = s[on]
        v_new = u[m] - w[m] @ s_on
        result[m] = q_decayed[m] @ s_on + attn[m] @ v_new
        s[on] = s_on * block_decay[m] + k_decayed[m].transpose(-1, -2) @ v_new
    states.index_copy_(0, slots, s.to(states.dtype))
    chunks.scatter(out, result)


class GatedDeltaRule(LayerOp):
    """`gated_delta_rule` with the device's decode step: torch's natively, on CUDA the Triton kernel that updates the
    pool in place (no gather / write-back of the decoding sequences' states)."""

    def forward_native(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       states: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                       split: RecurrentSplit | None = None) -> torch.Tensor:
        return gated_delta_rule(q, k, v, g, beta, states, slots, cu_seqlens, split)

    def forward_cuda(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                     split: RecurrentSplit | None = None) -> torch.Tensor:
        from kernels.recurrent_triton import gated_delta_rule_decode  # Triton: imported only where it runs

        return gated_delta_rule(q, k, v, g, beta, states, slots, cu_seqlens, split, gated_delta_rule_decode)
