"""Hugging Face transformers baselines for `llmserve bench serve --backend hf-naive|hf-static|hf-continuous`.

The same model (the GGUF de-quantized by transformers, as in tests/conftest.py), the same RequestSpecs and the
same RequestResult times as the llmserve load generator, so the reports compare directly:

- hf-naive: one request at a time in arrival order, `model.generate` per request.
- hf-static: when idle, take up to `max_num_seqs` requests that have already arrived (never wait for more),
  left-pad them into one batch and `generate` until its longest member is done; then the next batch.
- hf-continuous: transformers' own continuous batching (`model.init_continuous_batching()`), each request added
  to the running manager at its arrival time.

Every backend decodes greedily and makes exactly `min(max_tokens, cancel_after_tokens)` tokens with EOS neither
stopping nor masked (llmserve's `ignore_eos`: EOS may be generated and does not end the request; HF's
`min_new_tokens` would instead forbid EOS and change the greedy text). A request never starts before its
`arrival_s`. Token times are taken when the token exists on the host:

- naive/static: a streamer that `generate` calls once per decode step (after the token is sampled); a static
  batch's members share the step times, and a member keeps only its first `max_tokens` (its `end_s` is its last
  kept token, although its slot stays busy until the batch ends).
- continuous: transformers' own per-token timestamps (`record_timestamps=True`, `time.perf_counter()` taken in
  the generation thread when the token is appended to the request), moved to the run's origin.

Cancel (`cancel_after_tokens`): each backend generates only that many tokens and marks the result cancelled
(ok=True), as if the client had gone away then: the request frees its slot at that point (in hf-static the
batch still runs to its longest member).

Entry point for the CLI: `run_hf_backend(name, model_path, specs, max_num_seqs, progress=...)` loads the model,
sets the torch threads (default `os.cpu_count()`), warms up, and runs one backend from a fresh time origin.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from llmserve.bench.common import RequestResult, RequestSpec

BACKENDS = ("hf-naive", "hf-static", "hf-continuous")
Progress = Callable[[RequestResult], None]


def load_hf_model(model_path: str | None = None, dtype: torch.dtype = torch.float32):
    """The model as transformers loads it from the GGUF (or an HF directory), in eval mode."""
    from transformers import AutoModelForCausalLM

    if model_path is None:
        from worker_svc.model.loader import default_model_path

        model_path = default_model_path()
    if model_path.endswith(".gguf"):
        d, f = os.path.split(model_path)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return model.eval()


def _num_new_tokens(spec: RequestSpec) -> int:
    if spec.max_tokens < 1:
        raise ValueError(f"{spec.request_id}: max_tokens must be >= 1")
    if spec.cancel_after_tokens is not None:
        return max(1, min(spec.max_tokens, spec.cancel_after_tokens))
    return spec.max_tokens


def _pad_id(model) -> int:
    for v in (model.generation_config.pad_token_id, model.config.pad_token_id, model.generation_config.eos_token_id):
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    return 0


class _NoEosWarning(logging.Filter):
    """generate() warns on every call that eos_token_id=-1 is not a real token; -1 is how we turn EOS off."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "eos_token_id` should consist of positive integers" not in record.getMessage()


_no_eos_filter = _NoEosWarning()


def _greedy_config(model, max_new_tokens: int):
    from transformers import GenerationConfig

    logging.getLogger("transformers.generation.utils").addFilter(_no_eos_filter)  # idempotent
    # eos_token_id=-1: no stop on EOS and no EOS masking (None would be filled in from the model's config).
    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=-1,
                            pad_token_id=_pad_id(model))


class _StepClock:
    """A `generate` streamer (duck-typed: put/end): the first `put` is the prompt, each later one is one decode
    step's new tokens."""

    def __init__(self, origin: float):
        self.origin = origin
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.times.append(time.perf_counter() - self.origin)

    def end(self) -> None:
        pass


def _generate_batch(model, prompts: list[tuple[int, ...]], max_new_tokens: int, origin: float
                    ) -> tuple[list[list[int]], list[float]]:
    """Left-padded greedy generate of `prompts`: each row's new tokens, and the time of each decode step."""
    width = max(len(p) for p in prompts)
    pad = _pad_id(model)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    clock = _StepClock(origin)
    config = _greedy_config(model, max_new_tokens)
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             generation_config=config, streamer=clock)
    return out[:, width:].tolist(), clock.times


def _sleep_until(t: float, origin: float) -> None:
    delay = t - (time.perf_counter() - origin)
    if delay > 0:
        time.sleep(delay)


def _fail(r: RequestResult, e: Exception, origin: float) -> None:
    r.error = f"{type(e).__name__}: {e}"
    r.end_s = time.perf_counter() - origin


def _finish(r: RequestResult, spec: RequestSpec, tokens: list[int], times: list[float]) -> None:
    n = _num_new_tokens(spec)
    r.output_ids, r.token_times = list(tokens[:n]), list(times[:n])
    r.end_s = r.token_times[-1] if r.token_times else None
    r.cancelled = spec.cancel_after_tokens is not None and spec.cancel_after_tokens < spec.max_tokens
    r.ok = len(r.output_ids) == len(r.token_times) == n
    if not r.ok:
        r.error = f"made {len(r.output_ids)} tokens with {len(r.token_times)} times, expected {n}"


def _results(specs: Sequence[RequestSpec]) -> dict[str, RequestResult]:
    # A baseline is the server: its clients send at arrival, and its own queue counts in TTFT as llmserve's does.
    return {s.request_id: RequestResult(s.request_id, len(s.prompt_ids), s.arrival_s, sent_s=s.arrival_s)
            for s in specs}


def run_hf_naive(model, specs: Sequence[RequestSpec], *, max_num_seqs: int = 1, start: float | None = None,
                 progress: Progress | None = None) -> list[RequestResult]:
    """One request at a time, in arrival order (`max_num_seqs` is ignored: the point is no batching)."""
    origin = time.perf_counter() if start is None else start
    results = _results(specs)
    for spec in sorted(specs, key=lambda s: s.arrival_s):
        _sleep_until(spec.arrival_s, origin)
        r = results[spec.request_id]
        r.started_s = time.perf_counter() - origin
        try:
            rows, times = _generate_batch(model, [spec.prompt_ids], _num_new_tokens(spec), origin)
            _finish(r, spec, rows[0], times)
        except Exception as e:  # a failed request is reported, the run goes on
            _fail(r, e, origin)
        if progress:
            progress(r)
    return [results[s.request_id] for s in specs]


def run_hf_static(model, specs: Sequence[RequestSpec], *, max_num_seqs: int, start: float | None = None,
                  progress: Progress | None = None) -> list[RequestResult]:
    """Padded static batches of up to `max_num_seqs` requests that have arrived by the time the last batch ends."""
    origin = time.perf_counter() if start is None else start
    results = _results(specs)
    pending = deque(sorted(specs, key=lambda s: s.arrival_s))
    while pending:
        _sleep_until(pending[0].arrival_s, origin)  # idle: wait for the next request, not for a full batch
        now = time.perf_counter() - origin
        batch = []
        while pending and len(batch) < max_num_seqs and pending[0].arrival_s <= now:
            batch.append(pending.popleft())
        for spec in batch:
            results[spec.request_id].started_s = now
        try:
            rows, times = _generate_batch(model, [s.prompt_ids for s in batch], max(map(_num_new_tokens, batch)),
                                          origin)
            for spec, row in zip(batch, rows, strict=True):
                _finish(results[spec.request_id], spec, row, times)
        except Exception as e:
            for spec in batch:
                _fail(results[spec.request_id], e, origin)
        if progress:
            for spec in batch:
                progress(results[spec.request_id])
    return [results[s.request_id] for s in specs]


def run_hf_continuous(model, specs: Sequence[RequestSpec], *, max_num_seqs: int, start: float | None = None,
                      progress: Progress | None = None, block_size: int = 16, max_batch_tokens: int = 512
                      ) -> list[RequestResult]:
    """transformers' continuous batching; at most `max_num_seqs` requests are in the manager at once (the rest queue
    here, FCFS, and are sent when one finishes). Its paged cache holds `max_num_seqs` of the longest request, in
    blocks of `block_size` tokens (memory: that many tokens of KV, about 45 KiB each for SmolLM2-135M in float32);
    `max_batch_tokens` is its per-step token budget (llmserve's CPU default)."""
    manager = _start_manager(model, specs, max_num_seqs, block_size, max_batch_tokens)
    origin = time.perf_counter() if start is None else start
    results = _results(specs)
    by_id = {s.request_id: s for s in specs}
    pending = deque(sorted(specs, key=lambda s: s.arrival_s))
    arrived: deque[RequestSpec] = deque()
    in_flight: set[str] = set()
    try:
        while pending or arrived or in_flight:
            now = time.perf_counter() - origin
            while pending and pending[0].arrival_s <= now:
                arrived.append(pending.popleft())
            while arrived and len(in_flight) < max_num_seqs:
                spec = arrived.popleft()
                results[spec.request_id].started_s = time.perf_counter() - origin
                manager.add_request(list(spec.prompt_ids), request_id=spec.request_id,
                                    max_new_tokens=_num_new_tokens(spec), record_timestamps=True, eos_token_id=-1)
                in_flight.add(spec.request_id)
            # Block for a result, but wake up for the next arrival.
            wait = 0.5 if not pending else min(0.5, max(0.0, pending[0].arrival_s - (time.perf_counter() - origin)))
            out = manager.get_result(timeout=wait)
            if out is None:
                if in_flight and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped")
                continue
            if not out.is_finished() or out.request_id not in in_flight:
                continue
            in_flight.discard(out.request_id)
            r, spec = results[out.request_id], by_id[out.request_id]
            if out.error is not None:
                r.error = out.error
                r.end_s = time.perf_counter() - origin
            else:
                _finish(r, spec, out.generated_tokens, [t - origin for t in out.timestamps or []])
            if progress:
                progress(r)
    finally:
        # Stopping restores the model's attention implementation; the model is shared (tests, several backends).
        manager.stop(block=True, timeout=30)
        manager.destroy()
    return [results[s.request_id] for s in specs]


def _start_manager(model, specs: Sequence[RequestSpec], max_num_seqs: int, block_size: int, max_batch_tokens: int):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # Enough blocks for the max_num_seqs largest requests at full length at once (an upper bound of what can be
    # in flight, so it never preempts), not max_num_seqs x the longest: that over-reserves gigabytes on mixed loads.
    sizes = sorted((math.ceil((len(s.prompt_ids) + _num_new_tokens(s)) / block_size) + 1 for s in specs),
                   reverse=True)
    config = ContinuousBatchingConfig(
        page_size=block_size,
        num_blocks=max(1, sum(sizes[:max_num_seqs])),
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_num_seqs,
        safety_margin=0.0,  # the cache holds every admitted request at full length: no need to hold blocks back
    )
    manager = model.init_continuous_batching(generation_config=_greedy_config(model, 1),
                                             continuous_batching_config=config)
    manager.start()
    return manager


_RUNNERS = {"hf-naive": run_hf_naive, "hf-static": run_hf_static, "hf-continuous": run_hf_continuous}


def run_hf_backend(name: str, model_path: str | None, specs: Sequence[RequestSpec], max_num_seqs: int,
                   progress: bool | Progress | None = None, num_threads: int | None = None, model=None
                   ) -> list[RequestResult]:
    """Load the model (unless `model` is given: several backends in one run), warm it up, and run `specs` through
    backend `name` ("hf-naive", "hf-static" or "hf-continuous") from a fresh time origin. `model_path`: a .gguf
    or an HF directory, None for the bundled model. `progress`: True for a bar on stderr, or a callback per
    finished request. `num_threads`: torch intra-op threads (default: every CPU, `os.cpu_count()`)."""
    if name not in _RUNNERS:
        raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
    torch.set_num_threads(num_threads or os.cpu_count() or 1)
    if model is None:
        model = load_hf_model(model_path)
    _generate_batch(model, [(1, 2, 3, 4)], 2, time.perf_counter())  # first-call costs stay out of the run
    bar = None
    if progress is True:
        from tqdm import tqdm

        bar = tqdm(total=len(specs), desc=name, unit="req", file=sys.stderr)
        progress = lambda r: bar.update(1)  # noqa: E731
    try:
        # Each runner takes its time origin after its own set-up (the continuous manager allocates its cache).
        return _RUNNERS[name](model, specs, max_num_seqs=max_num_seqs, progress=progress or None)
    finally:
        if bar is not None:
            bar.close()
