"""ModelRunner: plan in, one fused prefill+decode forward, sampled tokens out.

Plain data both ways (core/plan.py in, core/step_output.py out): worker_svc/server.py with worker_svc/wire.py converts
the wire messages and maps refusals (core/errors.py) to status codes."""

from __future__ import annotations

import importlib.util
import logging
import secrets
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

import kernels
from common import tracing
from common.config import ConfigError, for_device
from common.structured_outputs import StructuredOutputsConfig
from worker_svc.config import WorkerConfig
from worker_svc.core import draft_rollback, grammar_drafts, hidden_drafts, kv_cache, ngram_drafts, speculation
from worker_svc.core.persistent_batch import BatchLimits, PersistentBatch, Schedule
from worker_svc.core.plan import StepPlan
from worker_svc.core.state_cache import StateCache, StateStep, auto_num_slots, ssm_dtype
from worker_svc.core.state_ops import StateOps
from worker_svc.core.step_inputs import ModelInputs, build_model_inputs
from worker_svc.core.step_output import FINISH_NONE, StepOutput
from worker_svc.cpu import layer_loop
from worker_svc.cpu.threads import SmallStepThreads
from worker_svc.model import families as models
from worker_svc.model import hf_quant, lora, quant
from worker_svc.model.compiled import compile_model, wants_compiled
from worker_svc.model.config import ModelConfig
from worker_svc.model.layers.linear import cpu_has_native_bf16, cpu_has_native_fp16
from worker_svc.model.layers.recurrent_split import RecurrentSplit
from worker_svc.model.loader import load_model_weights
from worker_svc.model.safetensors_stream import Placement
from worker_svc.parallel.sharding import FULL, Shard, local_config
from worker_svc.sampling import prompt_logprobs
from worker_svc.sampling.grammar import GrammarCache, GrammarMasks
from worker_svc.sampling.pooler_config import PoolerConfig
from worker_svc.sampling.pooling import Pooler
from worker_svc.sampling.sampler import greedy_batch, pack_logprobs, sample_batch

if TYPE_CHECKING:
    from worker_svc.parallel.rank_group import RankGroup, StepInputs

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """auto: triton on CUDA (torch if triton is not installed), torch elsewhere.

    triton on a CPU device only runs in the Triton interpreter (TRITON_INTERPRET=1; slow, for tests).
    """
    if name == "auto":
        if device.type != "cuda":
            return "torch"
        if importlib.util.find_spec("triton") is None:
            log.warning("triton is not installed: using the torch attention reference on %s", device)
            return "torch"
        return "triton"
    if name not in kernels.BACKENDS:
        raise ValueError(f"--attention-backend must be one of auto, {', '.join(kernels.BACKENDS)}; got {name!r}")
    if name == "triton" and device.type != "cuda" and not kernels.get_backend("triton").INTERPRET:
        raise ValueError(f"--attention-backend triton on --device {device} needs a CUDA device, or "
                         "TRITON_INTERPRET=1 (set before start-up) to run the kernels in the slow Triton interpreter")
    return name


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA and on a CPU with native bf16 (AVX512-BF16 or AMX), as vLLM recommends; float32
    elsewhere (emulated bf16 is no faster)."""
    if name == "auto":
        native = device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())
        return torch.bfloat16 if native else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"--dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    if name == "float16" and device.type == "cpu" and not cpu_has_native_fp16():
        raise ValueError("--dtype float16 needs a CPU with AVX512-FP16 or AMX-FP16 (this one has neither, and "
                         "emulated float16 is slower than float32): use --dtype auto, bfloat16 or float32")
    return _DTYPES[name]


class ModelRunner:
    """With `group`, one rank of a tensor-parallel group: it holds its shard of the weights and of the KV pool.
    Rank 0 serves (`execute`) and sends every step's inputs to the other ranks, which run `follow`."""

    def __init__(self, opts: WorkerConfig, group: RankGroup | None = None):
        self.group = group
        self.device = resolve_device(opts.device)
        self.opts = opts = for_device(opts, self.device.type)  # e.g. the warm-up step's size
        if group is not None and self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", group.local_rank)
        self.dtype = resolve_dtype(opts.dtype, self.device)
        if opts.quantization and opts.dtype == "auto" and self.dtype not in quant.activation_dtypes(self.device):
            self.dtype = quant.activation_dtypes(self.device)[0]  # torch's CPU int4 kernel: bfloat16 only
        self.attention_backend = resolve_attention_backend(opts.attention_backend, self.device)
        tp_size = group.size if group is not None else 1
        shard = Shard(group.rank, tp_size) if group else FULL
        if opts.activation_quantization and not opts.quantization:
            raise ConfigError(f"--activation-quantization {opts.activation_quantization} needs --quantization gguf "
                              "(the activations of dense weights stay in --dtype)")
        self.config, weights = load_model_weights(opts.model, shard, opts.quantization,
                                                  Placement(self.dtype, self.device))
        if opts.activation_quantization:
            try:
                bits = int(opts.activation_quantization.removeprefix("int"))
                weights = quant.with_integer_activations(weights, bits, self.device)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        self.local_config = local_config(self.config, tp_size)  # this rank's heads, its KV pool's shape
        # The process's intra-op threads (all cores unless told); small steps may run on one fewer (cpu/threads.py).
        self.small_step_threads = SmallStepThreads(torch.get_num_threads())
        compiled = wants_compiled(opts)  # inductor cannot trace CPU-packed weights
        if compiled and self.device.type == "cpu":  # an FP8 checkpoint's projections: dense, as the graphs trace
            weights = hf_quant.dequantize_fp8_in_place(weights, self.dtype)
        if compiled and any(isinstance(w, quant.QuantizedWeight) for w in weights.values()):  # detected, no flag
            raise ConfigError(f"--optimization-level {opts.optimization_level} runs dense weights only; {opts.model} "
                              "holds quantized weights (its quantization_config): use -O0")
        family = models.by_name(self.config.architecture)  # the registry's class for this architecture
        self.model = family(self.local_config, weights, self.dtype, self.device, prepack=False if compiled else None,
                            attention=kernels.get_backend(self.attention_backend), tp=group)
        if opts.enable_lora and self.config.num_experts and not getattr(family, "hybrid", False):
            raise ConfigError(f"--enable-lora: adapters are not served on {self.config.architecture}'s sparse MoE "
                              "layers; run without --enable-lora")
        self.lora = lora.build_pool(opts, self.config, self.dtype, self.device, shard)
        self.model.lora = self.lora
        self.draft, self.heads = speculation.load(opts, self.model, self.config, self.attention_backend, group,
                                                  weights)  # before compile: a head reads the target's states
        del weights
        if compiled:
            self.model = compile_model(self.model, opts)
        elif self.lora is None and self.heads is None and (loop := layer_loop.build(self.model)) is not None:
            self.model = loop  # the model's layers in one C++ call, where a step allows it (cpu/layer_loop.py)
        cfg = self.config
        self.max_model_len = min(opts.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.block_size = opts.block_size
        self.state: StateCache | None = None  # hybrid models: the recurrent-state pool (_size_state_pool)
        num_blocks = self._size_kv_pool()
        # Block tables are the same on every rank: every rank's pool holds as many blocks as the smallest.
        self.rank_num_blocks = group.all_gather_int(num_blocks) if group is not None else [num_blocks]
        self.num_blocks = min(self.rank_num_blocks)
        if self.num_blocks * self.block_size < self.max_model_len:
            log.warning("KV pool holds %d tokens, below max_model_len %d", self.num_blocks * self.block_size,
                        self.max_model_len)
        self.kv = kv_cache.allocate(self.local_config, self.num_blocks, self.block_size, self.dtype, self.device)
        speculation.allocate(self.draft, self.heads, self.num_blocks)
        self.eos_ids = frozenset(cfg.eos_token_ids)
        self.eos_token_ids = np.array(sorted(self.eos_ids), dtype=np.int64)
        self.epoch = secrets.token_hex(8)
        self.grammars = GrammarCache(opts.model, cfg.vocab_size, cfg.eos_token_ids,
                                     StructuredOutputsConfig.parse(opts.structured_outputs_config),
                                     vocabulary=cfg.vocabulary)
        self.grammar_masks = GrammarMasks(cfg.vocab_size)
        self.pooler = Pooler(PoolerConfig.parse(opts.pooler_config))
        self.batch = PersistentBatch(BatchLimits(self.num_blocks, self.block_size, self.max_model_len,
                                                 cfg.vocab_size, self.num_state_slots), self.grammars)

    def _size_kv_pool(self) -> int:
        o = self.opts
        if o.num_gpu_blocks_override:
            self._size_state_pool(o.num_gpu_blocks_override * self.rank_kv_bytes_per_block)
            return o.num_gpu_blocks_override
        if self.device.type == "cuda":
            self._warm_up(o.max_num_batched_tokens)
            budget = kv_cache.cuda_kv_budget(self.device, o.gpu_memory_utilization)
        else:
            budget = o.kv_cache_memory
        states = self._size_state_pool(budget)
        if states >= budget:
            raise ConfigError(f"the state pool ({self.state.num_slots} slots of {self.state.bytes_per_slot} bytes) "
                              f"takes the whole KV memory budget ({budget} bytes): lower --num-state-slots, or raise "
                              "--kv-cache-memory (CPU) / --gpu-memory-utilization (CUDA)")
        budget -= states
        if self.rank_kv_bytes_per_block == 0:  # every layer recurrent: the budget cannot size blocks of no bytes
            raise ConfigError(f"{self.config.architecture} has no attention layer in its {self.config.num_layers} "
                              "layers (config.json layer types): a model with no KV is not served")
        # A block holds the proposer's KV of its tokens too (a draft model's, a head's; one ledger entry for all).
        n = budget // (self.rank_kv_bytes_per_block + speculation.kv_bytes_per_block(self.draft, self.heads))
        if n < 1:
            raise RuntimeError(f"no room for a single KV block of {self.block_size} tokens in {budget} bytes")
        return n

    def _size_state_pool(self, budget: int) -> int:
        """A hybrid model's state pool (--num-state-slots, or auto from --max-num-seqs and --state-snapshot-share
        within the KV budget); the bytes it takes."""
        if not getattr(self.model, "hybrid", False):
            return 0
        o = self.opts
        state_dtype = ssm_dtype(o.mamba_ssm_cache_dtype)
        shape = self.model.state_shape()
        per_slot = shape.bytes_per_slot(self.dtype, state_dtype)
        n = o.num_state_slots or auto_num_slots(per_slot, budget, o.max_num_seqs, o.state_snapshot_share)
        self.state = StateCache(shape, n, self.dtype, state_dtype, self.device)
        log.info("state pool: %d slots (%s) of %d bytes, %d bytes in all (%s recurrent state)", n,
                 "--num-state-slots" if o.num_state_slots else
                 f"auto: --max-num-seqs {o.max_num_seqs}, --state-snapshot-share {o.state_snapshot_share:g}",
                 per_slot, n * per_slot, state_dtype)
        if n < o.max_num_seqs:
            log.warning("state pool: %d slots, below --max-num-seqs %d: the scheduler runs at most %d sequences", n,
                        o.max_num_seqs, n)
        return n * per_slot

    @property
    def num_state_slots(self) -> int:
        return 0 if self.state is None else self.state.num_slots

    @property
    def state_bytes_per_slot(self) -> int:
        return 0 if self.state is None else self.state.bytes_per_slot

    def _warm_up(self, num_tokens: int) -> None:
        """One forward at the largest batch, so the KV budget sees the activation peak."""
        blocks = -(-num_tokens // self.block_size)
        scratch = kv_cache.allocate(self.local_config, blocks, self.block_size, self.dtype, self.device)
        meta = kernels.build_attention_metadata([num_tokens], [num_tokens], [list(range(blocks))], self.block_size,
                                                self.device, build_plan=self.attention_backend == "torch")
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        pos = torch.arange(num_tokens, device=self.device)
        extra = {}
        if getattr(self.model, "hybrid", False):  # one scratch state slot
            pool = StateCache(self.model.state_shape(), 1, self.dtype, ssm_dtype(self.opts.mamba_ssm_cache_dtype),
                              self.device)
            extra["state"] = StateStep(pool, torch.zeros(1, dtype=torch.int64, device=self.device),
                                       torch.tensor([0, num_tokens], device=self.device))
        self.model.forward(ids, pos, scratch, meta, torch.tensor([num_tokens - 1], device=self.device), **extra)
        del scratch
        torch.cuda.synchronize(self.device)

    def load_lora(self, name: str, path: str, unload: bool = False) -> int:
        """Read and check an adapter into host memory (or forget it); its rank. LoraError when it cannot be served."""
        if self.lora is None:
            raise lora.LoraError(f"adapter {name!r}: this worker runs without --enable-lora")
        if unload:
            self.lora.forget(name)
            return 0
        return self.lora.load(name, path).rank

    @property
    def kv_bytes_per_block(self) -> int:
        """One block of the whole model's KV (every rank's share together, and a draft model's or a head's)."""
        return kv_cache.bytes_per_block(self.config, self.block_size, self.dtype) + \
            speculation.kv_bytes_per_block(self.draft, self.heads)

    @property
    def rank_kv_bytes_per_block(self) -> int:
        return kv_cache.bytes_per_block(self.local_config, self.block_size, self.dtype)

    def execute(self, plan: StepPlan) -> StepOutput:
        """Check (raises PlanError, changes nothing), apply, run, sample."""
        t0 = time.perf_counter()
        cached = self.batch.check_plan(plan, self.epoch)
        lora_rows = lora.join_plan(self.lora, plan, self.batch.inputs.live)
        previous = self.batch.last_step_id
        sched = self.batch.apply_plan(plan, cached)
        if self.lora is not None:
            self.lora.set_rows(*lora_rows)
        copies = (plan.copy_src.astype(np.int64, copy=False), plan.copy_dst.astype(np.int64, copy=False))
        speculation.copy_blocks(self.draft, self.heads, copies)
        state_ops = StateOps.of_plan(plan) if self.state is not None else StateOps.none()
        if not len(sched):
            state_ops.restore(self.state, self.device)
            if len(copies[0]) or (state_ops and self.group is not None):  # the other ranks' pools too
                self._run(copies, None, state_ops)
            state_ops.save(self.state, self.device)
            return StepOutput(plan.step_id, previous)
        num_drafts, proposal = speculation.propose(self.draft, self.heads, sched, plan, self.block_size,
                                                   self.max_model_len, self.eos_token_ids)
        inputs = build_model_inputs(sched, self.block_size, self.device, num_drafts=num_drafts,
                                    build_plan=self.attention_backend == "torch")  # the Triton kernels need none
        chunk_rows = sched.lengths if num_drafts is None else sched.lengths + num_drafts
        scoring = prompt_logprobs.select(sched, chunk_rows)
        pooling = self.pooler.select(sched, chunk_rows)
        num_sampled = len(inputs.logits_indices)
        if scoring is not None:  # prompt rows' logits come after the sampling rows'
            inputs.logits_indices = torch.cat([inputs.logits_indices,
                                               torch.from_numpy(scoring.flat).to(inputs.logits_indices.device)])
        if pooling is not None:
            inputs.pool_indices = torch.from_numpy(pooling.flat).to(self.device)
        if self.lora is not None:
            self.lora.begin_step(sched.rows, chunk_rows)
        if self.state is not None:  # each sequence's slot, in the order of its rows
            state_ops.hold = draft_rollback.held_slots(sched, num_drafts)
            state_ops.restore(self.state, self.device)
            slots = torch.from_numpy(self.batch.inputs.state_slot[sched.rows]).to(self.device)
            inputs.state = StateStep(self.state, slots, inputs.attn_metadata.cu_seqlens_q.to(torch.int64),
                                     RecurrentSplit.of_lengths(chunk_rows, self.device))  # host data: no read back
        t1 = time.perf_counter()
        logits = self._run(copies, inputs, state_ops)
        state_ops.save(self.state, self.device)
        t2 = time.perf_counter()
        out = StepOutput(plan.step_id, previous, sched.num_tokens)
        if pooling is not None:
            logits, hidden = logits
            out.pooled = self.pooler.collect(hidden, pooling, self.batch.inputs.num_prompt_tokens)
        if scoring is not None:
            out.prompt_logprobs = prompt_logprobs.score(logits[num_sampled:], scoring)
            logits = logits[:num_sampled]
        self.batch.inputs.num_computed_tokens[sched.rows] += sched.lengths
        if len(inputs.sample_rows):
            self._sample(logits, inputs.sample_rows, inputs.num_drafts, out, proposal)
        hidden_drafts.after_step(self.heads, self.batch.inputs, sched, chunk_rows, self.max_model_len)
        if self.state is not None and (redo := draft_rollback.rejected_chunks(sched, out)) is not None:
            # No rejected draft's token stays in a recurrent state: back to before the drafts, the accepted again.
            self._run(draft_rollback.NO_COPIES, *draft_rollback.recompute(
                redo, self.state, self.lora, self.block_size, self.device, self.attention_backend == "torch"))
        t3 = time.perf_counter()
        out.prepare_seconds, out.forward_seconds, out.sample_seconds = t1 - t0, t2 - t1, t3 - t2
        if tracing.enabled:
            _trace_phases(plan, sched, len(inputs.sample_rows), t0, t1, t2, t3)
        return out

    def _run(self, copies: tuple[np.ndarray, np.ndarray], inputs: ModelInputs | None,
             state_ops: StateOps) -> torch.Tensor | None:
        """Copy-on-write, then the forward; in a group, on every rank (the step's inputs sent to them first, with
        the state pool's slot operations, which rank 0 applies around this call)."""
        if self.group is None:
            return self._forward(copies, inputs)
        from worker_svc.parallel.rank_group import step_inputs

        with self.group.lock:  # no heartbeat between this step's message and its collectives
            try:
                # The other ranks' adapters and token slots come with the step (lora.LoraPool.follow).
                lora_sync = self.lora.sync_message() if self.lora is not None else ()
                self.group.send_step(step_inputs(copies, inputs, *lora_sync, state_ops=state_ops.pack()))
                return self._forward(copies, inputs)
            except RuntimeError as e:  # a rank died or timed out mid-step: the group cannot go on
                self.group.fail(f"step failed on rank 0: {e}")
                raise

    def _forward(self, copies: tuple[np.ndarray, np.ndarray], inputs: ModelInputs | None) -> torch.Tensor | None:
        if len(copies[0]):
            # Copy-on-write before anything writes: every layer, K and V.
            src, dst = (torch.from_numpy(a).to(self.device) for a in copies)
            self.kv[:, :, dst] = self.kv[:, :, src]
        if inputs is None:
            return None
        timed = self.device.type == "cpu" and self.group is None
        if timed:
            num_tokens = len(inputs.input_ids)
            threads = self.small_step_threads.choose(num_tokens)
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
            start = time.perf_counter()
        extra = {} if inputs.state is None else {"state": inputs.state}
        logits = self.model.forward(inputs.input_ids, inputs.positions, self.kv, inputs.attn_metadata,
                                    inputs.logits_indices, inputs.pool_indices, **extra)
        if timed:
            self.small_step_threads.record(num_tokens, threads, time.perf_counter() - start)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return logits

    def follow(self) -> None:
        """Ranks other than 0: run the steps rank 0 sends until it stops the group (or fails, which raises)."""
        while (step := self.group.receive()) is not None:
            if self.lora is not None:
                self.lora.follow(step.lora_slots, step.lora_written)
            ops = StateOps.unpack(step.state_ops)  # none but a hybrid model's
            ops.restore(self.state, self.device)
            self._forward((step.copy_src, step.copy_dst), self._inputs_of(step) if len(step.input_ids) else None)
            ops.save(self.state, self.device)

    def _inputs_of(self, step: StepInputs) -> ModelInputs:
        meta = kernels.attention_metadata_from_arrays(step.query_lens, step.seq_lens, step.block_tables,
                                                      self.block_size, self.device,
                                                      build_plan=self.attention_backend == "torch")
        dev = self.device
        state = None if self.state is None else StateStep(self.state, torch.from_numpy(step.state_slots).to(dev),
                                                          meta.cu_seqlens_q.to(torch.int64),
                                                          RecurrentSplit.of_lengths(step.query_lens, dev))
        return ModelInputs(input_ids=torch.from_numpy(step.input_ids).to(dev),
                           positions=torch.from_numpy(step.positions).to(dev), attn_metadata=meta,
                           logits_indices=torch.from_numpy(step.logits_indices).to(dev),
                           sample_rows=np.zeros(0, dtype=np.int64), state=state)

    def _sample(self, logits: torch.Tensor, rows: np.ndarray, num_drafts: np.ndarray | None, out: StepOutput,
                proposal: speculation.Proposal | None = None) -> None:
        """Sample for `rows` (for a row with drafts, at each of its 1 + num_drafts positions, as plain sampling
        would, and keep the accepted run), append the tokens, fill `out`; finished requests leave the batch."""
        b = self.batch.inputs
        logits = logits.cpu()
        if num_drafts is not None and not num_drafts.any():
            num_drafts = None
        virtual, offsets = (rows, None) if num_drafts is None else ngram_drafts.verified_positions(rows, num_drafts)
        constrained = b.constrained[rows]
        if constrained.any():  # structured outputs: mask the grammar rows' logits before any sampling step sees them
            t0 = time.perf_counter()
            grammar_drafts.mask(self.grammar_masks, logits, b, rows, virtual, num_drafts)
            out.mask_seconds = time.perf_counter() - t0
        if b.plain[rows].all():
            sampled = greedy_batch(logits)
        else:
            sampled = sample_batch(logits, b.sampling_batch(virtual, self.eos_token_ids, offsets),
                                   speculation.verifying_draw(proposal, rows, num_drafts))
        if num_drafts is None:
            emitted = ngram_drafts.emit_one_each(b, rows, sampled.token_ids, self.eos_token_ids)
        else:
            emitted = ngram_drafts.verify(b, rows, num_drafts, sampled.token_ids, self.eos_token_ids)
        if constrained.any():  # a completed grammar ends its request as a stop (vLLM: finish_reason "stop")
            t0 = time.perf_counter()
            grammar_drafts.advance(self.grammar_masks, b, rows, emitted, num_drafts is not None)
            out.num_constrained = int(constrained.sum())
            out.mask_seconds += time.perf_counter() - t0
        out.slots = rows[emitted.chunks]  # a request's slot is its row
        out.token_ids = emitted.token_ids
        out.finish_reasons = emitted.reasons
        out.logprobs = pack_logprobs(sampled, emitted.entry_of)
        finished = emitted.chunks[emitted.reasons != FINISH_NONE]
        if num_drafts is not None:
            spec = np.flatnonzero(num_drafts)
            out.spec_slots, out.spec_num_draft_tokens = rows[spec], num_drafts[spec]
            out.spec_num_accepted_tokens = emitted.accepted[spec]
            # The accepted drafts' KV was computed by this forward; the bonus token's is the next step's.
            alive = np.ones(len(rows), dtype=bool)
            alive[finished] = False
            b.num_computed_tokens[rows[alive]] += emitted.accepted[alive]
        for row in rows[finished].tolist():
            # The worker forgets a finished request at once; a later drop of its slot is a no-op.
            b.free(row)


def _trace_phases(plan: StepPlan, sched: Schedule, num_sampled: int, *t: float) -> None:
    """Child spans of the current (ExecuteStep) span for the three phases, from the perf_counter marks taken anyway
    (no tracing work inside the step itself)."""
    offset = time.time_ns() - time.perf_counter_ns()
    ns = [offset + int(x * 1e9) for x in t]
    attrs = ({"llmserve.step.id": plan.step_id, "llmserve.num_tokens": sched.num_tokens,
              "llmserve.num_seqs": len(sched)}, {"llmserve.step.id": plan.step_id},
             {"llmserve.step.id": plan.step_id, "llmserve.num_sampled": num_sampled})
    for i, name in enumerate(("llmserve.worker.prepare_inputs", "llmserve.worker.forward", "llmserve.worker.sample")):
        tracing.tracer.start_span(name, start_time=ns[i], attributes=attrs[i]).end(end_time=ns[i + 1])


def config_summary(cfg: ModelConfig) -> str:
    return (f"{cfg.name or cfg.architecture}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
            f"{cfg.num_heads}/{cfg.num_kv_heads} heads, vocab {cfg.vocab_size}")
