"""The compiled forward (`-O1`..`-O3`) of a hybrid model (Qwen3-Next, Qwen3.5, Nemotron-H, Granite 4.0 hybrid).

What is compiled is the family's own layer loop (`_layers`) with the embedding, one inductor graph per step size, run
by a twin of the model (the same weights) whose dense ops are plain torch and whose recurrent ops, attention, MoE
experts, head capture and all-reduces are eager islands (eager_islands.py): custom ops the graph calls as opaque
nodes. So norms, projections, rope, gates, the MLP and the routing are fused by inductor, nothing of the layer's
math is restated here, and each island runs the model's own eager op. A step's token count is padded up to the next
size of the compilation config; an island sees only the real rows, so padding rows never write a state slot or the
KV cache, and every real row's recurrent and attention arithmetic is the eager forward's. The final norm and the
head run eagerly on the real rows (an MTP head reads their final normed states there). Steps above the largest size
run eager.

No CUDA graphs at any level: a replay would not run the islands' Python, which reads each step's slots and metadata.
The weights must be dense (not prepacked for the CPU, not quantized).
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from worker_svc.config import CompilationConfig
from worker_svc.model import eager_islands as islands
from worker_svc.model.inductor_cache import reserve_cache_entries, use_cache_dir
from worker_svc.model.layers.op import NATIVE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _NoMetadata:
    """The attention metadata the twin's layers are traced with: the islands read the step's own."""

    slot_mapping: None = None
    block_tables: None = None
    cu_seqlens_q: None = None
    seq_lens: None = None
    plan: None = None


@dataclass(frozen=True)
class _LayerIndices:
    """The state pool the twin's layers are traced with: `conv[j]` / `ssm[j]` is the state layer j itself."""

    conv: tuple[int, ...]
    ssm: tuple[int, ...]


@dataclass(frozen=True)
class _NoState:
    cache: _LayerIndices
    slots: None = None
    cu_seqlens: None = None
    split: None = None


class CompiledHybridForward:
    """HybridModel.forward's signature and results, run through a compiled graph at the configured step sizes."""

    def __init__(self, model: Any, cfg: CompilationConfig, cuda_graphs: bool = False):
        if model.prepacked or not all(isinstance(w, torch.Tensor) for w in (model.embed, model.lm_head)):
            raise ValueError("the compiled forward needs dense weights (no prepacked or quantized weights)")
        if cuda_graphs and model.device.type == "cuda":
            log.warning("-O2 and up on %s (a hybrid model): no CUDA graphs are replayed (the recurrent layers' "
                        "state reads run eagerly between the compiled parts); running the -O1 graphs",
                        model.config.architecture)
        self.model = model
        self.sizes = cfg.sizes()
        self.cache_dir = use_cache_dir(cfg.cache_dir)
        self._order = torch.zeros(1, device=model.device)  # the islands' order token (eager_islands.py)
        self._threads = torch.get_num_threads()
        self.twin = self._twin(model)
        num_kv, num_state = len(model.kv_index), len(model.state_index)
        self._kv = tuple((j, j) for j in range(num_kv))  # kv_cache[j] -> (K, V) of KV layer j: its index
        self._meta = _NoMetadata()
        self._state = _NoState(_LayerIndices(tuple(range(num_state)), tuple(range(num_state))))
        reserve_cache_entries(len(self.sizes))  # one graph per size (and per model of this process)
        self._graph = torch.compile(self._layers, dynamic=False, fullgraph=True)

    def _twin(self, model: Any) -> Any:
        """The model over plain-torch dense ops and eager islands (same weights)."""
        twin = copy.copy(model)
        twin.use_ops(NATIVE)
        twin.ops = dataclasses.replace(twin.ops, conv=islands.conv, delta_rule=islands.delta_rule,
                                       ssd_scan=islands.ssd_scan)
        twin.attention = islands.Attention(self._order)
        if hasattr(model, "experts_fn"):
            twin.experts_fn = islands.experts
        capture = model.capture
        twin.capture = None if capture is None or not capture.aux_layers else \
            islands.Capture(self._order, tuple(capture.aux_layers))
        if model.tp is not None:
            twin.tp = islands.Collectives(model.tp.rank, model.tp.size)
        return twin

    def padded_size(self, num_tokens: int) -> int | None:
        """The compiled size a step of `num_tokens` runs at, or None (eager)."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def warm_up(self) -> float:
        """Compile (or load from the cache) every size before the worker serves; returns the seconds taken."""
        t0 = time.perf_counter()
        for size in self.sizes:
            ids, positions = (torch.zeros(size, dtype=torch.int64, device=self.model.device) for _ in range(2))
            self._call(islands.StepContext(size), ids, positions)
        seconds = time.perf_counter() - t0
        log.info("compiled forward ready: sizes %s in %.1f s (cache %s; %s: recurrent ops, attention and experts "
                 "eager)", list(self.sizes), seconds, self.cache_dir, self.model.config.architecture)
        return seconds

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, attn_meta: Any,
                logits_indices: torch.Tensor, pool_indices: torch.Tensor | None = None, state: Any = None):
        n = input_ids.shape[0]
        size = self.padded_size(n)
        if size is None or state is None:  # the model names what is missing without a state
            return self.model.forward(input_ids, positions, kv_cache, attn_meta, logits_indices, pool_indices,
                                      state=state)
        if size > n:  # padding rows: token 0 at position 0, which no island sees
            input_ids, positions = F.pad(input_ids, (0, size - n)), F.pad(positions, (0, size - n))
        h = self._call(islands.StepContext(n, self.model, kv_cache, attn_meta, state), input_ids, positions)
        return self.model.head(h[:n], logits_indices, pool_indices)

    @torch.inference_mode()
    def _call(self, ctx: islands.StepContext, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # On the thread count the graphs were built for: inductor's CPU code is made for one, and dynamo would
        # compile anew for another (the runner runs small CPU steps on one thread fewer at times, cpu/threads.py).
        # Inference tensors both: the graphs guard on the inputs' dispatch keys (a step padded here makes them in
        # inference mode, one at a compiled size arrives from the runner as it built it).
        input_ids, positions = (x if x.is_inference() else x.clone() for x in (input_ids, positions))
        threads = torch.get_num_threads()
        if threads != self._threads:
            torch.set_num_threads(self._threads)
        try:
            with islands.running(ctx):
                return self._graph(input_ids, positions)
        finally:
            if threads != self._threads:
                torch.set_num_threads(threads)

    def _layers(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What the graph holds: the twin's embedding and layers (HybridModel.forward up to the head)."""
        t = self.twin
        h = t._layers(t.embed_tokens(input_ids), positions, self._kv, self._meta, self._state)
        if t.capture is not None:  # an EAGLE-3 head may read the last layer's output
            t.capture.layer_input(t.config.num_layers, h)
        return h

    def __getattr__(self, name: str):  # the model's other attributes (config, state_shape, kv_cache_shape, ...)
        return getattr(self.model, name)

    __call__ = forward
