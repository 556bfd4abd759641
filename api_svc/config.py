"""The HTTP API's settings (`llmserve api`, and the API process `llmserve serve` starts): one field each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from api_svc import limits
from api_svc.tool_parsers import PARSERS
from common import config as c
from common.config import ConfigError, setting


def enable_auto_tool_choice() -> Any:
    return setting(False, "tool_choice \"auto\": parse tool calls out of the model's text with --tool-call-parser")


def tool_call_parser() -> Any:
    return setting(None, "how --enable-auto-tool-choice finds tool calls in the text (api_svc/tool_parsers.py)",
                   choices=tuple(PARSERS))


def responses_store_ttl() -> Any:
    return setting(86400.0, "seconds a stored /v1/responses response (store: true) stays in Redis for GET, cancel and "
                   "previous_response_id", check=c.at_least(1))


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
    served_model_name: str | None = c.served_model_name()
    tokenizer: str | None = c.tokenizer()
    reattach_timeout: float = setting(
        60.0, "seconds a stream keeps re-attaching while the scheduler is unavailable (fail-over)",
        check=c.at_least(0))
    scheduler_metrics_url: str | None = setting(
        None, "the scheduler's Prometheus endpoint (its --metrics-port), re-served on this API's /metrics")
    log_level: str = setting("warning", "uvicorn's log level (access logs at info)")
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

    def __post_init__(self):
        check_tool_flags(self.enable_auto_tool_choice, self.tool_call_parser)
