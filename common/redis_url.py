"""`--redis-url` (the scheduler's state, the HTTP API's stored responses): redis://[:PASSWORD@]HOST:PORT/DB, or
rediss://...?ssl_ca_certs=PATH for TLS. Checked once at start; shown with its password redacted."""

from __future__ import annotations

import urllib.parse

import redis


def redact_url(url: str) -> str:
    """`url` with its password (and any *password* query value) replaced by ***, for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{netloc.rpartition('@')[2]}"
    query = "&".join(f"{k}=***" if "password" in k.lower() else f"{k}={v}"
                     for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def probe_redis(url: str) -> None:
    """One PING through `url`: a wrong password, a TLS mismatch or an unreachable server ends the process at start
    with a message naming --redis-url (password redacted) instead of a process that retries the same failure
    forever."""
    shown = redact_url(url)
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=10, socket_timeout=10) as probe:
            probe.ping()
    except redis.AuthenticationError as e:
        raise SystemExit(f"--redis-url {shown}: Redis refused the credentials ({e}); put the right password in the "
                         "URL: redis://:PASSWORD@host:port/db") from None
    except redis.ResponseError as e:
        raise SystemExit(f"--redis-url {shown}: Redis answered PING with an error: {e}") from None
    except redis.RedisError as e:
        if isinstance(e.__context__, ConnectionRefusedError):
            hint = "is Redis running there?"
        elif url.startswith("rediss://"):
            hint = ("with rediss:// the port must serve TLS and its certificate must be signed by the CA named by "
                    "?ssl_ca_certs=PATH (or the system's)")
        else:
            hint = "a Redis that serves TLS only drops plaintext connections: use rediss://...?ssl_ca_certs=PATH"
        raise SystemExit(f"--redis-url {shown}: cannot use Redis: {e} ({hint})") from None
    except (OSError, ValueError, TypeError) as e:  # a malformed URL, an unknown query option, an unreadable file
        raise SystemExit(f"--redis-url {shown}: {e}") from None
