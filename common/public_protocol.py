"""What the scheduler's public Generate stream says besides its messages, shared by the server and common.client.

A queued request may wait minutes for its first token. The scheduler tells the client at once that it holds the
request (in its memory, then in Redis) by sending the stream's headers with ACCEPTED_HEADER as soon as admission
succeeds. From then on an UNAVAILABLE (a lost lease, a restart, a fail-over) means "re-attach by request id", not
"this server cannot take the request", also before any token came; a client without this knowledge would turn a
queued request's re-attach into an error.
"""

from __future__ import annotations

ACCEPTED_HEADER = "llmserve-accepted"  # value "1": admission passed; the request lives on in the pool


def accepted(metadata) -> bool:
    """Whether a Generate call's initial metadata (pairs, or grpc.aio's Metadata) carries ACCEPTED_HEADER."""
    return any(key == ACCEPTED_HEADER for key, _ in (metadata or ()))
