"""How many OpenMP threads a small CPU step runs on: all of the worker's, or one fewer, whichever has been faster
lately on this box.

A step of few tokens is ~300 short parallel regions, each ending at a barrier. Where the worker has the cores
to itself, every thread helps (2 cores, serving at concurrency 1: a forward took 16-19 ms on 2 threads against
20-22 ms on 1); where other processes want the same cores (several workers on one host, a busy test run, a
hypervisor taking time), the thread they preempt holds the others at each barrier, and one thread fewer can be faster
(wave 4 measured 17 ms on 1 thread against 25 ms on 2, when each gRPC thread had its own OpenMP pool). Which case
holds changes with the load, so the worker times both: most small steps run on the count with the lower median over
its last few steps, and one in `trial_every` runs on the other, to keep its times current (a median, because one
step the kernel preempted for a while must not move the choice). Large steps have long regions and always
use every thread. The choice does not change a result: the bundled model's forward gave the same bits on 1 and 2
threads (bfloat16 and float32, batches of 1 to 64 decodes)."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

SMALL_STEP_TOKENS = 32  # steps below this many tokens are small


@dataclass
class SmallStepThreads:
    most: int  # the worker's intra-op threads
    trial_every: int = 32
    window: int = 8  # the steps of each count whose median is compared
    recent_s: dict[int, deque[float]] = field(default_factory=dict)  # threads -> its last small steps' seconds
    small_steps: int = 0

    def _timed(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` tokens has a choice (small, and more than one thread to choose from)."""
        return num_tokens < SMALL_STEP_TOKENS and self.most > 1

    def choose(self, num_tokens: int) -> int:
        """The thread count for a step of `num_tokens` tokens."""
        if not self._timed(num_tokens):
            return self.most
        self.small_steps += 1
        counts = (self.most, self.most - 1)
        for n in counts:  # each count is timed once before either is preferred
            if n not in self.recent_s:
                return n
        best, other = sorted(counts, key=lambda n: statistics.median(self.recent_s[n]))
        return other if self.small_steps % self.trial_every == 0 else best

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        """The time a step chosen by `choose` took."""
        if self._timed(num_tokens):
            self.recent_s.setdefault(threads, deque(maxlen=self.window)).append(seconds)
