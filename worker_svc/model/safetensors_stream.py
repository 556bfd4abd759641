"""Read a safetensors checkpoint one tensor at a time, in bounded host memory.

Each tensor is read lazily from its file (`safe_open`; a tensor-parallel rank reads only its slice), converted once
to the dtype it is kept in and placed on its device before the next one is read. The file is opened again for each
tensor: safetensors maps the whole file, and the pages a read touched stay in the process's resident set until that
mapping closes, so one mapping per tensor keeps the file's share of the peak to one tensor instead of the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from worker_svc.model.config import ModelConfig
from worker_svc.parallel.sharding import FULL, Shard, shard_tensor

_CONVERTIBLE = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Placement:
    """Where loaded weights live: matmul-shaped float tensors (2-D and up) in `dtype` on `device`. Vectors (norms,
    biases, per-head scalars) stay float32, since some families compute with them in float32 (they are tiny);
    integer and float8 tensors (quantized checkpoints) stay as stored."""

    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def dtype_of(self, stored: torch.dtype, ndim: int) -> torch.dtype:
        if stored not in _CONVERTIBLE:
            return stored
        return self.dtype if ndim >= 2 else torch.float32


HOST_FLOAT32 = Placement()  # everything float32 on the host: what the loader gave before placements


def tensor_names(files: list[str]) -> list[tuple[str, str]]:
    """(file, tensor name) of every tensor, in file order."""
    from safetensors import safe_open

    names = []
    for file in files:
        with safe_open(file, framework="pt") as f:
            names += [(file, name) for name in f.keys()]
    return names


def iter_tensors(files: list[str], config: ModelConfig, shard: Shard = FULL,
                 placement: Placement = HOST_FLOAT32) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each tensor of `files`, one at a time: this rank's slice, in its placement's dtype and
    device, in memory of its own (never a view of the file)."""
    from safetensors import safe_open

    for file, name in tensor_names(files):
        with safe_open(file, framework="pt") as f:
            part = shard_tensor(name, f.get_slice(name), config, shard)  # slice first: only these bytes are read
            yield name, place(part, placement)


def place(part: torch.Tensor, placement: Placement) -> torch.Tensor:
    """`part` in its placement's dtype and device, in memory of its own."""
    dtype = placement.dtype_of(part.dtype, part.dim())
    if placement.device.type != "cpu":
        # A narrowing cast on the host halves the copy; a widening one is done on the device.
        if dtype.itemsize < part.dtype.itemsize:
            part = part.to(dtype)
        return part.to(placement.device, non_blocking=False).to(dtype)
    if dtype != part.dtype:
        return part.to(dtype)  # a new tensor: the file's pages are left behind
    return part.clone(memory_format=torch.contiguous_format)  # own memory: the mapping closes with the file


class LazyTensors(Mapping[str, torch.Tensor]):
    """The tensors of `files` by name, each read from its file only when looked up (a quantized checkpoint's
    conversion takes a layer's codes, scales and zeros together, then lets them go): in memory of its own, as
    stored. The file is opened per lookup, for the reason iter_tensors gives."""

    def __init__(self, files: list[str]):
        self._file_of = {name: file for file, name in tensor_names(files)}

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self._file_of[name], framework="pt") as f:
            return f.get_tensor(name).clone(memory_format=torch.contiguous_format)

    def shape(self, name: str) -> list[int]:
        """A tensor's shape from the file's header, without reading its data."""
        from safetensors import safe_open

        with safe_open(self._file_of[name], framework="pt") as f:
            return f.get_slice(name).get_shape()

    def __contains__(self, name: object) -> bool:
        return name in self._file_of  # without reading the tensor (Mapping's default looks it up)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)
