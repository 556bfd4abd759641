"""The stack a chaos run breaks, and the faults: a primary + replica + three Sentinels (tests/support/redis_ha.py),
one worker on a fixed port, a leader and a standby scheduler in one namespace (found through the Sentinels) behind
the Forwarder, and the HTTP API on the forwarder's address. Each fault returns once the stack serves again.

Every restart happens on the process's port and log file (the log says what each run of it did)."""

from __future__ import annotations

import os
import signal
import time

import psutil

from experiments.chaos_kit.forwarder import Forwarder
from llmserve.processes import Proc, free_port, health, kill, start_api, start_scheduler, start_worker, stop
from tests.support.redis_ha import RedisHA

LEASE_TTL_MS = 1500
PARTITION_S = 3.0  # how long a SIGSTOPped primary stays stopped: past the Sentinels' down-after (1 s)
RECOVER_TIMEOUT_S = 240.0


class Stack:
    def __init__(self, root: str, durability: str, worker_args: list, tensor_parallel_size: int = 1):
        self.root, self.durability = root, durability
        os.makedirs(root, exist_ok=True)
        self.group = RedisHA(os.path.join(root, "redis"))
        self.worker_port = free_port()
        self.worker_args = [*map(str, worker_args), "--tensor-parallel-size", str(tensor_parallel_size)]
        self.worker = self._start_worker()
        self.namespace = f"chaos-{durability}"
        flags = ["--redis-sentinel", self.group.sentinel_spec, "--redis-sentinel-master", self.group.master_name,
                 "--lease-ttl-ms", LEASE_TTL_MS, "--debug-invariants", "--redis-durability", durability]
        if durability == "replica":
            flags += ["--redis-min-replicas", 1]
        self.sched_flags = flags
        self.schedulers: list[Proc] = []
        for i in range(2):
            port, metrics = free_port(), free_port()
            self.schedulers.append(self._start_scheduler(port, metrics, os.path.join(root, f"scheduler-{i}.log")))
        self.forwarder = Forwarder([s.address for s in self.schedulers])
        self.wait_serving()
        self.api = start_api(self.forwarder.address, ["--reattach-timeout", 300],
                             log_path=os.path.join(root, "api.log"))

    # ---- processes -------------------------------------------------------------------------------------------

    def _start_worker(self) -> Proc:
        return start_worker(self.worker_args, port=self.worker_port, timeout=600,
                            log_path=os.path.join(self.root, "worker.log"))

    def _start_scheduler(self, port: int, metrics_port: int, log_path: str) -> Proc:
        proc = start_scheduler("", f"127.0.0.1:{self.worker_port}",
                               [*self.sched_flags, "--metrics-port", metrics_port], namespace=self.namespace,
                               port=port, log_path=log_path)
        proc.extra["metrics_port"] = metrics_port
        return proc

    def processes(self) -> dict[str, int]:
        """name -> pid of every process of the stack now (for memory sampling)."""
        out = {f"redis-{port}": node.pid for port, node in self.group.nodes.items() if node.alive()}
        out.update({f"sentinel-{i}": s.pid for i, s in enumerate(self.group.sentinels)})
        out.update({f"scheduler-{i}": s.pid for i, s in enumerate(self.schedulers) if s.alive()})
        out["worker"], out["api"] = self.worker.pid, self.api.pid
        return out

    def leader(self) -> Proc | None:
        return next((s for s in self.schedulers if s.alive() and health(s.address, timeout=1) == "SERVING"), None)

    def wait_serving(self, timeout: float = RECOVER_TIMEOUT_S) -> Proc:
        """Until a scheduler answers SERVING and the forwarder sends new connections to it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lead = self.leader()
            if lead is not None and self.forwarder.serving == lead.address:
                return lead
            time.sleep(0.1)
        raise TimeoutError(f"no scheduler SERVING within {timeout:.0f}s")

    def stop(self) -> None:
        self.forwarder.stop()
        for proc in [self.api, *self.schedulers, self.worker]:
            stop(proc)
        self.group.stop()

    # ---- faults: each returns once the stack serves again ------------------------------------------------------

    def kill_primary(self) -> dict:
        old = self.group.master_port()
        self.group.nodes[old].popen.send_signal(signal.SIGKILL)
        new = self.group.wait_failover(old, timeout=RECOVER_TIMEOUT_S)
        self.group.restart(old)  # back on its port and files: the Sentinels make it a replica
        settled = self.group.wait_settled(timeout=RECOVER_TIMEOUT_S)
        self.wait_serving()
        return {"old_primary": old, "new_primary": new, "settled_on": settled}

    def stop_primary(self) -> dict:
        """A partition: the primary SIGSTOPped past the Sentinels' down-after, then SIGCONT (it rejoins as a
        replica and drops what it accepted while cut off)."""
        old = self.group.master_port()
        pid = self.group.nodes[old].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(PARTITION_S)
            new = self.group.wait_failover(old, timeout=RECOVER_TIMEOUT_S)
        finally:
            os.kill(pid, signal.SIGCONT)
        self.group.wait_replica_of(old, new, timeout=RECOVER_TIMEOUT_S)
        self.wait_serving()
        return {"old_primary": old, "new_primary": new}

    def kill_scheduler(self) -> dict:
        """SIGKILL of the leader; the standby takes the lease, the killed one comes back as the new standby."""
        lead = self.wait_serving()
        i = self.schedulers.index(lead)
        kill(lead)
        self.schedulers[i] = self._start_scheduler(lead.port, lead.extra["metrics_port"], lead.log_path)
        new = self.wait_serving()
        return {"killed": f"scheduler-{i}", "now_leading": f"scheduler-{self.schedulers.index(new)}"}

    def kill_worker(self) -> dict:
        kill(self.worker)
        self.worker = self._start_worker()
        self.wait_serving()
        return {"worker_port": self.worker_port}

    def kill_tp_rank(self) -> dict:
        """SIGKILL of a tensor-parallel rank other than rank 0: the group ends (the worker exits), it is restarted."""
        ranks = [c for c in psutil.Process(self.worker.pid).children(recursive=True) if "python" in c.name()]
        if not ranks:
            raise RuntimeError("the worker has no rank processes: --tensor-parallel-size 2 or more is needed")
        ranks[-1].kill()
        try:
            self.worker.popen.wait(timeout=RECOVER_TIMEOUT_S)
        finally:
            kill(self.worker)
        self.worker = self._start_worker()
        self.wait_serving()
        return {"rank_pid": ranks[-1].pid}

    def inject(self, kind: str) -> dict:
        return {"primary-kill": self.kill_primary, "primary-stop": self.stop_primary,
                "scheduler-kill": self.kill_scheduler, "worker-kill": self.kill_worker,
                "tp-rank-kill": self.kill_tp_rank}[kind]()
