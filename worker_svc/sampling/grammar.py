"""Structured outputs on the worker: grammars compiled once per distinct constraint, a matcher per constrained row.

Why the worker: it sees each sampled token first. With pipelined scheduling the scheduler builds plan k+1 before
step k's tokens are known, so a matcher there could not have step k+1's token mask ready; here the matcher advances
on the token right after it is sampled, in the same step. Its state is a function of the request's output tokens
alone, so a request that joins as resumed (preemption, recompute, a new scheduler or worker) rebuilds it exactly by
replaying the output tokens the plan carries.

Compiling (xgrammar, against the model's vocabulary) happens off the step loop: the scheduler calls
PrepareConstraint at admission, which compiles on a gRPC thread into the LRU cache; a plan then finds the grammar
there. A plan that names a constraint the cache lacks (a worker restarted under resumed requests, an eviction)
compiles it in the step, once.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from concurrent.futures import Future

import numpy as np
import torch

from common.structured_outputs import Constraint, ConstraintError, StructuredOutputsConfig, build_grammar

log = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (a JSON schema's is ~100 KiB-1 MiB)


def hf_vocabulary(model_path: str) -> tuple[list[str], str]:
    """A HF directory's tokenizer entries as spelled in tokenizer.json (special ones blanked, as loader.py does for
    a GGUF's control tokens), and xgrammar's vocab type name."""
    import json

    with open(os.path.join(model_path, "tokenizer.json")) as f:
        spec = json.load(f)
    vocab = spec["model"]["vocab"]
    tokens = [""] * (max(vocab.values(), default=-1) + 1)
    for tok, i in vocab.items():
        tokens[i] = tok
    for added in spec.get("added_tokens", []):
        if added["id"] >= len(tokens):
            tokens += [""] * (added["id"] + 1 - len(tokens))
        tokens[added["id"]] = "" if added.get("special") else added["content"]
    decoder = (spec.get("decoder") or {}).get("type", "")
    return tokens, "BYTE_LEVEL" if decoder == "ByteLevel" else "BYTE_FALLBACK"


class GrammarCache:
    """Compiled grammars by constraint, least recently used evicted past `capacity`. Thread-safe; concurrent
    requests for one constraint compile it once. The vocabulary loads with the first constraint (seconds for a
    GGUF), so workers that never see one never pay for it."""

    def __init__(self, model_path: str, vocab_size: int, eos_token_ids: list[int],
                 config: StructuredOutputsConfig | None = None, capacity: int = DEFAULT_CACHE_SIZE,
                 vocabulary: tuple[list[str], str] | None = None):
        self.config = config or StructuredOutputsConfig()
        self.capacity = capacity
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._compiled: collections.OrderedDict[Constraint, object] = collections.OrderedDict()
        self._compiling: dict[Constraint, Future] = {}
        self._compiler: Future | None = None
        self._source = (model_path, list(eos_token_ids), vocabulary)
        self.hits = self.misses = 0

    def compiler(self):
        with self._lock:
            first = self._compiler is None
            if first:
                self._compiler = Future()
        if first:
            self._load(*self._source)
        return self._compiler.result()

    def _load(self, model_path: str, eos_token_ids: list[int], vocabulary: tuple[list[str], str] | None) -> None:
        try:
            import xgrammar as xgr

            tokens, vocab_type = vocabulary or hf_vocabulary(model_path)
            info = xgr.TokenizerInfo(tokens, getattr(xgr.VocabType, vocab_type), vocab_size=self.vocab_size,
                                     stop_token_ids=list(eos_token_ids))
            # Few threads: compiles run beside the forward on the same cores. xgrammar's own cache is off (ours
            # is bounded and counted).
            threads = max(1, min(4, (os.cpu_count() or 2) // 2))
            self._compiler.set_result(xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False))
        except Exception as e:  # noqa: BLE001 - reported to every constrained request instead
            log.exception("cannot build the structured-output vocabulary from %s", model_path)
            self._compiler.set_exception(e)

    def get(self, c: Constraint) -> tuple[object, float, bool]:
        """(compiled grammar, seconds this call spent compiling, whether it was cached); ConstraintError when the
        constraint does not compile."""
        with self._lock:
            compiled = self._compiled.get(c)
            if compiled is not None:
                self._compiled.move_to_end(c)
                self.hits += 1
                return compiled, 0.0, True
            pending = self._compiling.get(c)
            owner = pending is None
            if owner:
                pending = self._compiling[c] = Future()
                self.misses += 1
        if not owner:
            return pending.result(), 0.0, True
        t0 = time.perf_counter()
        try:
            try:
                compiler = self.compiler()
            except Exception as e:  # noqa: BLE001
                raise ConstraintError(f"structured outputs are unavailable on this worker: {e}") from None
            grammar = build_grammar(c, self.config)
            compiled = compiler.compile_grammar(grammar)
        except BaseException as e:
            with self._lock:
                del self._compiling[c]
            pending.set_exception(e)
            raise
        with self._lock:
            del self._compiling[c]
            self._compiled[c] = compiled
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        pending.set_result(compiled)
        return compiled, time.perf_counter() - t0, False

    def matcher(self, c: Constraint, output_ids: np.ndarray):
        """A matcher at the state after `output_ids` (replayed), or ConstraintError when they do not fit it."""
        import xgrammar as xgr

        compiled, _, _ = self.get(c)
        m = xgr.GrammarMatcher(compiled)
        for i, tok in enumerate(output_ids.tolist()):
            if not m.accept_token(tok):
                raise ConstraintError(f"output token {i} ({tok}) does not fit the constraint: the output cannot be "
                                      "replayed")
        return m


class GrammarMasks:
    """Per step: the token bitmask of every constrained row applied to its logits, then the matchers advanced on
    the sampled tokens. One buffer, reused, grown with the number of rows."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._bitmask: torch.Tensor | None = None
        self._batch = None

    def _mask(self, rows: int) -> torch.Tensor:
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = xgr.allocate_token_bitmask(max(rows, 8), self.vocab_size)
            self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        return self._bitmask[:rows]

    def apply(self, logits: torch.Tensor, matchers: list) -> None:
        """logits: [rows, vocab] on the CPU, masked in place; matchers: per row, None for an unconstrained one."""
        import xgrammar as xgr

        mask = self._mask(logits.shape[0])
        idx = [i for i, m in enumerate(matchers) if m is not None]
        self._batch.batch_fill_next_token_bitmask([matchers[i] for i in idx], mask, idx)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=min(self.vocab_size, logits.shape[1]), indices=idx)

    def apply_with_drafts(self, logits: torch.Tensor, matchers: list, drafts: list[np.ndarray]) -> None:
        """As `apply`, for a step that verifies drafts: request i owns 1 + len(drafts[i]) consecutive rows of
        logits, and its row j is masked at its grammar's state after drafts[i][:j] (the drafts fit: they were cut
        where the grammar rejects one); each matcher is rolled back to where it was."""
        import xgrammar as xgr

        mask = self._mask(logits.shape[0])
        idx: list[int] = []
        at = 0
        for m, d in zip(matchers, drafts, strict=True):
            if m is not None:
                for j, tok in enumerate([*d.tolist(), None]):
                    m.fill_next_token_bitmask(mask, at + j)
                    idx.append(at + j)
                    if tok is not None and not m.accept_token(tok):
                        raise AssertionError(f"draft {tok} does not fit its grammar: drafts are cut before")
                if len(d):
                    m.rollback(len(d))
            at += len(d) + 1
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=min(self.vocab_size, logits.shape[1]), indices=idx)

    @staticmethod
    def fitting_prefix(matcher, drafts: list[int], stop_ids: frozenset[int]) -> int:
        """How many leading drafts the grammar accepts from its state, stopping before a stop token (a grammar's
        end is decided by the verified tokens); the matcher is left where it was."""
        n = 0
        for tok in drafts:
            if tok in stop_ids or not matcher.accept_token(tok):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return n

    @staticmethod
    def advance_runs(matchers: list, chunks: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """`advance` for steps that emit several tokens per request (accepted drafts, then the bonus token): token
        i belongs to request chunks[i], in order. True per request where the constraint has ended."""
        ended = np.zeros(len(matchers), dtype=bool)
        for c, tok in zip(chunks.tolist(), tokens.tolist(), strict=True):
            m = matchers[c]
            if m is None or ended[c]:
                continue
            ok = m.accept_token(tok)
            if not ok:
                log.warning("a sampled token (%d, request %d of the step) does not fit its grammar; the request "
                            "ends", tok, c)
            ended[c] = not ok or m.is_terminated()
        return ended

    @staticmethod
    def advance(matchers: list, tokens: np.ndarray) -> np.ndarray:
        """Advance each row's matcher on its sampled token; True where the constraint has ended (complete, or the
        token did not fit: that request cannot go on under its constraint either)."""
        import xgrammar as xgr

        idx = [i for i, m in enumerate(matchers) if m is not None]
        ended = np.zeros(len(matchers), dtype=bool)
        accepted = xgr.BatchGrammarMatcher.batch_accept_token([matchers[i] for i in idx], tokens[idx].tolist())
        for i, ok in zip(idx, accepted, strict=True):
            if not ok:
                log.warning("a sampled token (%d, row %d of the step) does not fit its grammar; the request ends",
                            int(tokens[i]), i)
            ended[i] = not ok or matchers[i].is_terminated()
        return ended
