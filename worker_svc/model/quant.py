"""GGUF weights kept quantized: read the blocks as integer codes with per-group scales, and run weight-only
quantized matmuls on them.

Two in-memory forms, chosen by the GGUF type:
- int4, groups of 32 along the input dim (Q4_0, Q4_1, Q4_K): exactly the file's values, w = scale * q + zero with
  q in 0..15 (Q4_K's sub-block scales and mins are such groups).
- int8, groups of 32 along the input dim, w = scale * q: Q8_0 exactly the file's values; every other quantized
  type (Q5_*, Q6_K, ...) dequantized, then requantized per group: a rounding step on top of the file's, within
  half a code of the group's absmax / 127. (torch's int8 weight-only kernel takes one scale per output row: where
  it runs instead of the project's kernels, `QuantLinear` requantizes per row once more.)

A third form holds an HF FP8 checkpoint's weights (hf_quant.py): float8_e4m3fn codes with a float32 scale per row
and per `group` columns (the checkpoint's block width, or the whole row), dequantized in each matmul, so the values
are the checkpoint's exactly and memory stays FP8-sized: on CUDA into the activations' dtype, on the CPU into float32
registers by the project's kernel (`fp8_matmul`; where it is not built, the loader dequantizes each projection once as
it arrives).

The matmuls: on CPU the project's kernels (kernels/csrc/quant_matmul.cpp: float32 or bfloat16 activations, the
weights turned into float32 in registers), or where they are not built torch's int4 / int8 weight-packed kernels
(bfloat16 activations only); on CUDA the Triton dequantize-GEMM in kernels/quant_gemm.py (bfloat16 or float16).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

GROUP = 32  # the int4 group size: every GGUF 4-bit type's (sub-)block length
_DEQUANTIZE_CHUNK = 1 << 22  # values an FP8 dequantize on the host widens at once (16 MB of float32)

# GGUF type names read as exact int4 groups (block bytes per 32 or 256 values below).
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


@dataclasses.dataclass
class QuantizedWeight:
    """A [out, in] matmul weight as integer codes. int4: codes uint8 [out, in] in 0..15, scale and zero
    [out, in / 32] (w = scale * q + zero). int8: codes int8 [out, in], scale [out, in / 32], zero None (w = scale * q).
    `source` names the GGUF type it came from."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int
    source: str
    activation_bits: int = 0  # 8 or 16: the CPU kernel makes x's 32-groups integers first (--activation-quantization)
    group: int = GROUP  # input columns a scale covers (fp8: a checkpoint's block width, or all columns)

    @property
    def is_fp8(self) -> bool:
        """codes float8_e4m3fn [out, in], scale [out, ceil(in / group)] (an HF FP8 checkpoint, hf_quant.py)."""
        return self.codes.dtype == torch.float8_e4m3fn

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def map_rows(self, fn) -> QuantizedWeight:
        """Apply a row operation (slice, permutation) to codes and per-row scales alike."""
        return dataclasses.replace(self, codes=fn(self.codes), scale=fn(self.scale),
                                   zero=None if self.zero is None else fn(self.zero))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, inp = self.shape
        if self.is_fp8 and self.codes.device.type == "cpu":
            return self._fp8_rows_dequantized(dtype)
        if self.is_fp8:  # the last block may be partial: scales repeated over the columns, cut to the width
            return (self.codes.float() * self.scale.repeat_interleave(self.group, dim=1)[:, :inp]).to(dtype)
        w = self.codes.view(out, inp // GROUP, GROUP).float() * self.scale.unsqueeze(-1)
        return (w if self.zero is None else w + self.zero.unsqueeze(-1)).reshape(out, inp).to(dtype)

    def _fp8_rows_dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The FP8 dequantize on the host, a few rows at a time into the result: the float32 temporary is a chunk's
        (16 MB), not three copies of the matrix (0.2 GB for one 8192 x 2048 projection, beside a load's kept weights).
        The same values: each row's product, then cast. Smaller chunks are slower (an 8192 x 2048 projection: 0.42 s
        in 4M-value chunks, as fast as whole, 0.99 s in 1M, 2.9 s in 256K: each chunk is mapped and unmapped afresh
        under the load's mmap threshold, its pages faulted on first touch; not pinned down further)."""
        out, inp = self.shape
        result = torch.empty(out, inp, dtype=dtype)
        step = max(1, _DEQUANTIZE_CHUNK // inp)
        whole_blocks = inp % self.group == 0
        for start in range(0, out, step):
            rows = slice(start, start + step)
            chunk = self.codes[rows].float()
            if whole_blocks:  # each block's scale broadcast over its columns, no repeated copy
                chunk.view(chunk.shape[0], -1, self.group).mul_(self.scale[rows].unsqueeze(-1))
            else:  # the last block is partial: scales repeated over the columns, cut to the width
                chunk.mul_(self.scale[rows].repeat_interleave(self.group, dim=1)[:, :inp])
            result[rows] = chunk
        return result

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows `ids` (an embedding lookup)."""
        return dataclasses.replace(self, codes=self.codes[ids], scale=self.scale[ids],
                                   zero=None if self.zero is None else self.zero[ids]).dequantize(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes held, counting int4 codes at half a byte each (as packed for the matmul)."""
        code_bytes = self.codes.numel() // 2 if self.bits == 4 else self.codes.numel()
        return code_bytes + self.scale.nbytes + (0 if self.zero is None else self.zero.nbytes)


def cat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack along the output dim (q, k, v into one matmul); all parts must be of one form."""
    if len({(w.bits, w.is_fp8, w.group) for w in weights}) != 1:
        raise ValueError("cannot fuse int4 and int8 weights into one matmul: "
                         f"{', '.join(w.source for w in weights)}")
    first = weights[0]
    return QuantizedWeight(torch.cat([w.codes for w in weights]), torch.cat([w.scale for w in weights]),
                           None if first.zero is None else torch.cat([w.zero for w in weights]),
                           first.bits, "+".join(sorted({w.source for w in weights})),
                           min(w.activation_bits for w in weights), first.group)


# ---------------------------------------------------------------------------- reading GGUF blocks


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] codes: low nibbles are values 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _int4_groups(type_name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """codes [n_groups, 32] and scale, zero [n_groups] of the file's values, for one of INT4_TYPES."""
    if type_name == "Q4_0":  # d, 16 bytes of codes; w = d * (q - 8)
        d = _f16(blocks, 0)
        return _nibbles(blocks[:, 2:18]), d, -8 * d
    if type_name == "Q4_1":  # d, m, 16 bytes of codes; w = d * q + m
        return _nibbles(blocks[:, 4:20]), _f16(blocks, 0), _f16(blocks, 2)
    if type_name == "Q4_K":  # 256 values: d, dmin, 12 bytes of 6-bit sub-scales and mins, 128 bytes of codes
        n = blocks.shape[0]
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        s = blocks[:, 4:16].reshape(n, 3, 4)
        lo, hi, mix = s[:, 0], s[:, 1], s[:, 2]
        sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1).astype(np.float32)
        mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1).astype(np.float32)
        qs = blocks[:, 16:144].reshape(n, 4, 32)  # 4 chunks of 64 values: low nibbles first, then high
        codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n * 8, 32)
        return codes, (d[:, None] * sc).reshape(-1), (-dmin[:, None] * mn).reshape(-1)
    raise ValueError(f"{type_name} is not an int4 GGUF type")


def from_gguf(data: np.ndarray, type_name: str, shape: tuple[int, int],
              dequantize_fn) -> QuantizedWeight:
    """A [out, in] weight from its GGUF rows `data` (uint8 [out, bytes per row]). `dequantize_fn(data)` gives the
    file's float32 values (the gguf package's): used for the types read through int8."""
    out, inp = shape
    if inp % GROUP:
        raise ValueError(f"a {type_name} weight of {inp} input columns is not a whole number of {GROUP}-groups")
    if type_name == "Q8_0":  # d, 32 int8 codes; w = d * q
        blocks = np.ascontiguousarray(data).reshape(-1, 34)
        return QuantizedWeight(torch.from_numpy(blocks[:, 2:].copy().view(np.int8).reshape(out, inp)),
                               torch.from_numpy(_f16(blocks, 0).reshape(out, inp // GROUP).copy()), None, 8,
                               type_name)
    if type_name in INT4_TYPES:
        block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}[type_name]
        codes, scale, zero = _int4_groups(type_name, np.ascontiguousarray(data).reshape(-1, block_bytes))
        groups = inp // GROUP
        return QuantizedWeight(torch.from_numpy(codes.reshape(out, inp).astype(np.uint8)),
                               torch.from_numpy(scale.reshape(out, groups).copy()),
                               torch.from_numpy(zero.reshape(out, groups).copy()), 4, type_name)
    return requantize_int8(torch.from_numpy(np.asarray(dequantize_fn(data), dtype=np.float32).reshape(out, inp)),
                           type_name)


def requantize_int8(w: torch.Tensor, source: str) -> QuantizedWeight:
    """Symmetric int8 with one scale per 32-group along the input dim."""
    groups = w.reshape(w.shape[0], -1, GROUP)
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
    codes = torch.round(groups / scale).clamp(-127, 127).to(torch.int8).reshape(w.shape)
    return QuantizedWeight(codes, scale.squeeze(-1).float(), None, 8, source)


def per_row_int8(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [out, in], scale [out]) with one scale per row, for torch's int8 weight-only kernel."""
    w = weight.dequantize()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    return torch.round(w / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8), scale


# ---------------------------------------------------------------------------- the matmul


def cpu_kernels():
    """The project's compiled CPU module when it has the quantized matmuls (an x86-64 CPU with AVX2 and FMA), else
    None."""
    from kernels import cpu_ops

    ops = cpu_ops.load()
    return ops if ops is not None and hasattr(ops, "int4_matmul") else None


def fp8_kernel_takes(weight: QuantizedWeight) -> bool:
    """Whether the CPU kernel `fp8_matmul` runs this FP8 weight: it is built here, the input columns are whole
    32-groups, and a scale covers all of them (per tensor, per channel) or a block 32 x 2^k columns wide."""
    ops = cpu_kernels()
    if ops is None or not hasattr(ops, "fp8_matmul") or weight.shape[1] % GROUP:
        return False
    blocks = weight.group // GROUP
    return weight.scale.shape[1] == 1 or (weight.group % GROUP == 0 and blocks & (blocks - 1) == 0)


def activation_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    """The activation dtypes the quantized matmuls take on `device`."""
    if device.type == "cuda":
        return torch.bfloat16, torch.float16
    return (torch.float32, torch.bfloat16) if cpu_kernels() is not None else (torch.bfloat16,)


def pack_int4_groups(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [out, in] (0..15) -> [out, in / 2] for the project's CPU kernel: each 32-group in 16 bytes, in
    GGUF's own order (byte j holds value j in its low nibble and value j + 16 in its high one)."""
    groups = codes.view(codes.shape[0], -1, GROUP)
    return (groups[..., :16] | (groups[..., 16:] << 4)).reshape(codes.shape[0], -1).contiguous()


class QuantLinear:
    """x @ w.T for a QuantizedWeight, packed once for the device's kernel."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, device: torch.device):
        self.bits, self.source, self.dtype = weight.bits, weight.source, dtype
        self.activation_bits = weight.activation_bits
        self.out_features, self.in_features = weight.shape
        self.on_cuda = device.type == "cuda"
        self.ops = cpu_kernels() if device.type == "cpu" else None  # every GGUF block is a multiple of 32 long
        self.fp8: QuantizedWeight | None = None  # CUDA: dequantized per call by torch
        self.is_fp8, self.group = weight.is_fp8, weight.group
        if weight.is_fp8 and self.ops is not None and fp8_kernel_takes(weight):  # the codes as bytes (cat-able)
            self.codes, self.scale = weight.codes.view(torch.uint8).contiguous(), weight.scale.float().contiguous()
        elif weight.is_fp8:  # dequantized per call, memory one byte a value
            self.ops = None  # (and the C++ layer loop, which runs `ops` kernels only, leaves it to Python)
            self.fp8 = weight.map_rows(lambda t: t.to(device))
        elif weight.bits == 8 and self.ops is not None:
            self.codes, self.scale = weight.codes.contiguous(), weight.scale.float().contiguous()
        elif weight.bits == 8:
            codes, scale = per_row_int8(weight)
            self.codes, self.scale = codes.to(device), scale.to(device=device, dtype=dtype)
        elif self.ops is not None:
            self.codes = pack_int4_groups(weight.codes)
            self.scale, self.zero = weight.scale.float().contiguous(), weight.zero.float().contiguous()
        elif self.on_cuda:  # two codes a byte along the input dim, for the Triton kernel
            c = weight.codes.to(device)
            self.codes = (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()
            self.scale = weight.scale.to(device=device, dtype=torch.float32).contiguous()
            self.zero = weight.zero.to(device=device, dtype=torch.float32).contiguous()
        else:
            # torch's CPU kernel: w = (q - 8) * scale + z, scales and zeros as [groups, out, 2] in the input dtype.
            self.codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), 1)
            self.scales_and_zeros = torch.stack([weight.scale, weight.zero + 8 * weight.scale], dim=-1) \
                .transpose(0, 1).contiguous().to(dtype)

    def fuses_residual(self, x: torch.Tensor) -> bool:
        """Whether `self(x, residual=...)` adds the residual inside the kernel (float32 on the project's kernels)."""
        return self.ops is not None and x.dtype == torch.float32

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w.T; with `residual` (only where `fuses_residual(x)`): residual + x @ w.T, as a separate add."""
        if self.fp8 is not None:
            return torch.nn.functional.linear(x, self.fp8.dequantize(x.dtype))
        if self.ops is not None and x.dim() == 2:  # the model's case, without the reshapes (a decode step's ~150 calls)
            if self.is_fp8:
                return self.ops.fp8_matmul(x, self.codes, self.scale, self.group, residual)
            if self.bits == 8:
                return self.ops.int8_matmul(x, self.codes, self.scale, self.activation_bits, residual)
            return self.ops.int4_matmul(x, self.codes, self.scale, self.zero, self.activation_bits, residual)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.ops is not None:
            res = None if residual is None else residual.reshape(-1, self.out_features)
            y = self.ops.fp8_matmul(x, self.codes, self.scale, self.group, res) if self.is_fp8 else \
                self.ops.int8_matmul(x, self.codes, self.scale, self.activation_bits, res) if self.bits == 8 else \
                self.ops.int4_matmul(x, self.codes, self.scale, self.zero, self.activation_bits, res)
        elif self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scale)
        elif self.on_cuda:
            from kernels.quant_gemm import int4_matmul

            y = int4_matmul(x, self.codes, self.scale, self.zero)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.codes, GROUP, self.scales_and_zeros)
        return y.reshape(*shape[:-1], self.out_features)


def with_integer_activations(weights: dict, bits: int, device: torch.device) -> dict:
    """--activation-quantization int8 / int16: every quantized weight's matmul makes its input's 32-groups integers
    first. Refused, naming the flag, where the project's CPU kernels do not run."""
    flag = f"--activation-quantization int{bits}"
    if device.type != "cpu" or cpu_kernels() is None:
        raise ValueError(f"{flag} runs on the project's CPU kernels (an x86-64 CPU with AVX2 and FMA); they are not "
                         f"available on this {device.type} device")
    quantized = {k: w for k, w in weights.items() if isinstance(w, QuantizedWeight)}
    if any(w.is_fp8 for w in quantized.values()):
        raise ValueError(f"{flag} runs on int4 / int8 weights (--quantization gguf), not on an FP8 checkpoint's")
    if not quantized:
        raise ValueError(f"{flag} needs quantized weights: add --quantization gguf with a .gguf model")
    odd = [k for k, w in quantized.items() if w.shape[1] % GROUP]
    if odd:
        raise ValueError(f"{flag}: {odd[0]} has {quantized[odd[0]].shape[1]} input columns, not a multiple of {GROUP}")
    return weights | {k: dataclasses.replace(w, activation_bits=bits) for k, w in quantized.items()}


def check_activation_dtype(dtype: torch.dtype, device: torch.device) -> None:
    """Refused at start, naming the flags."""
    allowed = activation_dtypes(device)
    if dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"--quantization gguf runs activations in {names} on {device.type}; "
                         f"--dtype {str(dtype).removeprefix('torch.')} is not supported with it")
