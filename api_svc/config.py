"""The HTTP API's settings (`llmserve api`, and the API process `llmserve serve` starts): one field each."""

from __future__ import annotations

from dataclasses import dataclass

from api_svc import limits
from common import config as c
from common.config import setting


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
    log_level: str = setting("warning", "uvicorn's log level (access logs at info)")
    max_request_body_bytes: int = setting(
        limits.DEFAULT_MAX_BODY_BYTES, "largest request body accepted; a larger one is answered 413 before parsing",
        check=c.at_least(1))
    max_prompts_per_request: int = setting(
        limits.DEFAULT_MAX_PROMPTS, "most prompts one /v1/completions request may batch (400 beyond)",
        check=c.at_least(1))
