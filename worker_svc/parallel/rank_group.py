"""A tensor-parallel worker group on torch.distributed: joining the process group, starting a host's ranks, and
sending each step's model inputs from rank 0 (the gRPC endpoint) to the other ranks.

The environment is torchrun's: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Model collectives
(all-reduce, logits gather) run on `nccl` for CUDA devices and `gloo` on CPU; the step messages always travel on a
gloo group, because they are small CPU arrays that rank 0 has before the forward starts.

Rank 0 sends what the forward needs after it built its inputs (token ids, positions, block tables, ...), not
the plan: the other ranks hold no batch state, only their shard of the weights and of the KV pool, whose block
tables are rank 0's. While idle, rank 0 sends a heartbeat every `HEARTBEAT_S`, so a rank waiting for the next
step can tell a quiet group from a dead one within the process group timeout.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger("llmserve.worker.parallel")

HEARTBEAT_S = 2.0
_HEADER = 10  # int64 words: command, then the payload's part sizes
_STEP, _HEARTBEAT, _STOP = 1, 2, 3
_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass
class StepInputs:
    """What every rank needs for one forward (and the copy-on-write before it); int64 numpy arrays."""

    copy_src: np.ndarray
    copy_dst: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    query_lens: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray  # [num_seqs, max_blocks]
    logits_indices: np.ndarray
    lora_slots: np.ndarray = field(default_factory=lambda: _EMPTY)  # --enable-lora: each token's adapter slot
    lora_written: np.ndarray = field(default_factory=lambda: _EMPTY)  # LoraPool.sync_message
    state_slots: np.ndarray = field(default_factory=lambda: _EMPTY)  # hybrid models: each sequence's state slot
    state_ops: np.ndarray = field(default_factory=lambda: _EMPTY)  # worker_svc.core.state_ops.StateOps.pack

    def pack(self) -> tuple[np.ndarray, np.ndarray]:
        parts = (self.copy_src, self.copy_dst, self.input_ids, self.positions, self.query_lens, self.seq_lens,
                 self.block_tables.reshape(-1), self.logits_indices, self.lora_slots, self.lora_written,
                 self.state_slots, self.state_ops)
        header = np.zeros(_HEADER, dtype=np.int64)
        header[0] = _STEP
        header[1:4] = len(self.copy_src), len(self.input_ids), len(self.query_lens)
        header[4] = self.block_tables.shape[1] if self.block_tables.ndim == 2 else 0
        header[5:8] = len(self.logits_indices), len(self.lora_slots), len(self.lora_written)
        header[8:10] = len(self.state_slots), len(self.state_ops)
        return header, np.concatenate([np.asarray(p, dtype=np.int64).reshape(-1) for p in parts])

    @staticmethod
    def unpack(header: np.ndarray, payload: np.ndarray) -> StepInputs:
        n_copy, n_tok, n_seq, width, n_logits, n_slots, n_written, n_state, n_ops = (int(x) for x in header[1:10])
        sizes = [n_copy, n_copy, n_tok, n_tok, n_seq, n_seq, n_seq * width, n_logits, n_slots, n_written, n_state,
                 n_ops]
        a, b, c, d, e, f, g, h, i, j, k, m = np.split(payload, np.cumsum(sizes)[:-1])
        return StepInputs(a, b, c, d, e, f, g.reshape(n_seq, width), h, i, j, k, m)

    @staticmethod
    def payload_len(header: np.ndarray) -> int:
        n_copy, n_tok, n_seq, width, n_logits, n_slots, n_written, n_state, n_ops = (int(x) for x in header[1:10])
        return 2 * n_copy + 2 * n_tok + 2 * n_seq + n_seq * width + n_logits + n_slots + n_written + n_state + n_ops


def step_inputs(copies: tuple[np.ndarray, np.ndarray], inputs, lora_slots: np.ndarray = _EMPTY,
                lora_written: np.ndarray = _EMPTY, state_ops: np.ndarray = _EMPTY) -> StepInputs:
    """The message for the other ranks from rank 0's built model inputs (worker_svc.core.step_inputs.ModelInputs, or
    None for a step that only copies blocks or state slots): whatever the plan's encoding, this is what the forward
    reads."""
    if inputs is None:
        return StepInputs(copies[0], copies[1], _EMPTY, _EMPTY, _EMPTY, _EMPTY, np.zeros((0, 0), np.int64), _EMPTY,
                          lora_slots, lora_written, _EMPTY, state_ops)
    meta = inputs.attn_metadata

    def host(t: torch.Tensor) -> np.ndarray:
        return t.cpu().numpy().astype(np.int64, copy=False)

    return StepInputs(copies[0], copies[1], host(inputs.input_ids), host(inputs.positions),
                      np.diff(host(meta.cu_seqlens_q)), host(meta.seq_lens), host(meta.block_tables),
                      host(inputs.logits_indices), lora_slots, lora_written,
                      _EMPTY if inputs.state is None else host(inputs.state.slots), state_ops)


class RankGroup:
    """This process's place in the group and its collectives (the model's `Collectives`)."""

    def __init__(self, rank: int, size: int, local_rank: int, device: torch.device,
                 group: dist.ProcessGroup | None = None, control: dist.ProcessGroup | None = None):
        """group: the model's collectives (default: the whole world); control: the gloo group of step messages."""
        self.rank, self.size, self.local_rank, self.device = rank, size, local_rank, device
        self.group, self.control = group, control
        self.lock = threading.Lock()  # rank 0: one message (step or heartbeat) on the wire at a time
        self.last_send = time.monotonic()
        self.local_size = 1  # this host's ranks (start_group sets it)
        self.local_procs: list[subprocess.Popen] = []  # this host's other ranks, when this process started them
        self.before_exit: list = []  # callables run when the group fails (rank 0: health NOT_SERVING)
        self.stopping = False  # an orderly stop: ranks exiting now are not a failure

    @classmethod
    def join(cls, rank: int, size: int, local_rank: int, device: torch.device, timeout_s: float,
             store: dist.Store | None = None) -> RankGroup:
        """Join the torch.distributed world (MASTER_ADDR / MASTER_PORT rendezvous, or `store`): nccl on CUDA, else
        gloo."""
        timeout = timedelta(seconds=timeout_s)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=size, timeout=timeout, store=store)
        # Step messages on CPU tensors, whatever the model's backend.
        control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
        return cls(rank, size, local_rank, device, None, control)

    # ------------------------------------------------------------- model collectives

    def all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.group)

    def gather_to_first(self, t: torch.Tensor) -> torch.Tensor | None:
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(t, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def all_gather_int(self, value: int) -> list[int]:
        t = torch.tensor([value], dtype=torch.int64)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(out, t, group=self.control)
        return [int(x.item()) for x in out]

    # ------------------------------------------------------------- step messages

    def send_step(self, inputs: StepInputs) -> None:
        """Rank 0, holding `lock`: the inputs of the forward it is about to run."""
        header, payload = inputs.pack()
        self._broadcast(header)
        if len(payload):
            self._broadcast(payload)

    def send(self, command: int) -> None:
        self._broadcast(np.array([command] + [0] * (_HEADER - 1), dtype=np.int64))

    def receive(self) -> StepInputs | None:
        """Other ranks: the next step's inputs, or None when rank 0 stops the group. Heartbeats are skipped."""
        while True:
            header = self._broadcast(np.zeros(_HEADER, dtype=np.int64))
            if header[0] == _STOP:
                self.stopping = True
                return None
            if header[0] == _STEP:
                n = StepInputs.payload_len(header)
                payload = self._broadcast(np.zeros(n, dtype=np.int64)) if n else np.zeros(0, dtype=np.int64)
                return StepInputs.unpack(header, payload)

    def _broadcast(self, a: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(a)
        dist.broadcast(t, src=0, group=self.control)
        self.last_send = time.monotonic()
        return t.numpy()

    def start_heartbeat(self, on_failure) -> None:
        """Rank 0: a daemon thread that keeps the other ranks' waits short while no step comes."""
        def beat() -> None:
            while True:
                time.sleep(HEARTBEAT_S / 4)
                with self.lock:
                    if self.stopping:
                        return
                    if time.monotonic() - self.last_send < HEARTBEAT_S:
                        continue
                    try:
                        self.send(_HEARTBEAT)
                    except Exception as e:  # a rank is gone: the group ends
                        on_failure(f"heartbeat to the other ranks failed: {e}")
                        return

        threading.Thread(target=beat, name="tp-heartbeat", daemon=True).start()

    def fail(self, message: str) -> None:
        """The group cannot go on (a rank died, hung or failed a collective): end this process and its ranks."""
        for hook in self.before_exit:
            try:
                hook()
            except Exception:  # exiting anyway
                pass
        end_group(self.local_procs, message)

    def stop_others(self) -> None:
        self.stopping = True
        with self.lock:
            try:
                self.send(_STOP)
            except Exception:  # already gone
                pass


# ---------------------------------------------------------------------- launching


@dataclass
class GroupPlacement:
    """Where this process sits: global rank and world size, this host's ranks, the rendezvous address."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    master_addr: str
    master_port: int | None  # None: one host, rank 0 picks a free port for its rendezvous store
    under_torchrun: bool  # the ranks were started by torchrun (one process per rank); else this host starts them


def placement(tensor_parallel_size: int, nnodes: int, node_rank: int, master_addr: str,
              master_port: int | None) -> GroupPlacement:
    """From torchrun's environment when it is set, else from the flags (this process is its host's first rank).
    Raises ValueError naming the flag when the numbers do not fit together."""
    n = tensor_parallel_size
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        size = int(env["WORLD_SIZE"])
        if size != n:
            raise ValueError(f"--tensor-parallel-size {n} does not match the WORLD_SIZE {size} that torchrun "
                             f"started")
        local_size = int(env.get("LOCAL_WORLD_SIZE", size))
        return GroupPlacement(int(env["RANK"]), size, int(env.get("LOCAL_RANK", 0)), local_size,
                              env.get("MASTER_ADDR", master_addr), int(env.get("MASTER_PORT", master_port or 29500)),
                              True)
    if nnodes < 1 or n % nnodes:
        raise ValueError(f"--nnodes {nnodes} must divide --tensor-parallel-size {n}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} must be in [0, --nnodes {nnodes})")
    if nnodes > 1 and master_port is None:
        raise ValueError("--master-port is needed with --nnodes > 1 (the same on every host)")
    local_size = n // nnodes
    return GroupPlacement(node_rank * local_size, n, 0, local_size, master_addr, master_port, False)


def start_local_ranks(p: GroupPlacement) -> list[subprocess.Popen]:
    """This host's other ranks: the same command line as this process, with torchrun's variables set."""
    procs = []
    for local in range(1, p.local_size):
        env = dict(os.environ, RANK=str(p.rank + local), WORLD_SIZE=str(p.size), LOCAL_RANK=str(local),
                   LOCAL_WORLD_SIZE=str(p.local_size), MASTER_ADDR=p.master_addr, MASTER_PORT=str(p.master_port),
                   LLMSERVE_TP_PARENT=str(os.getpid()))
        procs.append(subprocess.Popen([sys.executable, "-m", "llmserve.cli", *sys.argv[1:]], env=env,
                                      stdin=subprocess.DEVNULL))
    os.environ.update(MASTER_ADDR=p.master_addr, MASTER_PORT=str(p.master_port))
    return procs


def watch_children(group: RankGroup) -> None:
    """A daemon thread: any local rank that exits, other than in an orderly stop, ends the group."""
    procs = group.local_procs

    def watch() -> None:
        while True:
            for proc in procs:
                code = proc.poll()
                if code is not None and not (code == 0 and group.stopping):
                    group.fail(f"rank process {proc.pid} exited with {code}")
                    return
            time.sleep(0.2)

    if procs:
        threading.Thread(target=watch, name="tp-watch", daemon=True).start()


def watch_parent(on_failure) -> None:
    """A rank started by its host's first rank ends when that process is gone (even if killed -9)."""
    parent = os.environ.get("LLMSERVE_TP_PARENT")
    if not parent:
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(0.2)
        on_failure(f"the rank that started this one (pid {parent}) is gone")

    threading.Thread(target=watch, name="tp-parent", daemon=True).start()


def end_group(procs: list[subprocess.Popen], message: str, code: int = 1) -> None:
    """Fail fast: log, kill this host's other ranks, exit without waiting for stuck collectives."""
    log.error("tensor-parallel group ends: %s", message)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start_group(tensor_parallel_size: int, nnodes: int, node_rank: int, master_addr: str, master_port: int | None,
                device: torch.device, timeout_s: float) -> RankGroup | None:
    """Join (and, on this host, first start) the worker group; None for a one-process worker.

    Raises ValueError naming the flag when the numbers do not fit, or when the ranks that joined do not agree on
    the world size."""
    if tensor_parallel_size == 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None
    p = placement(tensor_parallel_size, nnodes, node_rank, master_addr, master_port)
    store = None
    if not p.under_torchrun or "LLMSERVE_TP_PARENT" in os.environ:
        # Ranks started by llmserve meet at rank 0's store; with no --master-port on a port the OS picks (no race
        # for a free one). Under torchrun, its environment (env://) is the rendezvous.
        store = dist.TCPStore(p.master_addr, p.master_port or 0, p.size, is_master=p.rank == 0,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        p.master_port = store.port
    procs = [] if p.under_torchrun else start_local_ranks(p)
    if device.type == "cuda":
        device = torch.device("cuda", p.local_rank)
    elif "OMP_NUM_THREADS" not in os.environ:  # (torchrun sets it) the host's cores shared among its ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // p.local_size))
    # From the start: a rank whose starter dies while it still waits for the others to join exits at once.
    watch_parent(lambda message: end_group(procs, message))
    try:
        group = RankGroup.join(p.rank, p.size, p.local_rank, device, timeout_s, store)
    except Exception as e:
        end_group(procs, f"rank {p.rank} could not join the group of --tensor-parallel-size {p.size} at "
                         f"{p.master_addr}:{p.master_port} within {timeout_s:.0f} s: {e}")
    group.local_procs, group.local_size = procs, p.local_size
    sizes = group.all_gather_int(tensor_parallel_size)
    if len(set(sizes)) > 1:
        group.fail(f"the ranks were started with different --tensor-parallel-size values: {sizes} (by rank)")
    watch_children(group)
    log.info("rank %d of %d joined (%s, %s:%d)", p.rank, p.size, "nccl" if device.type == "cuda" else "gloo",
             p.master_addr, p.master_port)
    return group


def run_follower(runner) -> None:
    """A rank other than 0: run rank 0's steps until it stops the group; exit non-zero when the group fails."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: rank 0 stops the group in order
    group = runner.group
    if group.rank == group.local_rank:
        # On rank 0's host a launcher may signal every local rank (torchrun's agent sends each SIGTERM): rank 0
        # drains and stops the group, where a follower that died first would fail the ranks on other hosts.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        runner.follow()
    except Exception as e:
        group.fail(f"rank {group.rank}: {e}")
    for proc in group.local_procs:
        proc.wait()
    log.info("rank %d: stopped by rank 0", group.rank)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # now: tearing down the process group could wait on ranks that are exiting too
