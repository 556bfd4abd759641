"""Stored /v1/responses responses (`store: true`) in Redis, so that GET, cancel and `previous_response_id` work from
any API process: the API itself keeps nothing between requests.

One key per response, `{namespace}:response:{id}`, holding JSON `{"response": <the response object>, "messages":
<the conversation as chat messages, its output included>}`, with `--responses-store-ttl`. A cancel sets the
status in place (the process generating the response sees it when it writes its result and keeps "cancelled").

Redis unreachable, failing over, loading or read-only: every call raises the API's 503 with Retry-After
(`unavailable`), never a 500, so that clients retry it like any other moment the service is away.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator

import redis
import redis.asyncio as aioredis

from api_svc.errors import unavailable
from common.redis_url import probe_redis

IN_PROGRESS = ("queued", "in_progress")
# Replies of a node that cannot serve right now (still loading, no quorum or replicas behind it, mid fail-over).
_UNAVAILABLE_REPLIES = ("LOADING", "MASTERDOWN", "TRYAGAIN", "NOREPLICAS")


@contextlib.contextmanager
def _retryable(what: str) -> Iterator[None]:
    """A Redis failure that passes (ConnectionError covers BusyLoadingError and Sentinel's MasterNotFoundError)
    as the 503 it is."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError) as e:
        raise unavailable(f"the stored responses cannot be {what} right now: Redis is unavailable "
                          f"({type(e).__name__}: {e}); retry shortly") from None
    except redis.ResponseError as e:
        if not str(e).startswith(_UNAVAILABLE_REPLIES):
            raise
        raise unavailable(f"the stored responses cannot be {what} right now: Redis answered {e}; retry shortly"
                          ) from None


class ResponseStore:
    def __init__(self, url: str, namespace: str, ttl_s: float):
        probe_redis(url)  # a wrong URL, password or TLS setting ends the process at start, naming --redis-url
        self.redis = aioredis.Redis.from_url(url)
        self.prefix = f"{namespace}:response:"
        self.ttl_ms = int(ttl_s * 1000)

    async def get(self, response_id: str) -> dict | None:
        with _retryable("read"):
            raw = await self.redis.get(self.prefix + response_id)
        return json.loads(raw) if raw is not None else None

    async def put(self, response_id: str, record: dict) -> None:
        with _retryable("written"):
            await self.redis.set(self.prefix + response_id, json.dumps(record, ensure_ascii=False), px=self.ttl_ms)

    async def delete(self, response_id: str) -> None:
        with _retryable("deleted"):
            await self.redis.delete(self.prefix + response_id)

    async def finish(self, response_id: str, record: dict) -> dict:
        """Write a finished response unless a cancel got there first (then the stored, cancelled one stays)."""
        def change(old: dict | None) -> dict | None:
            return None if old is not None and old["response"]["status"] == "cancelled" else record
        return await self._update(response_id, change)

    async def cancel(self, response_id: str) -> dict | None:
        """Mark an in-progress response cancelled; the record as it now stands (None: unknown id)."""
        def change(old: dict | None) -> dict | None:
            if old is None or old["response"]["status"] not in IN_PROGRESS:
                return None
            return {**old, "response": {**old["response"], "status": "cancelled"}}
        return await self._update(response_id, change)

    async def _update(self, response_id: str, change: Callable[[dict | None], dict | None]) -> dict | None:
        """Read, change and write one record atomically (WATCH/MULTI, retried on a concurrent write); `change`
        returns None to leave it as it is."""
        key = self.prefix + response_id
        with _retryable("updated"):
            return await self._update_watched(key, change)

    async def _update_watched(self, key: str, change: Callable[[dict | None], dict | None]) -> dict | None:
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    old = json.loads(raw) if raw is not None else None
                    new = change(old)
                    if new is None:
                        await pipe.unwatch()
                        return old
                    pipe.multi()
                    pipe.set(key, json.dumps(new, ensure_ascii=False), px=self.ttl_ms)
                    await pipe.execute()
                    return new
                except aioredis.WatchError:
                    continue

    async def close(self) -> None:
        await self.redis.aclose()
