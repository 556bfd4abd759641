"""LoRA adapters on the worker: PEFT directories read and checked against the model, a host cache of loaded
adapters (--max-cpu-loras, LRU) and a fixed device pool of --max-loras slots (LRU among the adapters no request in
the batch uses), and the per-step delta every projection adds to its base output.

The model calls one hook per projection (`LoraPool.add(layer, group, x, y)`): y += scale * (x @ A.T) @ B.T, with
A and B of the adapter in each token row's slot. q, k and v share one fused matmul, so they share one group:
A_qkv stacks the three A's ([3R, hidden]) and B_qkv is block-diagonal ([q+k+v out, 3R]), one shrink and one expand
for the three. The scale is folded into B when an adapter enters the pool. A token row without an adapter has
slot -1 and gets nothing added. The delta is computed from x, so it works over dense, prepacked and quantized base
weights alike.

Under tensor parallelism an adapter is sharded like its base layer: q/k/v, gate and up are column-parallel (the
rank's B rows, A whole), o and down row-parallel (the rank's A columns, B whole; each rank adds its partial delta
before the layer's all-reduce, so the sum over ranks is the whole delta); a hybrid's own cuts (Qwen's gated
q_proj per head, Granite's fused [gate | up] by both halves) are its base weights' (lora_targets.lora_cut). Rank 0
decides slots and token rows and sends them with each step (`sync_message`, `follow`); the other ranks read the
adapters themselves. Which modules a family serves, and in which layers: lora_targets.py.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from common.lora import parse_lora_modules
from common.validation import ConfigError
from worker_svc.config import WorkerConfig
from worker_svc.core.errors import InvalidPlan
from worker_svc.core.plan import StepPlan
from worker_svc.model.config import ModelConfig
from worker_svc.model.lora_targets import KEY, check_tensor, lora_cut, lora_layout, served
from worker_svc.parallel.sharding import FULL, Shard, local_config

GROUPS = ("qkv", "o", "gate", "up", "down")  # a Llama-shaped model's; lora_targets.py has every family's
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class LoraError(ValueError):
    """An adapter that cannot be served: the message names the file and the module at fault."""


@dataclass
class LoraAdapter:
    """A PEFT adapter in host memory: per (layer, PEFT module) its A [r, in] and B [out, r], float32."""

    name: str
    path: str
    rank: int
    scaling: float  # lora_alpha / r (rslora: lora_alpha / sqrt(r))
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each PEFT target module of `cfg`."""
    return {m: (t.fan_in, t.fan_out) for m, t in lora_layout(cfg).targets.items()}


def load_peft_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check a PEFT directory against the model; LoraError naming the file and the module."""
    config_file, weights_file = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    try:
        with open(config_file) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LoraError(f"adapter {name!r}: cannot read {config_file}: {e}") from None
    rank, alpha = int(meta.get("r", 0)), float(meta.get("lora_alpha", meta.get("r", 0)))
    if rank < 1:
        raise LoraError(f"adapter {name!r}: {config_file}: r must be >= 1, got {meta.get('r')!r}")
    if rank > max_rank:
        raise LoraError(f"adapter {name!r}: {config_file}: r={rank} exceeds --max-lora-rank {max_rank}")
    targets = meta.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    layout = lora_layout(cfg)
    for t in targets:
        if t in layout.refused:  # e.g. a recurrent layer's in_proj: named before any weight is read
            raise LoraError(f"adapter {name!r}: {config_file}: target module {t!r} is {layout.refused[t]} of "
                            f"{cfg.architecture}; adapters are served on {served(layout)} only")
        if t not in layout.targets:
            raise LoraError(f"adapter {name!r}: {config_file}: target module {t!r} is not supported "
                            f"(supported: {served(layout)})")
    if meta.get("modules_to_save"):
        raise LoraError(f"adapter {name!r}: {config_file}: modules_to_save {meta['modules_to_save']!r} is not "
                        "supported (only low-rank deltas of the projections)")
    if meta.get("bias", "none") != "none":
        raise LoraError(f"adapter {name!r}: {config_file}: bias {meta['bias']!r} is not supported (only 'none')")
    scaling = alpha / math.sqrt(rank) if meta.get("use_rslora") else alpha / rank
    try:
        from safetensors.torch import load_file

        tensors = load_file(weights_file)
    except (OSError, RuntimeError, ValueError) as e:
        raise LoraError(f"adapter {name!r}: cannot read {weights_file}: {e}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = KEY.search(key)
        if m is None:
            raise LoraError(f"adapter {name!r}: {weights_file}: tensor {key!r} is not a LoRA A/B of a supported "
                            f"module ({served(layout)})")
        layer, path, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if layer >= cfg.num_layers:
            raise LoraError(f"adapter {name!r}: {weights_file}: {key!r} is for layer {layer}; the model has "
                            f"{cfg.num_layers}")
        if (why := check_tensor(layout, layer, path, module)) is not None:
            raise LoraError(f"adapter {name!r}: {weights_file}: tensor {key!r}: {why}")
        fan_in, fan_out = layout.targets[module].fan_in, layout.targets[module].fan_out
        want = (rank, fan_in) if ab == "A" else (fan_out, rank)
        if tuple(t.shape) != want:
            raise LoraError(f"adapter {name!r}: {weights_file}: {key!r} ({module}, layer {layer}) has shape "
                            f"{list(t.shape)}; the model needs {list(want)} (r={rank})")
        halves.setdefault((layer, module), {})[ab] = t.float()
    weights = {}
    for (layer, module), d in halves.items():
        if len(d) != 2:
            raise LoraError(f"adapter {name!r}: {weights_file}: layer {layer} {module} has lora_"
                            f"{next(iter(d))} without lora_{'B' if 'A' in d else 'A'}")
        weights[(layer, module)] = (d["A"], d["B"])
    if not weights:
        raise LoraError(f"adapter {name!r}: {weights_file} holds no LoRA weights")
    return LoraAdapter(name, path, rank, scaling, weights)


class LoraPool:
    """Adapters on the device, in `max_loras` slots, and the slot of each batch row.

    Per group g the pool holds A_g [L_g, S, R_g, in_g] and B_g [L_g, S, out_g, R_g] (L_g: the layers that have the
    group, lora_targets.py; R_g = max_rank, 3 x for qkv), zero where an adapter has no weights (a smaller rank, a
    module it does not target). `cfg` is the whole model's (adapters are checked against it); in and out are this
    rank's (`shard`)."""

    def __init__(self, cfg: ModelConfig, *, max_loras: int, max_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device, shard: Shard = FULL):
        self.cfg, self.max_loras, self.max_rank, self.shard = cfg, max_loras, max_rank, shard
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.device, self.dtype = device, dtype
        local = lora_layout(local_config(cfg, shard.size))
        self.layout, self.qkv_offsets = lora_layout(cfg), local.qkv_offsets()
        groups = local.groups()
        # group -> {model layer: its row in A_g / B_g}; a hybrid's recurrent layers have no rows
        self.rows = {g: {layer: j for j, layer in enumerate(layers)} for g, (layers, *_) in groups.items()}
        S = max_loras
        self.a = {g: torch.zeros(len(ls), S, k * max_rank, i, dtype=dtype, device=device)
                  for g, (ls, i, o, k) in groups.items()}
        self.b = {g: torch.zeros(len(ls), S, o, k * max_rank, dtype=dtype, device=device)
                  for g, (ls, i, o, k) in groups.items()}
        self.host: OrderedDict[str, LoraAdapter] = OrderedDict()  # LRU: the last is the most recent
        # Adapters on the device, LRU, by (name, directory): a name loaded again from another directory while
        # requests still run with the old weights gets a slot of its own.
        self.slot_of: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.row_slot = np.full(64, -1, dtype=np.int64)  # batch row -> pool slot (-1: base model)
        # This step on CPU: `whole`, the one slot every token uses, or `stack`, the adapters' token rows padded
        # to one [U, M] grid (slots or None = all in order, flat rows, [U, M, 1] mask of the real ones).
        self.whole: int | None = None
        self.stack: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None = None
        self.token_slots: torch.Tensor | None = None  # this step, for the CUDA kernels
        self.step_slots = np.zeros(0, np.int64)  # this step's token slots (empty: no adapter), for the other ranks
        self.written: list[tuple[int, str, str]] = []  # (slot, name, path) not yet sent to the other ranks

    # -- adapters --------------------------------------------------------------------------------------------

    def load(self, name: str, path: str) -> LoraAdapter:
        """The adapter in host memory (read and checked on first use); LoraError when it cannot be served."""
        a = self.host.get(name)
        if a is not None and a.path == path:
            self.host.move_to_end(name)
            return a
        a = load_peft_adapter(name, path, self.cfg, self.max_rank)
        self.host[name] = a
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return a

    def forget(self, name: str) -> None:
        """Drop an unloaded adapter from host memory; its device slot is reused when needed."""
        self.host.pop(name, None)

    def activate(self, name: str, path: str, pinned: set[int]) -> int:
        """The adapter's device slot, writing it into the least recently used slot outside `pinned` (the slots
        live rows use) when it is not on the device. LoraError when every slot is pinned."""
        key = (name, path)
        slot = self.slot_of.get(key)
        if slot is not None:  # on the device already (even if gone from the host cache)
            self.slot_of.move_to_end(key)
            return slot
        adapter = self.load(name, path)
        used = set(self.slot_of.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next((k for k, s in self.slot_of.items() if s not in pinned), None)
            if victim is None:
                raise LoraError(f"adapter {name!r}: all --max-loras {self.max_loras} slots hold adapters of "
                                "requests in the batch")
            slot = self.slot_of.pop(victim)
        self._place(slot, key, adapter)
        if self.shard.size > 1:
            self.written.append((slot, name, path))
        return slot

    def _place(self, slot: int, key: tuple[str, str], adapter: LoraAdapter) -> None:
        for k in [k for k, s in self.slot_of.items() if s == slot]:
            del self.slot_of[k]
        self._write(slot, adapter)
        self.slot_of[key] = slot

    def _write(self, slot: int, a: LoraAdapter) -> None:
        for g in self.a:
            self.a[g][:, slot].zero_()
            self.b[g][:, slot].zero_()
        r, R = a.rank, self.max_rank
        for (layer, module), (A, B) in a.weights.items():
            t = self.layout.targets[module]
            cut = lora_cut(self.layout.weight_name(layer, module), self.cfg, self.shard)
            if cut is not None:  # W = B @ A: the rank's output rows are B's rows, its input columns A's columns
                parts = [B[s:e] if cut.dim == 0 else A[:, s:e] for s, e in cut.ranges]
                A, B = (A, torch.cat(parts)) if cut.dim == 0 else (torch.cat(parts, dim=1), B)
            A = A.to(self.device, self.dtype)
            B = (B * a.scaling).to(self.device, self.dtype)
            row, k = self.rows[t.group][layer], t.index
            if t.group == "qkv":
                start = self.qkv_offsets[k]
                self.a["qkv"][row, slot, k * R : k * R + r] = A
                self.b["qkv"][row, slot, start : start + B.shape[0], k * R : k * R + r] = B
            else:
                self.a[t.group][row, slot, :r] = A
                self.b[t.group][row, slot, :, :r] = B

    # -- rows and steps --------------------------------------------------------------------------------------

    def set_rows(self, rows: np.ndarray, slots: np.ndarray) -> None:
        if len(rows) and rows.max() >= len(self.row_slot):
            grown = np.full(max(int(rows.max()) + 1, 2 * len(self.row_slot)), -1, dtype=np.int64)
            grown[: len(self.row_slot)] = self.row_slot
            self.row_slot = grown
        self.row_slot[rows] = slots

    def slots_of_rows(self, live: np.ndarray) -> set[int]:
        """The pool slots the rows marked in `live` use."""
        n = min(len(live), len(self.row_slot))
        s = self.row_slot[:n][live[:n]]
        return set(s[s >= 0].tolist())

    def begin_step(self, rows: np.ndarray, lengths: np.ndarray) -> None:
        """The step's token rows: chunk i (batch row rows[i]) has lengths[i] tokens, laid end to end. Groups the
        tokens by adapter once for all layers (array operations; no loop over requests)."""
        slots = self.row_slot[rows] if len(rows) else np.zeros(0, np.int64)
        self.begin_tokens(np.repeat(slots, lengths) if (slots >= 0).any() else np.zeros(0, np.int64))

    def begin_tokens(self, token_slots: np.ndarray) -> None:
        """The step's pool slot of each token row (-1: base; empty: no row uses an adapter)."""
        self.whole, self.stack, self.token_slots = None, None, None
        self.step_slots = token_slots
        if not len(token_slots):
            return
        if self.device.type == "cuda":
            self.token_slots = torch.from_numpy(token_slots).to(self.device)
            return
        order = np.argsort(token_slots, kind="stable")
        cut = np.searchsorted(token_slots[order], -1, side="right")  # leading -1s: base rows
        rows, slots = order[cut:], token_slots[order[cut:]]  # the adapters' token rows, grouped by slot
        used, starts, counts = np.unique(slots, return_index=True, return_counts=True)
        if len(used) == 1 and cut == 0:
            self.whole = int(used[0])  # every token uses one adapter: no gather
            return
        # Each adapter's rows in one row of a [U, M] grid: one gather, two bmm and one scatter per projection
        # whatever the mix. Padding cells point at row 0 and are masked after the shrink: their delta is zero.
        group = np.repeat(np.arange(len(used)), counts)
        grid = np.zeros((len(used), int(counts.max())), dtype=np.int64)
        mask = np.zeros(grid.shape, dtype=np.float32)
        at = (group, np.arange(len(rows)) - starts[group])
        grid[at], mask[at] = rows, 1.0
        every = len(used) == self.max_loras  # used is sorted: then the pool's own slot order
        self.stack = (None if every else torch.from_numpy(used), torch.from_numpy(grid.reshape(-1)),
                      torch.from_numpy(mask).to(self.dtype).unsqueeze(-1))

    # -- the other tensor-parallel ranks ---------------------------------------------------------------------

    def sync_message(self) -> tuple[np.ndarray, np.ndarray]:
        """Rank 0, once per step message: (this step's token slots, the adapters written into slots since the last
        message as int64 words: slot, name length, path length, then the UTF-8 bytes of both)."""
        words = []
        for slot, name, path in self.written:
            n, p = name.encode(), path.encode()
            words += [slot, len(n), len(p), *n, *p]
        self.written = []
        return self.step_slots, np.array(words, dtype=np.int64)

    def follow(self, token_slots: np.ndarray, written: np.ndarray) -> None:
        """Another rank: put rank 0's newly written adapters into the same slots (this rank's shard of them; rank 0
        checked them), then take the step's token slots."""
        i, w = 0, written.tolist()
        while i < len(w):
            slot, n, p = w[i : i + 3]
            raw = bytes(w[i + 3 : i + 3 + n + p])
            name, path = raw[:n].decode(), raw[n:].decode()
            self._place(slot, (name, path), self.load(name, path))
            i += 3 + n + p
        self.begin_tokens(token_slots)

    def add(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += the LoRA delta of projection `group` of `layer` for each token row of x (in place); nothing where
        the layer has no such projection (a hybrid's recurrent layer)."""
        row = self.rows[group].get(layer)
        if row is None:
            return
        a, b = self.a[group][row], self.b[group][row]
        if self.token_slots is not None:
            from kernels.lora_triton import lora_expand, lora_shrink

            lora_expand(lora_shrink(x, a, self.token_slots), b, self.token_slots, y)
            return
        if self.whole is not None:
            y.addmm_(x @ a[self.whole].T, b[self.whole].T)  # the expand adds in place: no [T, out] temporary
        elif self.stack is not None:
            slots, rows, mask = self.stack
            if slots is not None:
                a, b = a.index_select(0, slots), b.index_select(0, slots)
            xs = x.index_select(0, rows).view(*mask.shape[:2], -1)  # [U, M, in]
            s = torch.bmm(xs, a.transpose(1, 2)).mul_(mask)  # [U, M, R]: padding cells' shrink zeroed
            d = torch.bmm(s, b.transpose(1, 2))  # [U, M, out]
            y.index_add_(0, rows, d.view(len(rows), -1))


def join_plan(pool: LoraPool | None, plan: StepPlan, live: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Put the adapters of the plan's joining requests on the device (before the plan is applied: a refusal changes
    no request); returns their rows and pool slots (-1: base) for `LoraPool.set_rows`. InvalidPlan naming the
    request when its adapter cannot be served."""
    joining = plan.new_requests + plan.resumed_requests
    rows = np.array([r.slot for r in joining], dtype=np.int64)
    slots = np.full(len(joining), -1, dtype=np.int64)
    if not any(r.lora_name for r in joining):
        return rows, slots
    if pool is None:
        r = next(r for r in joining if r.lora_name)
        raise InvalidPlan(f"request {r.request_id!r} asks for LoRA adapter {r.lora_name!r}; this worker runs "
                          "without --enable-lora", slot=r.slot, request_id=r.request_id)
    if not plan.reset_batch:
        live = live.copy()
        dropped = plan.dropped_slots[plan.dropped_slots < len(live)]
        live[dropped] = False
    pinned = set() if plan.reset_batch else pool.slots_of_rows(live)
    for i, r in enumerate(joining):
        if r.lora_name:
            try:
                slots[i] = pool.activate(r.lora_name, r.lora_path, pinned)
            except LoraError as e:
                raise InvalidPlan(str(e), slot=r.slot, request_id=r.request_id) from None
            pinned.add(int(slots[i]))
    return rows, slots


def build_pool(opts: WorkerConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               shard: Shard = FULL) -> LoraPool | None:
    """The device pool for --enable-lora (None without), with --lora-modules read and checked: ConfigError naming
    the file and the module of the first adapter that cannot be served."""
    if not opts.enable_lora:
        if opts.lora_modules:
            raise ConfigError("--lora-modules needs --enable-lora")
        return None
    pool = LoraPool(cfg, max_loras=opts.max_loras, max_rank=opts.max_lora_rank,
                    max_cpu_loras=opts.max_cpu_loras or opts.max_loras, dtype=dtype, device=device, shard=shard)
    try:
        for name, path in parse_lora_modules(opts.lora_modules):
            pool.load(name, path)
    except ValueError as e:  # LoraError included
        raise ConfigError(str(e)) from None
    return pool
