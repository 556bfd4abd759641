"""A replicated Redis for fail-over tests: a primary, a replica and three Sentinels, all redis-server processes on
loopback (`redis-server FILE --sentinel`), with short Sentinel timeouts so a fail-over takes a few seconds.

    group = RedisHA(tmp_path)                      # waits until every Sentinel knows the primary and its replica
    group.sentinel_spec, group.master_name         # for --redis-sentinel / --redis-sentinel-master
    group.master_port()                            # the primary's port as a Sentinel reports it
    group.wait_failover(old_port)                  # until the Sentinels name another primary, which says so
    group.wait_settled()                           # until one primary has every other data node replicating it
    group.restart(port)                            # a killed data node, on its port and append-only file
    group.restart(port, replica_of=primary)        # the same, already replicating (what the Sentinels would make it)
    group.reset()                                  # back to a fresh group's state, for the next test of a module
    group.stop()

(PYTEST_DONT_REWRITE: no asserts here.)
"""

from __future__ import annotations

import os
import time

import redis

from llmserve.processes import Proc, ProcError, RedisServer, free_port, spawn, start_redis, stop

MASTER = "llmserve-ha"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000


def _wait(what: str, cond, timeout: float = 60.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = cond()
        except redis.RedisError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def restart_redis(data_dir: str, port: int, extra_args=()) -> RedisServer:
    """redis-server on `port` and the files in `data_dir` again, right after the previous one there was killed: the
    port may take a moment to be free."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return start_redis(data_dir, port=port, extra_args=extra_args)
        except ProcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class RedisHA:
    def __init__(self, root, data_args=("--appendonly", "yes", "--appendfsync", "always")):
        self.root = str(root)
        self.data_args = list(data_args)
        self.nodes: dict[int, RedisServer] = {}
        primary = self._data_node(free_port())
        self._data_node(free_port(), replica_of=primary.port)
        self.sentinels: list[Proc] = [self._sentinel(primary.port) for _ in range(3)]
        self.master_name = MASTER
        self.sentinel_spec = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        _wait("the replica in sync", lambda: self.client(self.replica_port()).info("replication")
              .get("master_link_status") == "up")
        _wait("every Sentinel knowing the primary, its replica and the other Sentinels",
              lambda: all(self._sentinel_ready(s.port) for s in self.sentinels))

    # ---- processes -------------------------------------------------------------------------------------------

    def _data_node(self, port: int, replica_of: int | None = None) -> RedisServer:
        extra = [*self.data_args, "--replica-announce-ip", "127.0.0.1"]
        if replica_of is not None:
            extra += ["--replicaof", "127.0.0.1", str(replica_of)]
        node = start_redis(os.path.join(self.root, f"redis-{port}"), port=port, extra_args=extra)
        self.nodes[port] = node
        return node

    def _sentinel(self, primary_port: int) -> Proc:
        port = free_port()
        d = os.path.join(self.root, f"sentinel-{port}")
        os.makedirs(d, exist_ok=True)
        conf = os.path.join(d, "sentinel.conf")  # Sentinel rewrites its file: each has its own
        with open(conf, "w") as f:
            f.write(f"port {port}\nbind 127.0.0.1\ndir {d}\nsentinel announce-ip 127.0.0.1\n"
                    f"sentinel monitor {MASTER} 127.0.0.1 {primary_port} 2\n"
                    f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
                    f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n"
                    f"sentinel parallel-syncs {MASTER} 1\n")
        binary = os.environ.get("LLMSERVE_REDIS_SERVER") or "redis-server"
        proc = spawn("sentinel", [binary, conf, "--sentinel"], log_path=os.path.join(d, "sentinel.log"), port=port)
        _wait(f"Sentinel on {port}", lambda: redis.Redis(port=port).ping(), timeout=20)
        return proc

    def _sentinel_ready(self, port: int) -> bool:
        s = redis.Redis(port=port, decode_responses=True)
        master = s.sentinel_master(MASTER)
        return int(master["num-slaves"]) >= 1 and int(master["num-other-sentinels"]) >= 2

    def restart(self, port: int, replica_of: int | None = None) -> RedisServer:
        """Start a killed data node again on its port and files; the Sentinels make it a replica of the primary,
        seconds later (they wait a few publish periods before correcting a node that says it is a primary).
        `replica_of`: start it as that node's replica, as the Sentinels would have made it, without the wait."""
        old = self.nodes[port]
        return self._restart(port, old.data_dir, replica_of)

    def _restart(self, port: int, data_dir: str, replica_of: int | None = None) -> RedisServer:
        follow = [] if replica_of is None else ["--replicaof", "127.0.0.1", str(replica_of)]
        node = restart_redis(data_dir, port, [*self.data_args, "--replica-announce-ip", "127.0.0.1", *follow])
        self.nodes[port] = node
        return node

    def reset(self) -> int:
        """Back to the state a fresh group starts in, without starting one (a module's tests share a group): every
        data node running (a killed one restarted on its port and files), one primary with the other replicating it,
        the settings a test may change at their defaults again, no keys; the primary's port. Which node is primary
        stays the Sentinels' call, as it is in a fresh group's first fail-over."""
        for port, node in list(self.nodes.items()):
            if node.popen.poll() is not None:  # a test that failed before restarting what it killed
                primary = self.master_port()
                self.restart(port, replica_of=self.wait_failover(port) if primary == port else primary)
        for port in self.nodes:
            _wait(f"{port} answering", lambda p=port: self.client(p).ping())
            self.client(port).config_set("min-replicas-to-write", 0)
            self.client(port).config_set("min-replicas-max-lag", 10)
        primary = self.wait_settled()
        self.client(primary).flushall()
        _wait("the replicas empty", lambda: all(self.client(p).dbsize() == 0 for p in self.nodes))
        return primary

    def stop(self) -> None:
        for proc in [*self.sentinels, *self.nodes.values()]:
            stop(proc, timeout=5)

    # ---- state -----------------------------------------------------------------------------------------------

    @staticmethod
    def client(port: int, **kw) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=5, **kw)

    def master_port(self) -> int:
        """The primary as the first Sentinel that answers names it."""
        named = self._named_primaries()
        if not named:
            raise redis.ConnectionError("no Sentinel answered")
        return named[0]

    def replica_port(self) -> int:
        return next(p for p in self.nodes if p != self.master_port())

    def role(self, port: int) -> str:
        return self.client(port).execute_command("ROLE")[0].decode()

    def _named_primaries(self) -> list[int]:
        """The primary's port as each Sentinel that answers names it."""
        ports = []
        for s in self.sentinels:
            try:
                addr = redis.Redis(port=s.port, socket_timeout=2).sentinel_get_master_addr_by_name(MASTER)
                ports.append(int(addr[1]))
            except (redis.RedisError, TypeError):
                pass
        return ports

    def _replicates(self, port: int, primary: int) -> bool:
        info = self.client(port).info("replication")
        return (info.get("role") == "slave" and int(info.get("master_port", 0)) == primary
                and info.get("master_link_status") == "up")

    def wait_failover(self, old_port: int, timeout: float = 60.0) -> int:
        """Until a majority of Sentinels name a primary other than `old_port` and that node is a primary."""
        def promoted():
            new = [p for p in self._named_primaries() if p != old_port]
            return new[0] if len(new) >= 2 and self.role(new[0]) == "master" else None
        return _wait(f"a fail-over away from {old_port}", promoted, timeout)

    def wait_replica_of(self, port: int, primary: int, timeout: float = 60.0) -> None:
        _wait(f"{port} replicating {primary}", lambda: self._replicates(port, primary), timeout)

    def wait_settled(self, timeout: float = 60.0) -> int:
        """Until a majority of Sentinels name one primary, it says it is one, and every other data node replicates it
        with its link up; that primary's port. Which node it is is the Sentinels' call: on a loaded machine a freshly
        promoted primary can miss their pings for DOWN_AFTER_MS and be failed over again (back to a restarted node)."""
        def settled():
            named = self._named_primaries()
            primary = max(set(named), key=named.count, default=None)
            if primary is None or named.count(primary) < 2 or self.role(primary) != "master":
                return None
            return primary if all(self._replicates(p, primary) for p in self.nodes if p != primary) else None
        return _wait("one primary with every other data node replicating it", settled, timeout)
