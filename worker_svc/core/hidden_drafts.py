"""Speculative drafts from the target's hidden states: an EAGLE-3 head (worker_svc/model/eagle3.py) or the
checkpoint's own MTP layer (worker_svc/model/mtp.py), run inside the worker's step.

After step t's tokens are sampled and verified, the head runs once over every position the target computed in
that step whose next token is known (prefill chunks included: the head keeps its own one-layer KV over the whole
context, in a cache indexed by the target's block ids, so prefix-cached and copied-on-write blocks carry it along).
A row at position p reads the target's state at p and the token at p + 1; the row at a decoding request's last
accepted position (with the bonus token) yields draft 1, and the head chains k - 1 more rows on its own output.
The drafts wait in the worker for step t + 1, keyed by the request and its token count: the scheduler planned
t + 1 before t's tokens were known (pipelined), and a row that was preempted, recomputed or replaced simply finds
no drafts for its first step. Nothing of it reaches Redis.

The drafts are the head's greedy tokens, a point-mass proposal, so the n-gram path's verification
(ngram_drafts.verify through the sampler; speculation.verifying_draw says why that is the rejection sampler for a
point mass) keeps both greedy and sampled outputs exact.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

import kernels
from common.config import ConfigError
from common.speculative_config import FLAG, SpeculativeConfig
from worker_svc.config import WorkerConfig
from worker_svc.core import kv_cache
from worker_svc.core.input_batch import InputBatch
from worker_svc.core.ngram_drafts import draft_caps
from worker_svc.core.persistent_batch import Schedule
from worker_svc.model.config import ModelConfig
from worker_svc.model.decoder import LlamaModel
from worker_svc.model.hidden_capture import HiddenCapture
from worker_svc.model.target_vocab import TargetVocab


class Head(Protocol):
    """What both heads offer (Eagle3Head, MtpHead)."""

    config: ModelConfig  # the head's one layer: its KV cache's shape
    aux_layers: tuple[int, ...]  # the target layers whose input it reads (EAGLE-3)
    reads_final: bool  # it reads the target's final normed state (MTP)

    def first_hidden(self, capture: HiddenCapture, rows: torch.Tensor) -> torch.Tensor: ...

    def step(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
             attn_meta: Any) -> torch.Tensor: ...

    def draft_tokens(self, h: torch.Tensor) -> torch.Tensor: ...


def refuse_uncomposed(spec: SpeculativeConfig, target: LlamaModel) -> None:
    """ConfigError naming the flag where the head cannot run beside this target (every rank checks alike)."""
    if spec.method == "eagle3" and not getattr(target, "hybrid", False) \
            and type(target).forward is not LlamaModel.forward:
        raise ConfigError(f"{FLAG} method eagle3: the target {target.config.architecture} does not hand out "
                          "its layers' hidden states (Llama-shaped and hybrid decoders do)")


def load(spec: SpeculativeConfig, opts: WorkerConfig, target: LlamaModel, config: ModelConfig, vocab: TargetVocab,
         attention_backend: str) -> HiddenDrafts:
    """The head of --speculative-config method eagle3 / mtp (speculation.load picks it), whole on this rank (rank 0
    of a tensor-parallel group): config is the target's whole config, vocab its embedding and LM head."""
    if spec.method == "eagle3":
        from worker_svc.model.eagle3 import Eagle3Head

        head: Head = Eagle3Head(spec.model, target, config, vocab, attention=target.attention,
                                prepack=target.prepacked)
    else:
        from worker_svc.model.loader import default_model_path
        from worker_svc.model.mtp import MtpHead

        head = MtpHead(spec.model or opts.model or default_model_path(), target, config, vocab)
    return HiddenDrafts(head, target, spec.num_speculative_tokens, opts.block_size, attention_backend == "torch")


def after_step(drafts: HiddenDrafts | None, b: InputBatch, sched: Schedule, chunk_rows: np.ndarray,
               max_model_len: int) -> None:
    """The head over this step's hidden states: its KV, and the next step's drafts (nothing without a head). It
    runs before a hybrid model's roll-back of rejected drafts, whose forward would overwrite the captured states."""
    if drafts is not None:
        drafts.after_step(b, sched.rows, sched.starts, chunk_rows, max_model_len)


class HiddenDrafts:
    def __init__(self, head: Head, target: LlamaModel, num_speculative_tokens: int, block_size: int,
                 build_plan: bool):
        self.head, self.k = head, num_speculative_tokens
        self.device, self.dtype = target.device, target.dtype
        self.capture = HiddenCapture(head.aux_layers, head.reads_final)
        target.capture = self.capture
        self.kv: torch.Tensor | None = None  # [1, 2, num_blocks, block_size, Hkv, D] (allocate)
        self.block_size = block_size
        self.build_plan = build_plan  # the torch attention backend's metadata (the Triton kernels need none)
        # Per request id: (the token count the drafts continue, the drafts).
        self.waiting: dict[str, tuple[int, np.ndarray]] = {}

    def bytes_per_block(self) -> int:
        return kv_cache.bytes_per_block(self.head.config, self.block_size, self.dtype)

    def allocate(self, num_blocks: int) -> None:
        """The head's KV pool, indexed by the target's block ids (the runner sizes both pools together)."""
        self.kv = kv_cache.allocate(self.head.config, num_blocks, self.block_size, self.dtype, self.device)

    def before_step(self, copies: tuple[np.ndarray, np.ndarray]) -> None:
        """Copy-on-write of the head's KV with the target's; the capture emptied for this step's forward."""
        if len(copies[0]):
            src, dst = (torch.from_numpy(a).to(self.device) for a in copies)
            self.kv[:, :, dst] = self.kv[:, :, src]
        self.capture.begin()

    def take(self, b: InputBatch, rows: np.ndarray, ends: np.ndarray, draft_slots: np.ndarray,
             max_model_len: int) -> np.ndarray:
        """The waiting drafts of the chunks (rows[i], computing up to ends[i]) that were granted slots, written to
        the batch's token_ids past each row's num_tokens (as n-gram drafts are); the drafts per chunk."""
        cap = draft_caps(b, rows, ends, draft_slots, self.block_size, max_model_len)
        num = np.zeros(len(rows), dtype=np.int64)
        for i in np.flatnonzero(cap > 0).tolist():
            row = int(rows[i])
            found = self.waiting.get(b.request_ids[row])
            n = int(b.num_tokens[row])
            if found is None or found[0] != n:
                continue  # a resumed, recomputed or new request: no drafts for its first step
            d = found[1][: cap[i]]
            b.reserve_tokens(n + len(d))
            b.token_ids[row, n: n + len(d)] = d
            num[i] = len(d)
        return num

    def after_step(self, b: InputBatch, rows: np.ndarray, starts: np.ndarray, chunk_rows: np.ndarray,
                   max_model_len: int) -> None:
        """Run the head over the step's positions whose next token is known, and keep the next step's drafts.
        rows / starts: the step's chunks (positions from starts[i]); chunk_rows: their query rows in the forward."""
        self.waiting.clear()  # what was not taken this step is stale
        self.batch = b
        live = b.live[rows]
        n_tok = b.num_tokens[rows]
        valid = np.where(live, np.minimum(b.num_computed_tokens[rows], n_tok - 1) - starts, 0)
        which = np.flatnonzero(valid > 0)
        if not len(which) or self.kv is None:
            return
        r, q, s = rows[which], valid[which], starts[which]
        first_row = (np.cumsum(chunk_rows) - chunk_rows)[which]
        local = np.arange(int(q.sum())) - np.repeat(np.cumsum(q) - q, q)
        flat = np.repeat(first_row, q) + local
        positions = np.repeat(s, q) + local
        token_ids = b.token_ids[np.repeat(r, q), positions + 1].astype(np.int64)
        hidden = self.head.first_hidden(self.capture, self._t(flat))
        out = self._step(token_ids, hidden, positions, r, q, s + q)
        # Decoding rows (every known token computed but the last): their drafts; prefill chunks only wrote KV.
        decoding = s + q == n_tok[which] - 1  # a constrained row's drafts are cut by its grammar later
        if not decoding.any():
            return
        last = (np.cumsum(q) - 1)[decoding]
        r, p_last = r[decoding], (s + q - 1)[decoding]
        h = out[self._t(last)]
        tokens = np.zeros((len(r), self.k), dtype=np.int64)
        tokens[:, 0] = self.head.draft_tokens(h).cpu().numpy()
        count = np.ones(len(r), dtype=np.int64)
        # Chained rows write head KV at p_last + j: within the row's blocks and max_model_len.
        limit = np.minimum(b.num_blocks[r] * self.block_size, max_model_len)
        going = np.arange(len(r))
        for j in range(1, self.k):
            keep = p_last[going] + j < limit[going]
            going, h = going[keep], h[self._t(np.flatnonzero(keep))]
            if not len(going):
                break
            pos = p_last[going] + j
            ones = np.ones(len(going), dtype=np.int64)
            h = self._step(tokens[going, j - 1], h, pos, r[going], ones, pos + 1)
            tokens[going, j] = self.head.draft_tokens(h).cpu().numpy()
            count[going] += 1
        for i, row in enumerate(r.tolist()):
            self.waiting[b.request_ids[row]] = (int(b.num_tokens[row]), tokens[i, : count[i]].copy())

    def _step(self, token_ids: np.ndarray, hidden: torch.Tensor, positions: np.ndarray, rows: np.ndarray,
              query_lens: np.ndarray, seq_lens: np.ndarray) -> torch.Tensor:
        """One forward of the head: query_lens[i] rows of chunk i (batch row rows[i]) ending at seq_lens[i]."""
        num_blocks = self.batch.num_blocks[rows]
        tables = self.batch.block_table[rows, : max(1, int(num_blocks.max(initial=0)))]
        meta = kernels.attention_metadata_from_arrays(query_lens, seq_lens, tables, self.block_size, self.device,
                                                      build_plan=self.build_plan)
        return self.head.step(self._t(token_ids), hidden, self._t(positions), self.kv, meta)

    def _t(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
        return t if self.device.type == "cpu" else t.to(self.device)

