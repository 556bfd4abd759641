"""The HTTP API's settings (`llmserve api`, and the API process `llmserve serve` starts): one field each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from api_svc import limits
from api_svc.reasoning_parsers import REASONING_PARSERS
from api_svc.tool_parsers import PARSERS
from common import config as c
from common.config import ConfigError, setting
from common.validation import check_ca, check_cert_pair, check_channel_tls


def enable_auto_tool_choice() -> Any:
    return setting(False, "tool_choice \"auto\": parse tool calls out of the model's text with --tool-call-parser")


def tool_call_parser() -> Any:
    return setting(None, "how --enable-auto-tool-choice finds tool calls in the text (api_svc/tool_parsers.py)",
                   choices=tuple(PARSERS))


def reasoning_parser() -> Any:
    return setting(None, "split each chat reply's reasoning from its content, answered as the message's "
                   "reasoning_content (api_svc/reasoning_parsers.py; openai_gptoss: gpt-oss's harmony channels)",
                   choices=tuple(REASONING_PARSERS))


def responses_store_ttl() -> Any:
    return setting(86400.0, "seconds a stored /v1/responses response (store: true) stays in Redis for GET, cancel and "
                   "previous_response_id", check=c.at_least(1))


# HTTPS of the API (vLLM's names, uvicorn's options): `llmserve api` and `llmserve serve`, which passes them on.
def ssl_keyfile() -> Any:
    return setting(None, "serve HTTPS with this private key (PEM); needs --ssl-certfile")


def ssl_certfile() -> Any:
    return setting(None, "certificate chain (PEM) of --ssl-keyfile")


def ssl_ca_certs() -> Any:
    return setting(None, "CA bundle (PEM) that client certificates are checked against")


def ssl_cert_reqs() -> Any:
    return setting(0, "client certificates, as Python's ssl module numbers it: 0 none, 1 optional, 2 required "
                   "(with --ssl-ca-certs)", choices=(0, 1, 2))


def check_tool_flags(enable: bool, parser: str | None) -> None:
    """vLLM's start-up rule: auto tool choice needs a parser."""
    if enable and parser is None:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (one of " + ", ".join(PARSERS) + ")")


@dataclass(frozen=True)
class APIConfig:
    scheduler: str = setting("127.0.0.1:50051", "HOST:PORT of the scheduler's gRPC API")
    host: str = setting("0.0.0.0", "address of the HTTP server")
    port: int = setting(8000, "HTTP port (0 picks a free one)")
    api_key: str | None = c.api_key()
    scheduler_api_key: str | None = setting(
        None, "the scheduler's --api-key (default: --api-key, as `llmserve serve` uses one key for both)")
    served_model_name: list[str] | None = c.served_model_name()
    tokenizer: str | None = c.tokenizer()
    reattach_timeout: float = c.reattach_timeout()
    scheduler_metrics_url: str | None = setting(
        None, "the scheduler's Prometheus endpoint (its --metrics-port), re-served on this API's /metrics")
    log_level: str = setting("warning", "uvicorn's log level (access logs at info); vLLM's upper-case names too",
                             parse=str.lower, choices=("critical", "error", "warning", "info", "debug", "trace"))
    max_request_body_bytes: int = setting(
        limits.DEFAULT_MAX_BODY_BYTES, "largest request body accepted; a larger one is answered 413 before parsing",
        check=c.at_least(1))
    max_prompts_per_request: int = setting(
        limits.DEFAULT_MAX_PROMPTS, "most prompts one /v1/completions request may batch (400 beyond)",
        check=c.at_least(1))
    redis_url: str | None = c.redis_url()
    namespace: str = c.namespace()
    responses_store_ttl: float = responses_store_ttl()
    enable_auto_tool_choice: bool = enable_auto_tool_choice()
    tool_call_parser: str | None = tool_call_parser()
    reasoning_parser: str | None = reasoning_parser()
    # HTTPS (vLLM's names, uvicorn's options).
    ssl_keyfile: str | None = ssl_keyfile()
    ssl_certfile: str | None = ssl_certfile()
    ssl_ca_certs: str | None = ssl_ca_certs()
    ssl_cert_reqs: int = ssl_cert_reqs()
    # The gRPC channel to the scheduler (its --tls-cert / --tls-client-ca), as the scheduler's --worker-tls-*.
    scheduler_tls_ca: str | None = setting(
        None, "connect to the scheduler over TLS, trusting this CA bundle (PEM) (default: plaintext)")
    scheduler_tls_cert: str | None = setting(
        None, "client certificate (PEM) for a scheduler that requires one (its --tls-client-ca)")
    scheduler_tls_key: str | None = setting(None, "private key (PEM) of --scheduler-tls-cert")
    scheduler_tls_server_name: str | None = setting(
        None, "expect this name in the scheduler's certificate instead of --scheduler's host")

    def __post_init__(self):
        check_tool_flags(self.enable_auto_tool_choice, self.tool_call_parser)

    def validate(self) -> None:
        """The TLS flags' combinations and files; ConfigError naming the flags."""
        c.check(self)
        check_channel_tls(ca=self.scheduler_tls_ca, cert=self.scheduler_tls_cert, key=self.scheduler_tls_key,
                          server_name=self.scheduler_tls_server_name, prefix="--scheduler-tls")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ConfigError("--ssl-keyfile and --ssl-certfile go together: give both or neither")
        if self.ssl_certfile is not None:
            check_cert_pair("--ssl-certfile", self.ssl_certfile, "--ssl-keyfile", self.ssl_keyfile)
        if self.ssl_ca_certs is not None:
            if self.ssl_certfile is None:
                raise ConfigError("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile (HTTPS)")
            check_ca("--ssl-ca-certs", self.ssl_ca_certs)
        elif self.ssl_cert_reqs:
            raise ConfigError(f"--ssl-cert-reqs {self.ssl_cert_reqs} needs --ssl-ca-certs (the CA of the clients)")

    def scheduler_credentials(self):
        """grpc.ChannelCredentials for the scheduler, None for plaintext."""
        if self.scheduler_tls_ca is None:
            return None
        from common.tls import channel_credentials

        return channel_credentials(self.scheduler_tls_ca, self.scheduler_tls_cert, self.scheduler_tls_key)
