"""Speculative decoding with a draft model (--speculative-config method draft_model): a smaller model of the same
tokenizer proposes k tokens per decoding request inside the worker's step, the target verifies them in its forward.

The draft has its own paged KV pool indexed by the target's block ids: one block of the scheduler's ledger holds
both models' KV of its tokens, so prefix caching, n > 1 forks (copy-on-write copies both pools) and preemption
need nothing of their own. The draft runs over every token the target computes, in the same step (prefill chunks
included), so a block the prefix cache hands out holds the draft's KV too. InputBatch.num_draft_computed says how
far a row's draft KV goes; each step, before the target's forward:

1. catch-up: one varlen forward over each scheduled row's tokens from there to its chunk's end (the last step's
   accepted drafts and bonus token, or a prefill chunk); a decoding row's last logits give its first draft;
2. k - 1 single-token forwards over all drafting rows at once give the others.

Drafts are written past each row's num_tokens (the next step's tokens overwrite them) and never reported as
accepted tokens; a recompute (kill -9, preemption) rebuilds the draft's KV by the same catch-up. Greedy rows draft
the argmax; sampled rows draw from the draft's distribution q after the request's own processing (penalties,
temperature, top-k/p, min-p) and keep q for rejection sampling (worker_svc/sampling/rejection.py), which `verifier`
plugs into the sampler.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

import kernels
from common.config import ConfigError
from common.speculative_config import SpeculativeConfig
from common.tokenizer import load_tokenizer
from worker_svc.core import grammar_drafts, kv_cache
from worker_svc.core.input_batch import InputBatch
from worker_svc.core.persistent_batch import Schedule
from worker_svc.cpu import layer_loop
from worker_svc.model import families as models
from worker_svc.model.config import ModelConfig
from worker_svc.model.loader import load_model_weights
from worker_svc.model.safetensors_stream import Placement
from worker_svc.parallel.sharding import FULL
from worker_svc.sampling.grammar import GrammarMasks
from worker_svc.sampling.rejection import draft_keys, draw_from_probs, verify_drafts
from worker_svc.sampling.sampler import Draw, SamplingBatch, process_logits, scale_and_filter

log = logging.getLogger(__name__)


@dataclass
class Proposal:
    """One step's drafts: chunk i of the schedule verifies num_drafts[i]; drafting rows are `rows` (batch rows),
    their tokens `drafts` [len(rows), k] and, for sampled rows, the draft's distributions `q` [len(rows), k, V]."""

    num_drafts: np.ndarray
    rows: np.ndarray
    drafts: np.ndarray
    q: torch.Tensor | None = None


def check_same_vocabulary(target: ModelConfig, target_path: str, draft: ModelConfig, draft_path: str) -> None:
    """A draft proposes token ids the target reads as its own: refuse a draft whose vocabulary differs."""
    where = f"--speculative-config key 'model' ({draft_path})"
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"{where}: vocab_size {draft.vocab_size} differs from the model's {target.vocab_size}; "
                          "a draft model must share the model's tokenizer")
    if target_path == draft_path:
        return
    try:
        vocabs = [load_tokenizer(path).backend.get_vocab() for path in (target_path, draft_path)]
    except (OSError, ValueError) as e:  # e.g. a checkpoint saved without tokenizer files
        log.warning("draft model: tokenizers not compared (%s); vocab sizes agree", e)
        return
    if vocabs[0] != vocabs[1]:
        differ = sorted(set(vocabs[0].items()) ^ set(vocabs[1].items()))[:3]
        raise ConfigError(f"{where}: its tokenizer differs from the model's (e.g. {differ}); a draft model must "
                          "share the model's tokenizer")


class DraftModel:
    def __init__(self, spec: SpeculativeConfig, target: ModelConfig, target_path: str, dtype: torch.dtype,
                 device: torch.device, attention_backend: str, block_size: int):
        self.k = spec.num_speculative_tokens
        self.dtype, self.device, self.block_size = dtype, device, block_size
        self.build_plan = attention_backend == "torch"
        self.config, weights = load_model_weights(spec.model, FULL, None, Placement(dtype, device))
        check_same_vocabulary(target, target_path, self.config, spec.model)
        family = models.by_name(self.config.architecture)
        if getattr(family, "hybrid", False):
            raise ConfigError(f"--speculative-config key 'model': {spec.model} is a hybrid "
                              f"({self.config.architecture}) model; a draft model must be attention-only")
        model = family(self.config, weights, dtype, device, attention=kernels.get_backend(attention_backend))
        del weights
        self.model = layer_loop.build(model) or model  # the C++ layer loop where it serves this model
        self.kv: torch.Tensor | None = None
        self.grammar_masks = GrammarMasks(self.config.vocab_size)  # the structured outputs' drafts
        log.info("draft model %s: %d layers, hidden %d, %d speculative tokens", spec.model, self.config.num_layers,
                 self.config.hidden_size, self.k)

    def bytes_per_block(self, config: ModelConfig | None = None) -> int:
        return kv_cache.bytes_per_block(config or self.config, self.block_size, self.dtype)

    def allocate(self, num_blocks: int) -> None:
        self.kv = kv_cache.allocate(self.config, num_blocks, self.block_size, self.dtype, self.device)

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """The step's copy-on-write copies, in the draft's pool too (before anything writes)."""
        if len(src):
            s, d = (torch.from_numpy(a).to(self.device) for a in (src, dst))
            self.kv[:, :, d] = self.kv[:, :, s]

    @torch.inference_mode()
    def propose(self, b: InputBatch, s: Schedule, caps: np.ndarray, eos_token_ids: np.ndarray) -> Proposal:
        """Catch up on every scheduled chunk, then draft up to caps[i] tokens for chunk i (see the module doc)."""
        rows, ends = s.rows, s.starts + s.lengths
        # Never past the target's computed tokens: a row the batch reset starts over from them.
        start = np.minimum(b.num_draft_computed[rows], s.starts)
        drafting = np.flatnonzero(caps > 0)
        logits = self._forward(b, rows, start, ends - start, drafting)
        b.num_draft_computed[rows] = ends
        num_drafts = np.zeros(len(rows), dtype=np.int64)
        if not len(drafting):
            return Proposal(num_drafts, rows[drafting], np.zeros((0, 0), dtype=np.int64))
        d_rows, k = rows[drafting], caps[drafting]
        n = ends[drafting]  # == num_tokens: the first draft's position
        width = int(k.max())
        b.reserve_tokens(int((n + k).max()))
        drafts = np.zeros((len(d_rows), width), dtype=np.int64)
        q: torch.Tensor | None = None
        live = np.arange(len(d_rows))
        stop_ids = eos_token_ids.tolist()
        for j in range(width):
            if j:  # the previous draft in, the next one's logits out
                live = live[k[live] > j]
                if not len(live):
                    break
                logits = self._forward(b, d_rows[live], n[live] + j - 1, np.ones(len(live), dtype=np.int64),
                                       np.arange(len(live)))
            # Structured outputs: drafts from q masked by the grammar (a proposal rejection sampling keeps exact).
            fits = grammar_drafts.mask_draft_logits(self.grammar_masks, logits, b, d_rows[live], stop_ids)
            if not fits.all():  # only a stop token is left: those rows draft no further (decided by the state)
                k[live[~fits]] = j
                logits, live = logits[torch.from_numpy(fits)], live[fits]
                if not len(live):
                    break
            tokens, random, probs = self._choose(logits, b, d_rows[live], j, eos_token_ids)
            grammar_drafts.follow_drafts(b, d_rows[live], tokens)
            drafts[live, j] = tokens
            b.token_ids[d_rows[live], n[live] + j] = tokens
            if len(random):
                if q is None:
                    q = torch.zeros(len(d_rows), width, probs.shape[1])
                q[torch.from_numpy(live[random]), j] = probs
        grammar_drafts.rewind(b, d_rows, k)
        # The proposals wrote the draft's KV of drafts 0 .. k - 2: valid as far as the target accepts them.
        b.num_draft_computed[d_rows] = n + np.maximum(k - 1, 0)
        num_drafts[drafting] = k
        return Proposal(num_drafts, d_rows, drafts, q)

    def _forward(self, b: InputBatch, rows: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                 logits_of: np.ndarray) -> torch.Tensor:
        """The draft over tokens [starts[i], starts[i] + lengths[i]) of rows[i]; logits of chunks `logits_of`'s last
        tokens (on the CPU)."""
        ends = np.cumsum(lengths)
        seq = np.repeat(np.arange(len(rows)), lengths)
        positions = np.arange(len(seq)) + (starts - ends + lengths)[seq]
        ids = b.token_ids[rows[seq], positions].astype(np.int64)
        num_blocks = b.num_blocks[rows]
        tables = b.block_table[rows, : max(1, int(num_blocks.max(initial=0)))]
        meta = kernels.attention_metadata_from_arrays(lengths, starts + lengths, tables, self.block_size,
                                                      self.device, build_plan=self.build_plan)
        dev = self.device
        logits = self.model.forward(torch.from_numpy(ids).to(dev), torch.from_numpy(positions).to(dev), self.kv,
                                    meta, torch.from_numpy(ends[logits_of] - 1).to(dev))
        return logits.float().cpu()

    def _choose(self, logits: torch.Tensor, b: InputBatch, rows: np.ndarray, offset: int,
                eos_token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
        """Each row's draft at `offset` past its tokens: (tokens, the sampled rows among them, their q)."""
        if b.plain[rows].all():
            return logits.numpy().argmax(axis=-1), np.zeros(0, dtype=np.int64), logits[:0]
        sb = b.sampling_batch(rows, eos_token_ids, np.full(len(rows), offset))
        logits = logits.clone()
        process_logits(logits, sb)  # the same processing the target's verification applies
        tokens = logits.numpy().argmax(axis=-1)
        random = np.flatnonzero(~sb.greedy)
        if not len(random):
            return tokens, random, logits[:0]
        probs = scale_and_filter(logits, sb, random).softmax(dim=-1)
        tokens[random] = draw_from_probs(probs, draft_keys(sb.seed[random], sb.position[random]))
        return tokens, random, probs


def verifier(p: Proposal, sample_rows: np.ndarray, num_drafts: np.ndarray) -> Draw:
    """The sampler's draw for a step that verifies `p`: rejection sampling over each sampled row's 1 + drafts
    positions (entries in worker_svc/core/ngram_drafts.verified_positions order). A position after the first
    rejection gets token 0 (the run stops before it; ngram_drafts.verify reads the rest)."""
    per = num_drafts + 1
    first = np.cumsum(per) - per
    entry_row = np.repeat(np.arange(len(sample_rows)), per)
    entry_col = np.arange(int(per.sum())) - first[entry_row]

    def draw(scaled: torch.Tensor, random_entries: np.ndarray, sb: SamplingBatch) -> np.ndarray:
        rr = np.unique(entry_row[random_entries])  # whole rows are random or greedy
        width = int(num_drafts[rr].max(initial=0))
        vocab = scaled.shape[1]
        which, col = np.searchsorted(rr, entry_row[random_entries]), entry_col[random_entries]
        target = torch.zeros(len(rr), width + 1, vocab)
        target[torch.from_numpy(which), torch.from_numpy(col)] = scaled.softmax(dim=-1)
        q = torch.zeros(len(rr), width, vocab)
        drafts = np.zeros((len(rr), width), dtype=np.int64)
        order = np.argsort(p.rows, kind="stable")
        at = np.searchsorted(p.rows[order], sample_rows[rr])
        found = (at < len(order)) & (num_drafts[rr] > 0)
        src = order[np.minimum(at[found], max(len(order) - 1, 0))]
        if found.any() and width:
            drafts[found] = p.drafts[src, :width]
            if p.q is not None:
                q[torch.from_numpy(np.flatnonzero(found))] = p.q[torch.from_numpy(src), :width]
        out = verify_drafts(target, q, drafts, num_drafts[rr], sb.seed[first[rr]], sb.position[first[rr]])
        return np.maximum(out.tokens[which, col], 0)

    return draw
