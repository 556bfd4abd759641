"""Limits on one Generate request that every front end shares (the scheduler enforces them; the HTTP API checks
them too, before it builds the gRPC request, and publishes them in its OpenAPI document)."""

from __future__ import annotations

MAX_N = 16  # sequences per request
MAX_STOP_STRINGS = 16  # stop strings per request
MAX_STOP_BYTES = 256  # UTF-8 bytes of one stop string (and of one bad word)
