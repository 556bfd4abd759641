"""A step's sequences as the recurrent scans (gated delta rule, Mamba2's SSD) take them: decode rows and blocked chunks.

Both scans run a sequence with one row in the step through the direct recurrent update (all such rows at once) and
a longer chunk through the chunked form: blocks of up to BLOCK tokens, the blocks of all sequences at the same index
together. Which sequence goes where, and where each block's rows are, is integer bookkeeping over the chunks'
lengths, the same for every recurrent layer of the step. So it is worked out once per step, on the host from the
lengths the plan already has, and moved to the device once: the layers never read a device value to pick a path or
size a loop (on CUDA each such read waits for the GPU, once per layer per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 64  # tokens solved together in the chunked form


@dataclass(frozen=True)
class ChunkBlocks:
    """The chunked sequences' blocks: M blocks of `size` rows each, block-major, padded past a chunk's end."""

    seqs: torch.Tensor  # [N'] the step's sequences with more than one row, in step order
    size: int  # tokens per block: BLOCK, or the next power of two above the longest chunk when that is shorter
    rows: torch.Tensor  # [M, size] each block position's row in the step (0 where padding)
    valid: torch.Tensor  # [M, size] bool: a row of the chunk, not padding
    valid_flat: torch.Tensor  # [K] the valid positions of rows.flatten()
    rounds: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # block index j: (sequences with a j-th block, as
    # positions in seqs; those blocks)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, ...] -> [M, H, size, ...], zero past a chunk's end (so padding neither decays nor writes)."""
        y = x[self.rows] * self.valid.view(*self.valid.shape, *([1] * (x.dim() - 1)))
        return y.movedim(1, 2).contiguous()  # contiguous once, not at every matmul

    def scatter(self, out: torch.Tensor, blocked: torch.Tensor) -> None:
        """out[row] = the block row holding it, for [M, H, size, ...] `blocked` (the inverse of `gather`)."""
        flat = blocked.movedim(2, 1).flatten(0, 1)
        out[self.rows.flatten()[self.valid_flat]] = flat[self.valid_flat]


@dataclass(frozen=True)
class RecurrentSplit:
    decode_seqs: torch.Tensor | None  # [D] the sequences with one row; None: there are none
    decode_rows: torch.Tensor | None  # [D] their rows
    chunks: ChunkBlocks | None  # the others; None: there are none

    @staticmethod
    def of_lengths(lengths: np.ndarray | list[int], device: torch.device | str) -> RecurrentSplit:
        """From each sequence's rows in the step (host data, in step order)."""
        lens = np.asarray(lengths, dtype=np.int64)
        starts = np.cumsum(lens) - lens
        single = lens == 1
        decode = np.flatnonzero(single)
        chunked = np.flatnonzero(~single)

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        return RecurrentSplit(dev(decode) if len(decode) else None, dev(starts[decode]) if len(decode) else None,
                              _blocks(chunked, starts[chunked], lens[chunked], dev) if len(chunked) else None)

    @staticmethod
    def of_cu_seqlens(cu_seqlens: torch.Tensor) -> RecurrentSplit:
        """From the device's cu_seqlens: one read of it, for callers without the plan's lengths at hand."""
        cu = cu_seqlens.cpu().numpy()
        return RecurrentSplit.of_lengths(cu[1:] - cu[:-1], cu_seqlens.device)


def _blocks(seqs: np.ndarray, starts: np.ndarray, lens: np.ndarray, dev) -> ChunkBlocks:
    size = min(BLOCK, 1 << (int(lens.max()) - 1).bit_length())  # short chunks: a smaller block, less padding
    blocks = (lens + size - 1) // size  # per sequence
    first = np.cumsum(blocks) - blocks
    seq = np.repeat(np.arange(len(lens)), blocks)
    index = np.arange(int(blocks.sum())) - first[seq]  # the block's index within its sequence
    offset = index[:, None] * size + np.arange(size)  # [M, C] position in the chunk
    valid = offset < lens[seq][:, None]
    rows = np.where(valid, starts[seq][:, None] + offset, 0)
    rounds = []
    for j in range(int(blocks.max())):
        on = np.flatnonzero(blocks > j)
        rounds.append((dev(on), dev(first[on] + j)))
    return ChunkBlocks(dev(seqs), size, dev(rows), dev(valid), dev(np.flatnonzero(valid.ravel())), tuple(rounds))
