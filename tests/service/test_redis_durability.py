"""`--redis-durability` and `--redis-sentinel` at the Redis edge, against real redis-server processes: what `local`
requires of the primary (refused at start naming the flag and the server setting), the `replica` wait failing a
commit when too few replicas acknowledge it and passing once one does, and the flags' validation."""

from __future__ import annotations

import time

import pytest
import redis

from common.validation import ConfigError
from llmserve.processes import start_redis, stop
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.ledger.redis_ha import Durability, DurabilityError, parse_sentinels, redis_unavailable
from scheduler_svc.ledger.store import RedisLedger, StepCommit

HOLDER, TTL_MS = "test-holder", 10_000


@pytest.fixture
def node(tmp_path):
    started = []

    def start(*args, appendonly=False):
        proc = start_redis(str(tmp_path / f"r{len(started)}"), appendonly=appendonly, extra_args=args)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        stop(proc, timeout=5)


def test_local_durability_needs_an_fsynced_append_only_file(node):
    plain = redis.Redis(port=node().port)
    with pytest.raises(ConfigError, match=r"--redis-durability local needs `appendonly yes`.*appendonly no"):
        Durability("local").check(plain)
    everysec = redis.Redis(port=node("--appendfsync", "everysec", appendonly=True).port)
    version = everysec.info("server")["redis_version"]
    if tuple(int(x) for x in version.split(".")[:2]) < (7, 2):
        with pytest.raises(ConfigError, match=r"`appendfsync always`.*appendfsync everysec"):
            Durability("local").check(everysec)
    always = redis.Redis(port=node("--appendfsync", "always", appendonly=True).port)
    d = Durability("local")
    d.check(always)  # accepted
    Durability("none").check(plain)  # nothing asked of the server
    Durability("replica").check(plain)  # replicas are counted per commit, not at start


def test_replica_durability_fails_a_commit_no_replica_acknowledged(node):
    primary = node()
    ledger = RedisLedger(redis.Redis(port=primary.port), namespace="dur",
                         durability=Durability("replica", min_replicas=1, timeout_ms=200))
    ledger.init_pool(16, 16)
    token = ledger.try_acquire_lease(HOLDER, TTL_MS)
    with pytest.raises(DurabilityError, match="only 0 of --redis-min-replicas 1"):
        ledger.commit_step(HOLDER, token, TTL_MS, StepCommit(step_id=1, arrival_seq=0))
    replica = redis.Redis(port=node("--replicaof", "127.0.0.1", str(primary.port)).port)
    deadline = time.monotonic() + 30
    while replica.info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, "the replica did not sync"
        time.sleep(0.05)
    patient = RedisLedger(redis.Redis(port=primary.port), namespace="dur",  # a loaded box may take a while to ack
                          durability=Durability("replica", min_replicas=1, timeout_ms=10_000))
    patient.commit_step(HOLDER, token, TTL_MS, StepCommit(step_id=2, arrival_seq=0))
    assert replica.hget(ledger.k_meta, "step_id") == b"2"  # acknowledged: on the replica before the call returned
    two = RedisLedger(redis.Redis(port=primary.port), namespace="dur",
                      durability=Durability("replica", min_replicas=2, timeout_ms=100))
    with pytest.raises(DurabilityError, match="only 1 of --redis-min-replicas 2"):
        two.commit_step(HOLDER, token, TTL_MS, StepCommit(step_id=3, arrival_seq=0))


def test_errors_that_mean_redis_cannot_take_writes_now():
    assert redis_unavailable(redis.ConnectionError("gone"))
    assert redis_unavailable(DurabilityError("short"))
    assert redis_unavailable(redis.ResponseError("NOREPLICAS Not enough good replicas to write."))
    assert redis_unavailable(redis.ReadOnlyError("You can't write against a read only replica."))
    assert not redis_unavailable(redis.ResponseError("ERR wrong number of arguments"))
    assert not redis_unavailable(ValueError("bug"))


def test_sentinel_flags_are_validated():
    assert parse_sentinels("10.0.0.1:26379, sentinel-b:26379,[::1]:26380") == [
        ("10.0.0.1", 26379), ("sentinel-b", 26379), ("::1", 26380)]
    for bad in ("sentinel", "host:port", "host:0", "a:26379,"):
        with pytest.raises(ConfigError, match="--redis-sentinel"):
            SchedulerConfig(redis_sentinel=bad).validate()
    with pytest.raises(ConfigError, match="--redis-min-replicas"):
        SchedulerConfig(redis_min_replicas=0).validate()
    SchedulerConfig(redis_sentinel="127.0.0.1:26379", redis_durability="replica").validate()
