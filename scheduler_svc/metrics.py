"""Prometheus metrics under vLLM's names, so existing dashboards work."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics import MetricWrapperBase

from scheduler_svc.core.policy import PolicyConfig
from scheduler_svc.core.request import Request
from scheduler_svc.core.step_records import SchedulerOutput, SpecStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM's boundaries (vllm/v1/metrics/loggers.py), so a dashboard's histogram_quantile reads the same buckets.
_TTFT_BUCKETS = (0.001, *_LATENCY_BUCKETS)
_TOKEN_TIME_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                       40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
# vLLM builds 1-2-5 steps up to max_model_len; the registry exists before the worker names it, so up to 128k.
_COUNT_BUCKETS = tuple(m * 10 ** e for e in range(6) for m in (1, 2, 5) if m * 10 ** e <= 131072)
_N_BUCKETS = (1, 2, 5, 10, 20)
# Per-class latency: the request's `priority` folded into three classes (bounded label values).
REQUEST_CLASSES = ("high", "default", "low")


def request_class(priority: int) -> str:
    """vLLM's order: a lower priority value is served first."""
    return "high" if priority < 0 else "low" if priority > 0 else "default"
# A step commit takes milliseconds: finer buckets than request latencies.
_COMMIT_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Why admission stopped in a step that left requests waiting (`llmserve:admission_blocked_steps_total{limit}`).
ADMISSION_LIMITS = ("max_num_seqs", "token_budget", "kv_cache", "max_loras", "state_slots")
_CONFIG_LABELS = ["max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "long_prefill_token_threshold",
                  "enable_prefix_caching", "scheduling_policy", "scheduling_mode", "block_size", "num_gpu_blocks",
                  "kv_bytes_per_block", "max_model_len", "device", "num_speculative_tokens"]


class Metrics:
    def __init__(self, model_name: str = "model"):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, L = self.registry, ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", L, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", L, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Share of KV blocks in use (0-1)", L, registry=r)
        # Not in vLLM: hybrid models' state slots beside the KV blocks (0 for a model without recurrent layers).
        self.state_usage = Gauge("llmserve:state_slot_usage_perc", "Share of the worker's recurrent-state slots in "
                                 "use by requests and prefix-cache snapshots (0-1)", L, registry=r)
        self.state_snapshots = Gauge("llmserve:state_snapshots", "Prefix-cache snapshots of the recurrent state "
                                     "held in state slots (saved or being saved)", L, registry=r)
        self.state_snapshot_share = Gauge("llmserve:state_snapshot_share", "Share of the state slots the "
                                          "snapshots hold (0-1; at most --state-snapshot-share)", L, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions by recompute", L, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens computed", L, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", L, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests", [*L, "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", L,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens of a request", L,
                             buckets=_TOKEN_TIME_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish", L,
                             buckets=_REQUEST_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled", L,
                               buckets=_REQUEST_BUCKETS, registry=r)
        # Per finished request, observed once at its finish (vLLM's request-level series).
        self.req_prefill = Histogram("vllm:request_prefill_time_seconds", "First scheduled to first token", L,
                                     buckets=_REQUEST_BUCKETS, registry=r)
        self.req_decode = Histogram("vllm:request_decode_time_seconds", "First token to last token", L,
                                    buckets=_REQUEST_BUCKETS, registry=r)
        self.req_inference = Histogram("vllm:request_inference_time_seconds", "First scheduled to finish", L,
                                       buckets=_REQUEST_BUCKETS, registry=r)
        self.req_tpot = Histogram("vllm:request_time_per_output_token_seconds", "Decode time / (generated tokens "
                                  "- 1), per request", L, buckets=_TOKEN_TIME_BUCKETS, registry=r)
        self.req_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request", L,
                                    buckets=_COUNT_BUCKETS, registry=r)
        self.req_gen = Histogram("vllm:request_generation_tokens", "Generated tokens per request", L,
                                 buckets=_COUNT_BUCKETS, registry=r)
        # Per request at admission (all n sequences together).
        self.params_n = Histogram("vllm:request_params_n", "The n request parameter", L, buckets=_N_BUCKETS,
                                  registry=r)
        self.params_max_tokens = Histogram("vllm:request_params_max_tokens", "The max_tokens request parameter", L,
                                           buckets=_COUNT_BUCKETS, registry=r)
        self.max_gen = Histogram("vllm:request_max_num_generation_tokens", "Most tokens a request may generate "
                                 "(max_tokens after admission's defaults)", L, buckets=_COUNT_BUCKETS, registry=r)
        # Old names still in old dashboards: the same observations as their successors.
        self.old_kv_usage = Gauge("vllm:gpu_cache_usage_perc", "Deprecated: vllm:kv_cache_usage_perc", L,
                                  registry=r)
        self.old_tpot = Histogram("vllm:time_per_output_token_seconds", "Deprecated: "
                                  "vllm:inter_token_latency_seconds", L, buckets=_TOKEN_TIME_BUCKETS, registry=r)
        # Not in vLLM: latency by request class (from `priority`: high < 0, default 0, low > 0).
        C = [*L, "request_class"]
        self.class_ttft = Histogram("llmserve:class_time_to_first_token_seconds", "Time to first token by "
                                    "request class", C, buckets=_TTFT_BUCKETS, registry=r)
        self.class_queue = Histogram("llmserve:class_request_queue_time_seconds", "Arrival to first scheduled by "
                                     "request class", C, buckets=_REQUEST_BUCKETS, registry=r)
        self.class_e2e = Histogram("llmserve:class_e2e_request_latency_seconds", "Arrival to finish by request "
                                   "class", C, buckets=_REQUEST_BUCKETS, registry=r)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Tokens scheduled per iteration", L,
                                          buckets=_TOKEN_BUCKETS, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      L, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", L,
                                   registry=r)
        # Speculative decoding (vLLM's names): requests x steps that verified drafts, drafts, accepted drafts, and
        # accepted drafts by position (0 = the first draft after the request's last token).
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Draft runs verified (one per request and step)",
                                   L, registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified", L,
                                         registry=r)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", L,
                                     registry=r)
        self.spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted at each draft position", [*L, "position"], registry=r)
        # Not in vLLM: the configuration and the admission limit, for `llmserve diagnose`.
        self.config_info = Gauge("llmserve:config_info", "Scheduler limits and KV pool size in effect (value 1)",
                                 [*L, *_CONFIG_LABELS], registry=r)
        self.admission_blocked = Counter("llmserve:admission_blocked_steps",
                                         "Steps that left requests waiting, by the limit that stopped admission",
                                         [*L, "limit"], registry=r)
        # Not in vLLM: where the worker's time goes, from its per-step report.
        self.worker_forward = Counter("llmserve:worker_forward_seconds", "Time inside the model forward (input "
                                      "tensors ready to logits ready)", L, registry=r)
        self.worker_idle = Counter("llmserve:worker_idle_seconds", "Time the worker had no plan to run", L,
                                   registry=r)
        self.step_seconds = Histogram("llmserve:step_seconds", "Scheduler step: scheduling to the step's commit", L,
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.redis_commit_seconds = Histogram("llmserve:redis_commit_seconds", "A step's Redis commit: encoding "
                                              "and the one script call, round trip included", L,
                                              buckets=_COMMIT_BUCKETS, registry=r)
        self.ledger_behind = Counter("llmserve:redis_ledger_behind", "Take-overs that found the ledger behind "
                                     "the last step this scheduler committed (a fail-over promoted a replica that "
                                     "had not received it): the lost steps are recomputed", L, registry=r)
        self.ledger_lost_steps = Counter("llmserve:redis_ledger_lost_steps", "Committed steps a promoted replica "
                                         "did not have", L, registry=r)
        # Not in vLLM: structured outputs (grammars compile on the worker; it reports each compile and each step).
        self.grammar_compile = Histogram("llmserve:structured_output_compile_seconds", "Grammar compile time of a "
                                         "constraint missing from the worker's cache", L,
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.grammar_queries = Counter("llmserve:structured_output_cache_queries", "Constrained requests admitted "
                                       "(grammar cache look-ups)", L, registry=r)
        self.grammar_hits = Counter("llmserve:structured_output_cache_hits", "Admitted constrained requests whose "
                                    "grammar was already compiled", L, registry=r)
        self.masked_tokens = Counter("llmserve:structured_output_masked_tokens", "Tokens sampled under a grammar "
                                     "mask", L, registry=r)
        self.mask_seconds = Counter("llmserve:structured_output_mask_seconds", "Worker time filling and applying "
                                    "grammar masks and advancing matchers", L, registry=r)
        self._last_token_time: dict[str, float] = {}
        self._tokens_this_step = 0
        self._families = [v for v in vars(self).values() if isinstance(v, MetricWrapperBase)]  # no child bound yet
        self.set_model_name(model_name)

    def set_model_name(self, name: str) -> None:
        """Bind every metric's label once: `labels()` per token would cost more than the observation."""
        if name != self.model_name:  # the placeholder's children would show as a second model: drop them
            for metric in self._families:
                metric.clear()
        self.model_name = name
        m = {"model_name": name}
        self.c_running, self.c_waiting, self.c_kv = (g.labels(**m) for g in (self.running, self.waiting,
                                                                              self.kv_usage))
        self.c_states = tuple(g.labels(**m) for g in (self.state_usage, self.state_snapshots,
                                                       self.state_snapshot_share))
        self.c_preempt, self.c_prompt, self.c_gen = (c.labels(**m) for c in (self.preemptions, self.prompt_tokens,
                                                                             self.generation_tokens))
        self.c_ttft, self.c_itl, self.c_e2e, self.c_queue, self.c_iter = (
            h.labels(**m) for h in (self.ttft, self.itl, self.e2e, self.queue, self.iteration_tokens))
        self.c_request = tuple(h.labels(**m) for h in (self.req_prefill, self.req_decode, self.req_inference,
                                                        self.req_tpot, self.req_prompt, self.req_gen))
        self.c_params = tuple(h.labels(**m) for h in (self.params_n, self.params_max_tokens, self.max_gen))
        self.c_old_kv, self.c_old_tpot = self.old_kv_usage.labels(**m), self.old_tpot.labels(**m)
        self.c_class = {k: tuple(h.labels(model_name=name, request_class=k) for h in (
            self.class_ttft, self.class_queue, self.class_e2e)) for k in REQUEST_CLASSES}
        self.c_prefix_q, self.c_prefix_h = self.prefix_queries.labels(**m), self.prefix_hits.labels(**m)
        self.c_forward, self.c_idle = self.worker_forward.labels(**m), self.worker_idle.labels(**m)
        self.c_step = self.step_seconds.labels(**m)
        self.c_commit = self.redis_commit_seconds.labels(**m)
        self.c_grammar_compile, self.c_grammar_q, self.c_grammar_h, self.c_masked, self.c_mask_s = (
            x.labels(**m) for x in (self.grammar_compile, self.grammar_queries, self.grammar_hits,
                                    self.masked_tokens, self.mask_seconds))
        self.c_success: dict[str, Counter] = {}
        self.c_spec = tuple(c.labels(**m) for c in (self.spec_drafts, self.spec_draft_tokens, self.spec_accepted))
        self.c_spec_pos: list = []  # by position, bound as positions first appear
        # Created up front so a scrape shows 0 rather than nothing for a limit never hit.
        self.c_blocked = {lim: self.admission_blocked.labels(model_name=name, limit=lim) for lim in ADMISSION_LIMITS}

    def set_config(self, policy: PolicyConfig, num_gpu_blocks: int, kv_bytes_per_block: int, max_model_len: int,
                   device: str) -> None:
        """Publish the limits in effect once the worker's sizes filled the policy's defaults."""
        self.config_info.clear()
        self.config_info.labels(
            model_name=self.model_name, max_num_seqs=policy.max_num_seqs,
            max_num_batched_tokens=policy.max_num_batched_tokens,
            enable_chunked_prefill=str(policy.enable_chunked_prefill).lower(),
            long_prefill_token_threshold=policy.long_prefill_token_threshold,
            enable_prefix_caching=str(policy.enable_prefix_caching).lower(),
            scheduling_policy=policy.scheduling_policy, scheduling_mode=policy.scheduling_mode,
            block_size=policy.block_size, num_gpu_blocks=num_gpu_blocks, kv_bytes_per_block=kv_bytes_per_block,
            max_model_len=max_model_len, device=device,
            num_speculative_tokens=policy.speculative.num_speculative_tokens if policy.speculative else 0).set(1)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def preempted(self, n: int) -> None:
        if n:
            self.c_preempt.inc(n)

    def prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None:
        if queried_tokens:
            self.c_prefix_q.inc(queried_tokens)
            self.c_prefix_h.inc(hit_tokens)

    def request_added(self, seqs: list[Request]) -> None:
        """One request's sequences (n of them) entered the queue."""
        n, max_tokens, max_gen = self.c_params
        n.observe(len(seqs))
        max_tokens.observe(seqs[0].max_tokens)
        max_gen.observe(seqs[0].max_tokens)

    def request_scheduled(self, req: Request, now: float) -> None:
        queued = max(0.0, now - req.arrival_time)
        self.c_queue.observe(queued)
        self.c_class[request_class(req.priority)][1].observe(queued)

    def first_token(self, req: Request, now: float) -> None:
        """The first token of this request (not of one resumed after a restart: its first token came earlier)."""
        ttft = max(0.0, now - req.arrival_time)
        self.c_ttft.observe(ttft)
        self.c_class[request_class(req.priority)][0].observe(ttft)

    def tokens_generated(self, req: Request, n: int, now: float) -> None:
        self._tokens_this_step += n
        last = self._last_token_time.get(req.request_id)
        if last is not None:
            self.c_itl.observe(now - last)
            self.c_old_tpot.observe(now - last)
        self._last_token_time[req.request_id] = now

    def worker_step(self, forward_seconds: float, idle_seconds: float, step_seconds: float) -> None:
        self.c_forward.inc(forward_seconds)
        self.c_idle.inc(idle_seconds)
        self.c_step.observe(step_seconds)

    def grammar_prepared(self, compile_seconds: float, cached: bool) -> None:
        """From an admission thread: one constrained request's grammar is ready on the worker."""
        self.c_grammar_q.inc()
        if cached:
            self.c_grammar_h.inc()
        else:
            self.c_grammar_compile.observe(compile_seconds)

    def structured_step(self, num_masked: int, seconds: float) -> None:
        self.c_masked.inc(num_masked)
        self.c_mask_s.inc(seconds)

    def spec_decode(self, spec: SpecStats) -> None:
        drafts, tokens, accepted = self.c_spec
        drafts.inc(spec.num_drafts)
        tokens.inc(spec.num_draft_tokens)
        accepted.inc(spec.num_accepted_tokens)
        while len(self.c_spec_pos) < len(spec.accepted_per_pos):
            self.c_spec_pos.append(self.spec_per_pos.labels(model_name=self.model_name,
                                                            position=str(len(self.c_spec_pos))))
        for counter, n in zip(self.c_spec_pos, spec.accepted_per_pos, strict=False):
            counter.inc(n)

    def ledger_rolled_back(self, steps: int) -> None:
        self.ledger_behind.labels(model_name=self.model_name).inc()
        self.ledger_lost_steps.labels(model_name=self.model_name).inc(steps)

    def redis_commit(self, seconds: float) -> None:
        self.c_commit.observe(seconds)

    def request_finished(self, req: Request, now: float) -> None:
        last_token = self._last_token_time.pop(req.request_id, None)
        reason = req.finish_reason or "unknown"
        if reason not in self.c_success:
            self.c_success[reason] = self.success.labels(model_name=self.model_name, finished_reason=reason)
        self.c_success[reason].inc()
        e2e = max(0.0, now - req.arrival_time)
        self.c_e2e.observe(e2e)
        self.c_class[request_class(req.priority)][2].observe(e2e)
        prefill, decode, inference, tpot, prompt, gen = self.c_request
        prompt.observe(req.num_prompt_tokens)
        gen.observe(len(req.output_ids))
        if req.scheduled_time is None:  # finished before any step (aborted in the queue): no running phase
            return
        inference.observe(max(0.0, now - req.scheduled_time))
        if req.first_token_time is not None:
            prefill.observe(max(0.0, req.first_token_time - req.scheduled_time))
            decode_time = max(0.0, (last_token or req.first_token_time) - req.first_token_time)
            decode.observe(decode_time)
            if len(req.output_ids) > 1:
                tpot.observe(decode_time / (len(req.output_ids) - 1))

    def state_slots(self, usage: float, num_snapshots: int, snapshot_share: float) -> None:
        for gauge, value in zip(self.c_states, (usage, num_snapshots, snapshot_share), strict=True):
            gauge.set(value)

    def step_done(self, out: SchedulerOutput, num_running: int, num_waiting: int, kv_usage: float) -> None:
        self.c_running.set(num_running)
        self.c_waiting.set(num_waiting)
        self.c_kv.set(kv_usage)
        self.c_old_kv.set(kv_usage)
        self.c_iter.observe(out.total_tokens)
        if self._tokens_this_step:
            self.c_gen.inc(self._tokens_this_step)
            self._tokens_this_step = 0
        if out.num_prompt_tokens:
            self.c_prompt.inc(out.num_prompt_tokens)
        # Static / naive batches hold admission back by design: no limit to attribute there.
        if num_waiting and out.admission_stopped_by in self.c_blocked:
            self.c_blocked[out.admission_stopped_by].inc()
