"""The parts of a hybrid model's step that stay eager inside its compiled forward (compiled_hybrid.py): torch custom
ops the inductor graph calls as opaque nodes, each running the model's own eager op over the step's real rows.

An island is what a graph cannot or must not hold: the recurrent ops (causal conv, gated delta rule, SSD scan),
which read and write the state pool at the step's slots and pick their path from host data (the step's split); the
KV write and paged attention, whose metadata is Python data; the MoE experts (a loop over the experts that received
tokens); a speculative head's capture of hidden states; and a tensor-parallel all-reduce. The graph runs padded
rows; an island takes the first `num_real` rows of its inputs, runs the eager op on them and pads its output back
with zeros, so a padding row never reaches a state slot, the KV cache or a captured state, and every real row's
result is the eager op's.

What an island needs beyond tensors (the pool, the slots, the attention metadata, the real model) is the step's
`StepContext`, this thread's for the duration of one graph call (`running`): the graph passes only the layer index, a
constant of the trace, so two models of the same shapes trace the same graph and share inductor's cache. The KV
write and the capture return nothing; each "mutates" the step's order token, which the attention island reads, so
the graph keeps them and keeps their order.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

_local = threading.local()  # .ctx: the StepContext of the graph this thread is running


@dataclass
class StepContext:
    """One graph call's eager side. `model` None: the warm-up, where every island returns zeros."""

    num_real: int
    model: Any = None  # the HybridModel whose eager ops run
    kv_cache: torch.Tensor | None = None
    attn_meta: Any = None
    state: Any = None  # state_cache.StateStep


@contextlib.contextmanager
def running(ctx: StepContext) -> Iterator[None]:
    """The islands of the graph called inside this block read `ctx`."""
    _local.ctx = ctx
    try:
        yield
    finally:
        _local.ctx = None


def _real(*xs: torch.Tensor) -> tuple[StepContext, list[torch.Tensor]]:
    ctx = _local.ctx
    return ctx, [x[: ctx.num_real] for x in xs]


def _padded(y: torch.Tensor, rows: int) -> torch.Tensor:
    """y's rows then zero rows up to `rows`, contiguous as the fake kernels promise the graph (an eager op may hand
    back a transposed layout, e.g. einsum's)."""
    return y.contiguous() if y.shape[0] == rows else F.pad(y, (0, 0) * (y.dim() - 1) + (0, rows - y.shape[0]))


# --- the custom ops -------------------------------------------------------------------------------------------------

@torch.library.custom_op("llmserve::island_conv", mutates_args=())
def island_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: int,
                activation: str | None) -> torch.Tensor:
    ctx, (xr,) = _real(x)
    if ctx.model is None:
        return torch.zeros_like(x, memory_format=torch.contiguous_format)
    s = ctx.state
    y = ctx.model.ops.conv(xr, weight, bias, s.cache.conv[layer], s.slots, s.cu_seqlens, activation)
    return _padded(y, x.shape[0])


@island_conv.register_fake
def _(x, weight, bias, layer, activation):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("llmserve::island_delta_rule", mutates_args=())
def island_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      layer: int) -> torch.Tensor:
    ctx, real = _real(q, k, v, g, beta)
    if ctx.model is None:
        return v.new_zeros(v.shape, dtype=torch.float32)
    s = ctx.state
    return _padded(ctx.model.ops.delta_rule(*real, s.cache.ssm[layer], s.slots, s.cu_seqlens, s.split), v.shape[0])


@island_delta_rule.register_fake
def _(q, k, v, g, beta, layer):
    return v.new_empty(v.shape, dtype=torch.float32)


@torch.library.custom_op("llmserve::island_ssd_scan", mutates_args=())
def island_ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                    d: torch.Tensor, layer: int) -> torch.Tensor:
    ctx, (xr, dtr, br, cr) = _real(x, dt, b, c)
    if ctx.model is None:
        return x.new_zeros(x.shape, dtype=torch.float32)
    s = ctx.state
    y = ctx.model.ops.ssd_scan(xr, dtr, a, br, cr, d, s.cache.ssm[layer], s.slots, s.cu_seqlens, s.split)
    return _padded(y, x.shape[0])


@island_ssd_scan.register_fake
def _(x, dt, a, b, c, d, layer):
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("llmserve::island_write_kv", mutates_args=("order",))
def island_write_kv(k: torch.Tensor, v: torch.Tensor, order: torch.Tensor, layer: int) -> None:
    ctx, (kr, vr) = _real(k, v)
    if ctx.model is not None:
        kv = ctx.kv_cache[layer]
        ctx.model.attention.write_kv_cache(kr, vr, kv[0], kv[1], ctx.attn_meta.slot_mapping)


@torch.library.custom_op("llmserve::island_attention", mutates_args=())
def island_attention(q: torch.Tensor, order: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    ctx, (qr,) = _real(q)
    if ctx.model is None:
        return torch.zeros_like(q, memory_format=torch.contiguous_format)
    kv, m = ctx.kv_cache[layer], ctx.attn_meta
    o = ctx.model.attention.paged_attention(qr.contiguous(), kv[0], kv[1], m.block_tables, m.cu_seqlens_q,
                                            m.seq_lens, scale, plan=m.plan)
    return _padded(o, q.shape[0])


@island_attention.register_fake
def _(q, order, layer, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("llmserve::island_experts", mutates_args=())
def island_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor:
    ctx, real = _real(x, weights, ids)
    if ctx.model is None:
        return torch.zeros_like(x, memory_format=torch.contiguous_format)
    return _padded(ctx.model.experts_fn(*real, gate_up, down), x.shape[0])


@island_experts.register_fake
def _(x, weights, ids, gate_up, down):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("llmserve::island_capture", mutates_args=("order",))
def island_capture(h: torch.Tensor, order: torch.Tensor, layer: int) -> None:
    ctx, (hr,) = _real(h)
    if ctx.model is not None and ctx.model.capture is not None:
        ctx.model.capture.layer_input(layer, hr)


@torch.library.custom_op("llmserve::island_all_reduce", mutates_args=("t",))
def island_all_reduce(t: torch.Tensor) -> None:
    ctx = _local.ctx
    if ctx.model is not None:  # every rank pads alike: the padding rows are summed too, harmlessly
        ctx.model.tp.all_reduce(t)


# --- what the traced twin calls instead of the eager ops ------------------------------------------------------------
# The twin's pool and KV stand-ins hold each layer's index where the eager forward holds its tensors: `states`,
# `key_cache` below are those indices.

def conv(x, weight, bias, states: int, slots, cu_seqlens, activation: str | None = "silu"):
    return torch.ops.llmserve.island_conv(x, weight, bias, states, activation)


def delta_rule(q, k, v, g, beta, states: int, slots, cu_seqlens, split=None):
    return torch.ops.llmserve.island_delta_rule(q, k, v, g, beta, states)


def ssd_scan(x, dt, a, b, c, d, states: int, slots, cu_seqlens, split=None):
    return torch.ops.llmserve.island_ssd_scan(x, dt, a, b, c, d, states)


def experts(x, weights, ids, gate_up, down):
    """In place of the model's experts_fn (moe.py): the routing stays in the graph, the experts' loop is eager."""
    return torch.ops.llmserve.island_experts(x, weights, ids, gate_up, down)


class Attention:
    """In place of the attention backend (kernels.reference / triton)."""

    def __init__(self, order: torch.Tensor):
        self.order = order

    def write_kv_cache(self, k, v, key_cache: int, value_cache: int, slot_mapping) -> None:
        torch.ops.llmserve.island_write_kv(k, v, self.order, key_cache)

    def paged_attention(self, q, key_cache: int, value_cache: int, block_tables, cu_seqlens_q, seq_lens,
                        scale: float, plan=None):
        return torch.ops.llmserve.island_attention(q, self.order, key_cache, scale)


class Capture:
    """In place of HiddenCapture: the layers a head reads go to the real capture, eagerly, from the real rows."""

    def __init__(self, order: torch.Tensor, aux_layers: tuple[int, ...]):
        self.order, self.aux_layers = order, aux_layers

    def layer_input(self, i: int, h: torch.Tensor) -> None:
        if i in self.aux_layers:
            torch.ops.llmserve.island_capture(h, self.order, i)


class Collectives:
    """In place of the rank group (decoder.Collectives): the all-reduce runs eagerly, in place."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def all_reduce(self, t: torch.Tensor) -> None:
        torch.ops.llmserve.island_all_reduce(t)
