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
`StepContext`, registered under the compiled model's key for the duration of one graph call: the graph passes only
the key and the layer index, both constants of the trace. The KV write and the capture return nothing; each
"mutates" the step's order token, which the attention island reads, so the graph keeps them and keeps their order.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

_CONTEXTS: dict[int, StepContext] = {}  # compiled model key -> the step its graph is running
_KEYS = itertools.count()


@dataclass
class StepContext:
    """One graph call's eager side. `model` None: the warm-up, where every island returns zeros."""

    num_real: int
    model: Any = None  # the HybridModel whose eager ops run
    kv_cache: torch.Tensor | None = None
    attn_meta: Any = None
    state: Any = None  # state_cache.StateStep


def new_key() -> int:
    return next(_KEYS)


def enter(key: int, ctx: StepContext) -> None:
    _CONTEXTS[key] = ctx


def leave(key: int) -> None:
    _CONTEXTS.pop(key, None)


def _real(key: int, *xs: torch.Tensor) -> tuple[StepContext, list[torch.Tensor]]:
    ctx = _CONTEXTS[key]
    return ctx, [x[: ctx.num_real] for x in xs]


def _padded(y: torch.Tensor, rows: int) -> torch.Tensor:
    return y if y.shape[0] == rows else F.pad(y, (0, 0) * (y.dim() - 1) + (0, rows - y.shape[0]))


# --- the custom ops -------------------------------------------------------------------------------------------------

@torch.library.custom_op("llmserve::island_conv", mutates_args=())
def island_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: int, layer: int,
                activation: str | None) -> torch.Tensor:
    ctx, (xr,) = _real(key, x)
    if ctx.model is None:
        return torch.zeros_like(x, memory_format=torch.contiguous_format)
    s = ctx.state
    y = ctx.model.ops.conv(xr, weight, bias, s.cache.conv[layer], s.slots, s.cu_seqlens, activation)
    return _padded(y, x.shape[0])


@island_conv.register_fake
def _(x, weight, bias, key, layer, activation):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("llmserve::island_delta_rule", mutates_args=())
def island_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      key: int, layer: int) -> torch.Tensor:
    ctx, real = _real(key, q, k, v, g, beta)
    if ctx.model is None:
        return v.new_zeros(v.shape, dtype=torch.float32)
    s = ctx.state
    return _padded(ctx.model.ops.delta_rule(*real, s.cache.ssm[layer], s.slots, s.cu_seqlens, s.split), v.shape[0])


@island_delta_rule.register_fake
def _(q, k, v, g, beta, key, layer):
    return v.new_empty(v.shape, dtype=torch.float32)


@torch.library.custom_op("llmserve::island_ssd_scan", mutates_args=())
def island_ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                    d: torch.Tensor, key: int, layer: int) -> torch.Tensor:
    ctx, (xr, dtr, br, cr) = _real(key, x, dt, b, c)
    if ctx.model is None:
        return x.new_zeros(x.shape, dtype=torch.float32)
    s = ctx.state
    y = ctx.model.ops.ssd_scan(xr, dtr, a, br, cr, d, s.cache.ssm[layer], s.slots, s.cu_seqlens, s.split)
    return _padded(y, x.shape[0])


@island_ssd_scan.register_fake
def _(x, dt, a, b, c, d, key, layer):
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("llmserve::island_write_kv", mutates_args=("order",))
def island_write_kv(k: torch.Tensor, v: torch.Tensor, order: torch.Tensor, key: int, layer: int) -> None:
    ctx, (kr, vr) = _real(key, k, v)
    if ctx.model is not None:
        kv = ctx.kv_cache[layer]
        ctx.model.attention.write_kv_cache(kr, vr, kv[0], kv[1], ctx.attn_meta.slot_mapping)


@torch.library.custom_op("llmserve::island_attention", mutates_args=())
def island_attention(q: torch.Tensor, order: torch.Tensor, key: int, layer: int, scale: float) -> torch.Tensor:
    ctx, (qr,) = _real(key, q)
    if ctx.model is None:
        return torch.zeros_like(q, memory_format=torch.contiguous_format)
    kv, m = ctx.kv_cache[layer], ctx.attn_meta
    o = ctx.model.attention.paged_attention(qr.contiguous(), kv[0], kv[1], m.block_tables, m.cu_seqlens_q,
                                            m.seq_lens, scale, plan=m.plan)
    return _padded(o, q.shape[0])


@island_attention.register_fake
def _(q, order, key, layer, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("llmserve::island_experts", mutates_args=())
def island_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, key: int) -> torch.Tensor:
    ctx, real = _real(key, x, weights, ids)
    if ctx.model is None:
        return torch.zeros_like(x, memory_format=torch.contiguous_format)
    return _padded(ctx.model.experts_fn(*real, gate_up, down), x.shape[0])


@island_experts.register_fake
def _(x, weights, ids, gate_up, down, key):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("llmserve::island_capture", mutates_args=("order",))
def island_capture(h: torch.Tensor, order: torch.Tensor, key: int, layer: int) -> None:
    ctx, (hr,) = _real(key, h)
    if ctx.model is not None and ctx.model.capture is not None:
        ctx.model.capture.layer_input(layer, hr)


@torch.library.custom_op("llmserve::island_all_reduce", mutates_args=("t",))
def island_all_reduce(t: torch.Tensor, key: int) -> None:
    ctx = _CONTEXTS[key]
    if ctx.model is not None:  # every rank pads alike: the padding rows are summed too, harmlessly
        ctx.model.tp.all_reduce(t)


# --- what the traced twin calls instead of the eager ops ------------------------------------------------------------

class Conv:
    """In place of HybridOps.conv: `states` is the state layer's index (the twin's pool stand-in holds indices)."""

    def __init__(self, key: int):
        self.key = key

    def __call__(self, x, weight, bias, states: int, slots, cu_seqlens, activation: str | None = "silu"):
        return torch.ops.llmserve.island_conv(x, weight, bias, self.key, states, activation)


class DeltaRule:
    def __init__(self, key: int):
        self.key = key

    def __call__(self, q, k, v, g, beta, states: int, slots, cu_seqlens, split=None):
        return torch.ops.llmserve.island_delta_rule(q, k, v, g, beta, self.key, states)


class SSDScan:
    def __init__(self, key: int):
        self.key = key

    def __call__(self, x, dt, a, b, c, d, states: int, slots, cu_seqlens, split=None):
        return torch.ops.llmserve.island_ssd_scan(x, dt, a, b, c, d, self.key, states)


class Attention:
    """In place of the attention backend (kernels.reference / triton): the key / value caches are the KV layer's
    index (the twin's KV stand-in holds indices)."""

    def __init__(self, key: int, order: torch.Tensor):
        self.key, self.order = key, order

    def write_kv_cache(self, k, v, key_cache: int, value_cache: int, slot_mapping) -> None:
        torch.ops.llmserve.island_write_kv(k, v, self.order, self.key, key_cache)

    def paged_attention(self, q, key_cache: int, value_cache: int, block_tables, cu_seqlens_q, seq_lens,
                        scale: float, plan=None):
        return torch.ops.llmserve.island_attention(q, self.order, self.key, key_cache, scale)


class Experts:
    """In place of the model's experts_fn (moe.py): the routing stays in the graph, the experts' loop is eager."""

    def __init__(self, key: int):
        self.key = key

    def __call__(self, x, weights, ids, gate_up, down):
        if not isinstance(gate_up, torch.Tensor):
            raise ValueError("the compiled forward needs the experts' stacked weights (not prepacked per expert)")
        return torch.ops.llmserve.island_experts(x, weights, ids, gate_up, down, self.key)


class Capture:
    """In place of HiddenCapture: the layers a head reads go to the real capture, eagerly, from the real rows."""

    def __init__(self, key: int, order: torch.Tensor, aux_layers: tuple[int, ...]):
        self.key, self.order, self.aux_layers = key, order, aux_layers

    def layer_input(self, i: int, h: torch.Tensor) -> None:
        if i in self.aux_layers:
            torch.ops.llmserve.island_capture(h, self.order, self.key, i)


class Collectives:
    """In place of the rank group (decoder.Collectives): the all-reduce runs eagerly, in place."""

    def __init__(self, key: int, rank: int, size: int):
        self.key, self.rank, self.size = key, rank, size

    def all_reduce(self, t: torch.Tensor) -> None:
        torch.ops.llmserve.island_all_reduce(t, self.key)
