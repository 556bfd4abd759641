"""The compiled forward (`-O1`..`-O3`): torch.compile (inductor) of each decoder layer's dense parts.

What is compiled is the model's own layer code (LlamaModel.attention_inputs / post_attention), run by a twin of the
model whose layer ops are plain torch (`LlamaModel.traced`): nothing of the layer's math is restated here.
Paged attention stays eager between the compiled parts: its metadata (the CPU backend's plan, block tables of
every length) is Python data a graph cannot hold. Per layer two compiled functions run: norm + qkv + rope, and
o-proj + residual + norm + MLP; every layer calls the same two graphs (shapes match), so a step size costs two
compiles for the whole model. A tensor-parallel rank compiles the o-proj and the MLP apart, each a partial product
(plus the residual on rank 0), with the all-reduces between the graphs, as the eager forward does. A step's token
count is padded up to the next size of the compilation config; only the compiled parts see the padding rows:
attention and the KV write get the real rows alone, so padding never touches the KV cache and every real row's
arithmetic is per row. Steps above the largest size run eager.

Inductor's CPU kernels are built for one thread count, and dynamo guards on `torch.get_num_threads()`: a step run on
another count would compile anew while serving. The runner runs small CPU steps on one thread fewer when that has
been faster (cpu/threads.py), so the sizes such steps pad to are compiled at warm-up for both counts, and the chooser
keeps its gain here (the eager path pins nothing either); a step on any other count runs pinned to the warm-up's.

The weights must be dense (not packed for the CPU, panels or oneDNN's copy, which inductor cannot trace,
and not quantized).
"""

from __future__ import annotations

import bisect
import logging
import time

import torch
import torch.nn.functional as F

from common.validation import ConfigError
from worker_svc.config import CompilationConfig, WorkerConfig
from worker_svc.cpu.threads import SMALL_STEP_TOKENS
from worker_svc.model.compiled_hybrid import CompiledHybridForward
from worker_svc.model.decoder import LlamaModel
from worker_svc.model.inductor_cache import reserve_cache_entries, use_cache_dir

log = logging.getLogger(__name__)


def wants_compiled(opts: WorkerConfig) -> bool:
    """Whether `opts` (device defaults filled in) asks for the compiled forward; ConfigError for a combination it
    does not run."""
    level = opts.optimization_level or 0
    if level == 0:
        return False
    if opts.enforce_eager:
        log.warning("--enforce-eager: running the eager forward, not -O%d", level)
        return False
    if opts.enable_lora:  # the LoRA hook groups tokens by adapter in Python: inductor cannot trace it
        raise ConfigError(f"--optimization-level {level} does not run with --enable-lora; use -O0 with "
                          "--enable-lora, or drop --enable-lora")
    if opts.quantization:
        raise ConfigError(f"--optimization-level {level} runs dense weights only; drop --quantization "
                          f"{opts.quantization} or use -O0")
    return True


def compile_model(model: LlamaModel, opts: WorkerConfig):
    """The compiled forward of `model` (built with prepack=False), every size compiled before it returns: a hybrid
    model's is compiled_hybrid.py's."""
    cfg, cuda_graphs = CompilationConfig.parse(opts.compilation_config), (opts.optimization_level or 0) >= 2
    if getattr(model, "hybrid", False):
        compiled = CompiledHybridForward(model, cfg, cuda_graphs)
    else:
        compiled = CompiledForward(model, cfg, cuda_graphs)
    compiled.warm_up()
    return compiled


class CompiledForward:
    """`LlamaModel.forward`'s signature and results, run through compiled graphs at the configured step sizes."""

    def __init__(self, model: LlamaModel, cfg: CompilationConfig, cuda_graphs: bool = False):
        if model.prepacked or not all(isinstance(w, torch.Tensor) for w in (model.layers[0].qkv, model.lm_head)):
            raise ValueError("the compiled forward needs dense weights (no prepacked or quantized weights)")
        # The compiled pieces are LlamaModel's layer (with Qwen3's q/k norm and the per-layer attention keyword
        # arguments: windows, soft-capping); a family that overrides the layer or the MLP is refused.
        if not model.runs_llama_layers():
            raise ValueError(f"the compiled forward runs the Llama-shaped decoder only, not "
                             f"{model.config.architecture}; use -O0")
        self.model = model
        traced = model.traced()  # the same weights and layer code, over the plain-torch ops
        self.sizes = cfg.sizes()
        self.cache_dir = use_cache_dir(cfg.cache_dir)
        self._threads = torch.get_num_threads()
        # The runner's small-step choice runs on the CPU and without tensor parallelism (core/runner.py _forward).
        chooses = model.device.type == "cpu" and model.tp is None and self._threads > 1
        small = self.padded_size(SMALL_STEP_TOKENS - 1) or self.sizes[-1]
        self._fewer = frozenset(s for s in self.sizes if s <= small) if chooses else frozenset()
        # One graph per size, function and thread count (with CUDA graphs, per mode).
        reserve_cache_entries(2 * (len(self.sizes) + len(self._fewer)))
        self._rope = traced.rotaries[0].prepare  # the step's cos / sin rows, gathered eagerly
        self._qkv_rope = torch.compile(traced.attention_inputs, dynamic=False, fullgraph=True)
        self._o_mlp = torch.compile(traced.post_attention, dynamic=False, fullgraph=True)
        if model.tp is not None:  # one compile per size and function too (the rank is fixed), all-reduces between
            self._o_part = torch.compile(traced.attention_output, dynamic=False, fullgraph=True)
            self._mlp_part = torch.compile(traced.mlp, dynamic=False, fullgraph=True)
        self._graphs: tuple | None = None
        if cuda_graphs and model.device.type == "cuda" and model.tp is not None:
            log.warning("-O2 and up: a tensor-parallel rank replays no CUDA graphs (its all-reduces run between "
                        "the compiled parts)")
        elif cuda_graphs and model.device.type == "cuda":
            # Decode-only steps replay CUDA graphs (torch's cudagraph trees). Untested: no GPU where this was
            # written. The weights are marked static so a replay reads them in place instead of copying them.
            for layer in model.layers:
                for t in (layer.input_norm, layer.qkv, layer.qkv_bias, layer.qk_norm, layer.o, layer.o_bias,
                          layer.post_norm, layer.gate, layer.up, layer.down):
                    if t is not None:
                        torch._dynamo.mark_static_address(t, guard=False)
            self._graphs = tuple(torch.compile(fn, mode="reduce-overhead", dynamic=False, fullgraph=True)
                                 for fn in (traced.attention_inputs, traced.post_attention))

    def padded_size(self, num_tokens: int) -> int | None:
        """The compiled size a step of `num_tokens` runs at, or None (eager)."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def warm_up(self) -> float:
        """Compile (or load from the cache) every size before the worker serves; returns the seconds taken."""
        t0 = time.perf_counter()
        m = self.model
        for size in self.sizes:
            ids = torch.zeros(size, dtype=torch.int64, device=m.device)
            self._layers(ids, ids, None, None, size, decode_only=False)
            if size in self._fewer:
                torch.set_num_threads(self._threads - 1)
                try:
                    self._layers(ids, ids, None, None, size, decode_only=False)
                finally:
                    torch.set_num_threads(self._threads)
            if self._graphs is not None:
                for _ in range(3):  # cudagraph trees record on the third call
                    self._layers(ids, ids, None, None, size, decode_only=True)
        seconds = time.perf_counter() - t0
        log.info("compiled forward ready: sizes %s in %.1f s (cache %s; sizes up to %s also on %d threads)",
                 list(self.sizes), seconds, self.cache_dir, max(self._fewer, default=None), self._threads - 1)
        return seconds

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, attn_meta,
                logits_indices: torch.Tensor, pool_indices: torch.Tensor | None = None) -> torch.Tensor:
        n = input_ids.shape[0]
        size = self.padded_size(n)
        if size is None:
            return self.model.forward(input_ids, positions, kv_cache, attn_meta, logits_indices, pool_indices)
        if size > n:  # padding rows: token 0 at position 0, dropped before attention
            input_ids, positions = F.pad(input_ids, (0, size - n)), F.pad(positions, (0, size - n))
        decode_only = self._graphs is not None and len(attn_meta.seq_lens) == n
        threads = torch.get_num_threads()
        compiled_for = threads == self._threads or (threads == self._threads - 1 and size in self._fewer)
        if not compiled_for:  # a count no graph was built for: the warm-up's, not a compile while serving
            torch.set_num_threads(self._threads)
        try:
            h = self._layers(input_ids, positions, kv_cache, attn_meta, n, decode_only)
        finally:
            if not compiled_for:
                torch.set_num_threads(threads)
        return self.model.head(h, logits_indices, pool_indices)

    @torch.inference_mode()
    def _layers(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor | None, attn_meta,
                n: int, decode_only: bool) -> torch.Tensor:
        """The decoder layers over padded rows, of which the first `n` are real (kv_cache None: warm-up, the
        attention output stands in as zeros)."""
        m = self.model
        qkv_rope, o_mlp = self._graphs if decode_only else (self._qkv_rope, self._o_mlp)
        size = input_ids.shape[0]
        rope = self._rope(positions)
        h = m.embed_tokens(input_ids)
        capture = m.capture if kv_cache is not None else None  # an EAGLE-3 head reads the real rows' layer inputs
        for i, layer in enumerate(m.layers):
            if capture is not None:
                capture.layer_input(i, h[:n])
            qk, v = qkv_rope(i, layer, h, rope)
            if kv_cache is None:
                o = torch.zeros(size, m.q_size, dtype=h.dtype, device=h.device)
            else:
                o = F.pad(m.paged_attention(i, qk[:n], v[:n], kv_cache, attn_meta), (0, 0, 0, size - n))
            if m.tp is None:
                h = o_mlp(i, layer, o, h)
                continue
            h = m.reduce(self._o_part(i, layer, o, h))
            h = m.reduce(self._mlp_part(i, layer, h))
        if capture is not None:
            capture.layer_input(len(m.layers), h[:n])
        return h

    def __getattr__(self, name: str):  # the model's other attributes (config, kv_cache_shape, ...)
        return getattr(self.model, name)

    __call__ = forward
