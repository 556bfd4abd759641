"""The scheduler's settings (`llmserve scheduler`, and the scheduler inside `llmserve serve`): one field each."""

from __future__ import annotations

from dataclasses import dataclass

from common import config as c
from common.config import setting
from common.speculative_config import SpeculativeConfig, parse_speculative_config, speculative_config_setting
from common.validation import ConfigError, check_channel_tls, check_limits, check_server_tls
from scheduler_svc.ledger.redis_ha import check_sentinels

SCHEDULING_MODES = ("continuous", "static", "naive")


@dataclass(frozen=True)
class SchedulerConfig:
    host: str = setting("0.0.0.0", "address of the public gRPC API")
    port: int = setting(50051, "port of the public gRPC API (0 picks a free one)")
    redis_url: str | None = c.redis_url()
    namespace: str = c.namespace()
    redis_sentinel: str | None = setting(
        None, "find the Redis primary through these Sentinels and follow its fail-overs (--redis-url then only "
        "gives the password, TLS options and database, used for Sentinels and data nodes alike)",
        metavar="HOST:PORT[,HOST:PORT...]")
    redis_sentinel_master: str = setting("mymaster", "the Sentinels' name of the Redis primary")
    redis_durability: str = setting(
        "none", "when a step's tokens may be published: none: once the primary applied the commit; local: once it "
        "is in the primary's append-only file on disk (WAITAOF, or appendfsync always before Redis 7.2); replica: "
        "once --redis-min-replicas replicas acknowledged it (WAIT)", choices=("none", "local", "replica"))
    redis_min_replicas: int = setting(1, "replicas that must acknowledge each commit with --redis-durability replica",
                                      check=c.at_least(1))
    worker_address: str = setting("127.0.0.1:50061", "HOST:PORT of the worker's gRPC server")
    max_num_batched_tokens: int | None = c.max_num_batched_tokens()
    max_num_seqs: int | None = c.max_num_seqs()
    enable_chunked_prefill: bool = setting(True, "split long prompts over steps within the token budget")
    long_prefill_token_threshold: int = setting(0, "longest prefill chunk of one request per step (0: the budget)",
                                                check=c.at_least(0))
    enable_prefix_caching: bool = setting(True, "reuse the KV of shared prompt prefixes (hash-chained full blocks)")
    state_snapshot_share: float = c.state_snapshot_share()
    scheduling_policy: str = setting("fcfs", "who waits and who is preempted first", choices=("fcfs", "priority"))
    scheduling_mode: str = setting(
        "continuous", "continuous: iteration-level admission (the product); static: a new batch only when the "
        "previous one has finished; naive: one request at a time. The last two exist for benchmarks",
        choices=SCHEDULING_MODES)
    async_scheduling: bool = setting(
        True, "commit and publish each step while the worker already runs the next one (the next plan is built "
        "from the previous step's result); --no-async-scheduling commits between the two")
    speculative_config: str | None = speculative_config_setting()
    enable_lora: bool = c.enable_lora()
    lora_modules: list[str] | None = c.lora_modules()
    max_loras: int = c.max_loras()
    allow_runtime_lora_updating: bool = setting(
        False, "accept /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    step_log: str | None = setting(None, "append one JSON line per step (scheduled/admitted/preempted/finished ids, "
                                   "queue sizes, KV usage): for benchmarks and tests", metavar="PATH")
    max_num_queued_requests: int = setting(10_000, "waiting requests cap; more are refused with RESOURCE_EXHAUSTED",
                                           check=c.at_least(1))
    queue_timeout: float = setting(0.0, "seconds a request may wait; 0 = forever", check=c.at_least(0))
    api_key: str | None = c.api_key()
    metrics_port: int | None = setting(None, "serve Prometheus metrics on this port")
    lease_ttl_ms: int = setting(5000, "leadership lease of the pool in Redis; a standby takes over after it lapses",
                                check=c.at_least(1))
    reattach_timeout: float = c.reattach_timeout()
    debug_invariants: bool = setting(False, "check the block ledger after every step")
    shutdown_timeout: float = setting(
        0.0, "on SIGTERM, seconds to let requests in flight finish before aborting them; 0 hands them over to the "
        "next scheduler (they stay in Redis, clients re-attach)", check=c.at_least(0))
    tokenizer: str | None = c.tokenizer()
    otlp_traces_endpoint: str | None = c.otlp_traces_endpoint()
    worker_token: str | None = c.worker_token()
    tls_cert: str | None = c.tls_cert()
    tls_key: str | None = c.tls_key()
    tls_client_ca: str | None = c.tls_client_ca()
    worker_tls_ca: str | None = setting(
        None, "connect to the worker over TLS, trusting this CA bundle (PEM) (default: plaintext)")
    worker_tls_cert: str | None = setting(
        None, "client certificate (PEM) for a worker that requires one (its --tls-client-ca)")
    worker_tls_key: str | None = setting(None, "private key (PEM) of --worker-tls-cert")
    worker_tls_server_name: str | None = setting(
        None, "expect this name in the worker's certificate instead of --worker-address's host")

    def speculative(self) -> SpeculativeConfig | None:
        try:
            return parse_speculative_config(self.speculative_config)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def validate(self, block_size: int | None = None, max_model_len: int | None = None) -> None:
        """Combinations that cannot work fail at start-up, naming the flags and the values. The block size and
        max-model-len are checked here when the caller knows them (`llmserve serve`), otherwise once the worker has
        described itself (leadership.sized_policy). Raises ConfigError."""
        c.check(self)
        if self.speculative() is not None and self.scheduling_mode != "continuous":
            raise ConfigError(f"--speculative-config needs --scheduling-mode continuous (got {self.scheduling_mode}): "
                              "the static and naive modes are baselines of plain decoding; drop one of them")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ConfigError("--long-prefill-token-threshold only applies with --enable-chunked-prefill; "
                              "drop one of them")
        check_limits(block_size=block_size, budget=self.max_num_batched_tokens, max_model_len=max_model_len,
                     chunked=self.enable_chunked_prefill or self.scheduling_mode != "continuous")
        if self.redis_sentinel is not None:
            check_sentinels(self.redis_sentinel)
        check_server_tls(cert=self.tls_cert, key=self.tls_key, client_ca=self.tls_client_ca)
        check_channel_tls(ca=self.worker_tls_ca, cert=self.worker_tls_cert, key=self.worker_tls_key,
                          server_name=self.worker_tls_server_name)
