"""Redis high availability at the scheduler's edge: finding the primary through Sentinel, and waiting until a commit
is durable before its tokens are published.

Sentinel: redis-py's `Sentinel.master_for` asks the Sentinels for the primary's address on every new connection,
and turns a READONLY reply (the primary it was talking to was demoted) into a ConnectionError after dropping that
connection. The driver treats both like any Redis failure: it stands down, then takes the pool again from whichever
node the Sentinels now name.

Durability (`--redis-durability`): the commit script and the wait go in one pipeline on one connection, because
WAIT and WAITAOF count the replication offset of the connection that wrote.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis
from redis.connection import SSLConnection, parse_url
from redis.sentinel import Sentinel

from common.validation import ConfigError

# A Sentinel answers in milliseconds; a data node may be a primary that stopped (SIGSTOP, a partition): without a
# socket timeout a commit would wait for it forever instead of failing over to the node the Sentinels promote.
SENTINEL_SOCKET_TIMEOUT_S = 2.0
DATA_SOCKET_TIMEOUT_S = 5.0
# The longest a commit waits for WAIT / WAITAOF (shorter than the socket timeout, so the reply comes back).
MAX_DURABILITY_WAIT_MS = 2000
START_WAIT_S = 60.0  # at start, how long to wait for a primary while the Sentinels say a fail-over is under way

log = logging.getLogger("llmserve.scheduler")


class DurabilityError(Exception):
    """The durability wait did not confirm a commit in time: the step fails like a failed commit."""


# Replies of a primary that cannot take writes now (no good replicas, demoted, still loading, no quorum behind it).
_UNAVAILABLE_REPLIES = ("NOREPLICAS", "READONLY", "LOADING", "MASTERDOWN", "TRYAGAIN")


def redis_unavailable(e: BaseException) -> bool:
    """Whether `e` says that Redis cannot take a commit at the moment (a fail-over, a lost replica) rather than
    that something is wrong with it: the driver then logs one line, not a traceback, and retries."""
    if isinstance(e, (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError, DurabilityError)):
        return True
    return isinstance(e, redis.ResponseError) and any(r in str(e) for r in _UNAVAILABLE_REPLIES)


def parse_sentinels(spec: str) -> list[tuple[str, int]]:
    """'host:port,host:port' -> [(host, port), ...]; ValueError naming the bad entry."""
    out = []
    for part in spec.split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{part.strip()!r} is not HOST:PORT")
        out.append((host.strip("[]"), int(port)))
    return out


def check_sentinels(spec: str) -> None:
    try:
        parse_sentinels(spec)
    except ValueError as e:
        raise ConfigError(f"--redis-sentinel {spec!r}: {e} (expected HOST:PORT[,HOST:PORT...])") from None


def url_options(url: str | None) -> dict:
    """The password, TLS options and database of `url` (its host and port are ignored), as redis-py keywords."""
    if not url:
        return {}
    opts = parse_url(url)
    for k in ("host", "port", "path", "unix_socket_path"):
        opts.pop(k, None)
    if opts.pop("connection_class", None) is SSLConnection:
        opts["ssl"] = True
    return opts


def connect_sentinel(sentinels: str, master: str, url: str | None) -> redis.Redis:
    """A client whose connections go to the primary the Sentinels name, after one PING went through it; SystemExit
    naming the flags when no Sentinel knows `master` or the primary refuses us."""
    opts = url_options(url)
    node_opts = {k: v for k, v in opts.items() if k != "db"}
    timeouts = {"socket_timeout": SENTINEL_SOCKET_TIMEOUT_S, "socket_connect_timeout": SENTINEL_SOCKET_TIMEOUT_S}
    sentinel = Sentinel(parse_sentinels(sentinels), sentinel_kwargs={**node_opts, **timeouts},
                        **{**timeouts, "socket_timeout": DATA_SOCKET_TIMEOUT_S, **opts})
    client = sentinel.master_for(master)
    deadline = time.monotonic() + START_WAIT_S
    while True:
        try:
            client.ping()
            return client
        except redis.AuthenticationError as e:
            raise SystemExit(f"--redis-sentinel {sentinels}: Redis refused the credentials ({e}); put the password "
                             "in --redis-url redis://:PASSWORD@sentinel/0 (used for Sentinels and data nodes)"
                             ) from None
        except (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError) as e:
            known = _known_master(sentinel, master)
            if known is not None:
                raise SystemExit(f"--redis-sentinel {sentinels}: {known} (--redis-sentinel-master {master!r}; "
                                 f"{type(e).__name__}: {e})") from None
            if time.monotonic() > deadline:  # the Sentinels know the group, but no primary answers
                raise SystemExit(f"--redis-sentinel {sentinels} (master {master!r}): no primary answered within "
                                 f"{START_WAIT_S:.0f} s: {e}") from None
            log.info("waiting for the Sentinels to name a primary for %s (%s)", master, e)  # a fail-over under way
            time.sleep(0.5)
        except redis.RedisError as e:
            raise SystemExit(f"--redis-sentinel {sentinels} (master {master!r}): cannot use Redis: {e}") from None


def _known_master(sentinel: Sentinel, master: str) -> str | None:
    """None when a Sentinel answers and monitors `master`; otherwise what is wrong (a fatal start-up error)."""
    errors = []
    for s in sentinel.sentinels:
        try:
            s.sentinel_master(master)
            return None
        except redis.ResponseError as e:
            errors.append(str(e))
        except redis.RedisError as e:
            errors.append(f"{type(e).__name__}: {e}")
    if any("No such master" in e for e in errors):
        return "the Sentinels monitor no primary of that name; is --redis-sentinel-master right?"
    return f"no Sentinel answered ({'; '.join(errors)}); are they up and is the password right?"


@dataclass
class Durability:
    """What a commit waits for before its step may be published (`--redis-durability`)."""

    mode: str = "none"  # none | local | replica
    min_replicas: int = 1
    timeout_ms: int = 1000
    waitaof: bool = False  # the primary has WAITAOF (Redis 7.2+); set by `check`

    def check(self, client: redis.Redis) -> None:
        """On every primary we lead on (the first, and each one a fail-over promotes): can it give what the mode
        promises? ConfigError naming the flag and the server setting otherwise."""
        if self.mode == "none":
            return
        version = _text(client.info("server").get("redis_version", "0"))  # Valkey reports the Redis it matches
        self.waitaof = tuple(int(x) for x in version.split(".")[:2] if x.isdigit()) >= (7, 2)
        if self.mode != "local":
            return
        try:
            conf = {_text(k): _text(v) for k, v in client.config_get("append*").items()}
        except redis.ResponseError as e:  # CONFIG renamed or forbidden (managed Redis): the promise cannot be checked
            raise ConfigError(f"--redis-durability local: cannot read the primary's appendonly / appendfsync ({e}); "
                              "allow CONFIG GET for this user, or use --redis-durability none or replica") from None
        if conf.get("appendonly") != "yes":
            raise ConfigError("--redis-durability local needs `appendonly yes` on the Redis primary (it has "
                              f"appendonly {conf.get('appendonly')}); set it in redis.conf or use --redis-durability "
                              "none")
        if not self.waitaof and conf.get("appendfsync") != "always":
            raise ConfigError("--redis-durability local needs `appendfsync always` on a Redis primary without "
                              f"WAITAOF (before 7.2; it has appendfsync {conf.get('appendfsync')}): only then is a "
                              "write on disk before Redis answers. Set it, or use --redis-durability none")

    def command(self) -> tuple | None:
        """The wait to pipeline after the commit script, or None (nothing to wait for)."""
        if self.mode == "replica":
            return ("WAIT", self.min_replicas, self.timeout_ms)
        if self.mode == "local" and self.waitaof:
            return ("WAITAOF", 1, 0, self.timeout_ms)
        return None  # none; or local on Redis 7.0 with appendfsync always: the reply already follows the fsync

    def verify(self, reply) -> None:
        """Raise DurabilityError unless the wait's reply confirms the commit (WAIT and WAITAOF also answer on a
        timeout, with the count they reached)."""
        if self.mode == "replica" and int(reply) < self.min_replicas:
            raise DurabilityError(f"only {int(reply)} of --redis-min-replicas {self.min_replicas} replicas "
                                  f"acknowledged the commit within {self.timeout_ms} ms")
        if self.mode == "local" and self.waitaof and int(reply[0]) < 1:
            raise DurabilityError(f"the primary did not fsync the commit within {self.timeout_ms} ms")


def _text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x
