"""Mamba2's selective state-space scan (SSD) over a flattened step, from carried states (Nemotron-H, Granite 4.0).

Per head the state is a [head_dim, state_size] matrix S; token t with step dt_t > 0 does

    S <- exp(dt_t A) S + dt_t x_t B_t^T;   y_t = S C_t + D x_t

Decode rows (a sequence with one row in the step) take that update directly, all at once. Longer chunks take the
chunked (SSD) form: within a block of tokens the outputs are a masked, decayed C B^T "attention" over dt x, plus the
block's start state read through C; the blocks of one sequence are visited in order, those of all sequences at the
same index together. So the Python loop runs over block indices only, never over tokens or sequences (the split and
the blocks' layout: recurrent_split.py, made once per step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from worker_svc.model.layers.op import LayerOp
from worker_svc.model.layers.recurrent_split import ChunkBlocks, RecurrentSplit


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
             states: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor, split: RecurrentSplit | None = None,
             decode_step: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """y [T, H, P] float32 for x [T, H, P], dt [T, H] (already softplus'd and clamped), a [H] (< 0), b and c
    [T, G, N] (each group serves H / G consecutive heads), d [H]; `states` [S, H, P, N] is read at `slots` [N] and
    updated in place; cu_seqlens [N + 1] gives each sequence's rows, `split` the step's decode rows and chunks (from
    cu_seqlens where None). `decode_step`: what the one-row sequences take (torch's `_recurrent_step` where None;
    `SSDScan` picks the device's kernel)."""
    split = split or RecurrentSplit.of_cu_seqlens(cu_seqlens)
    heads = x.shape[1]
    x, dt = x.float(), dt.float()
    b, c = (y.float().repeat_interleave(heads // y.shape[1], dim=1) for y in (b, c))
    out = torch.empty_like(x)
    if split.decode_rows is not None:
        rows = split.decode_rows
        step = decode_step or _recurrent_step
        out[rows] = step(x[rows], dt[rows], a, b[rows], c[rows], states, slots[split.decode_seqs])
    if split.chunks is not None:
        _chunked(x, dt, a, b, c, states, slots[split.chunks.seqs], split.chunks, out)
    return out + d.float()[:, None] * x


def _recurrent_step(x, dt, a, b, c, states, slots) -> torch.Tensor:
    s = states.index_select(0, slots).float().mul_((dt * a).exp()[..., None, None])  # a copy: updated in place
    s.add_((dt.unsqueeze(-1) * x).unsqueeze(-1) * b.unsqueeze(-2))
    states.index_copy_(0, slots, s.to(states.dtype))
    return torch.einsum("nhpk,nhk->nhp", s, c)


def _chunked(x, dt, a, b, c, states, slots, chunks: ChunkBlocks, out) -> None:
    """The chunked sequences (slots: theirs), block by block as `chunks` lays them out."""
    size, device = chunks.size, x.device
    xb, dtb, bb, cb = (chunks.gather(y) for y in (x, dt, b, c))  # padding: dt 0, so no decay and no write
    cum = (dtb * a[:, None]).cumsum(-1)  # [M, H, C] log decay from the block's start
    lower = torch.ones(size, size, dtype=torch.bool, device=device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    xdt = xb * dtb.unsqueeze(-1)
    y_diag = ((cb @ bb.transpose(-1, -2)) * decay) @ xdt  # [M, H, C, P]
    start_decay = cum.exp().unsqueeze(-1)
    to_end = (cum[..., -1:] - cum).exp().unsqueeze(-1)
    writes = (xdt * to_end).transpose(-1, -2) @ bb  # [M, H, P, N]: the block's own contribution to its end state
    block_decay = cum[..., -1].exp()[..., None, None]
    s = states.index_select(0, slots).float()
    result = torch.empty_like(xb)
    for on, m in chunks.rounds:  # the j-th blocks of the sequences that have one
        s_on = s[on]
        result[m] = y_diag[m] + (cb[m] @ s_on.transpose(-1, -2)) * start_decay[m]
        s[on] = s_on * block_decay[m] + writes[m]
    states.index_copy_(0, slots, s.to(states.dtype))
    chunks.scatter(out, result)


class SSDScan(LayerOp):
    """`ssd_scan` with the device's decode step: torch's natively, on CUDA the Triton kernel that updates the pool in
    place (no gather / write-back of the decoding sequences' states)."""

    def forward_native(self, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                       d: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                       split: RecurrentSplit | None = None) -> torch.Tensor:
        return ssd_scan(x, dt, a, b, c, d, states, slots, cu_seqlens, split)

    def forward_cuda(self, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                     d: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                     split: RecurrentSplit | None = None) -> torch.Tensor:
        from kernels.recurrent_triton import ssd_decode  # Triton: imported only where it runs

        return ssd_scan(x, dt, a, b, c, d, states, slots, cu_seqlens, split, ssd_decode)
