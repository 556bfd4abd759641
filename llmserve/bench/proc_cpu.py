"""CPU seconds of a server's processes while a load runs, by process (Linux /proc): what llmserve's API, scheduler,
worker and Redis spend per output token next to vLLM's API server and engine core, or llama.cpp's one process; and
the host memory each process holds and has held (`memory`).

On a machine whose cores the model's threads use, every other process's CPU time is taken from the forward: the
front ends' cost is measured as CPU time, not wall time, because the box is shared.
"""

from __future__ import annotations

import os

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds of all its threads), or None for a process gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name may hold spaces and parentheses
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS


def label(argv: list[str]) -> str:
    """A process's role from its command line: the program, or for an interpreter the module or script it runs,
    and the subcommand after it (`python -m llmserve.cli worker ...` -> "worker", `.../vllm serve` -> "vllm serve",
    `VLLM::EngineCore` -> itself). llmserve's own prefix is left off: "serve" is the scheduler's process."""
    if not argv:
        return "?"
    words = argv
    if os.path.basename(argv[0]).startswith("python"):
        rest = argv[1:]
        if rest[:1] == ["-c"]:  # inline code: nothing names it but the interpreter
            return "python -c"
        if rest[:1] == ["-m"]:
            rest = rest[1:]
        words = rest or argv
    head = os.path.basename(words[0])
    sub = next((w for w in words[1:2] if not w.startswith("-") and "/" not in w and ":" not in w), None)
    name = f"{head} {sub}" if sub else head
    for prefix in ("llmserve.cli ", "llmserve "):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    parts = [p.decode(errors="replace") for p in raw.split(b"\0") if p]
    return parts[0].split() if len(parts) == 1 else parts  # a retitled process (setproctitle) is one string


def snapshot(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (label, CPU seconds so far) for `root` and every process descended from it."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            parent[int(name)], cpu[int(name)] = st
    tree, frontier = {root}, [root]
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in tree:
                tree.add(child)
                frontier.append(child)
    return {pid: (label(_argv(pid)), cpu[pid]) for pid in tree if pid in cpu}


def spent(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per label between two snapshots (a process that started in between counts whole; one that ended
    in between is not seen)."""
    out: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        out[name] = out.get(name, 0.0) + seconds - before.get(pid, (name, 0.0))[1]
    return out


def memory(root: int) -> dict[str, dict[str, int]]:
    """label -> {"peak_rss", "rss"} bytes (VmHWM, VmRSS) summed over `root`'s process tree: read right after a
    server is ready, the peak is what its load and start-up (weights, KV cache) took of host memory."""
    out: dict[str, dict[str, int]] = {}
    for pid, (name, _) in snapshot(root).items():
        fields = {}
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key in ("VmHWM", "VmRSS"):
                        fields[key] = int(value.split()[0]) * 1024
        except OSError:
            continue
        entry = out.setdefault(name, {"peak_rss": 0, "rss": 0})
        entry["peak_rss"] += fields.get("VmHWM", 0)
        entry["rss"] += fields.get("VmRSS", 0)
    return out
