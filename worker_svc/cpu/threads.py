"""How many OpenMP threads a small CPU step runs on: all of the worker's, or one fewer, whichever has been faster
lately on this box for steps of that size.

A step of few tokens is ~300 short parallel regions, each ending at a barrier. Where the worker has the cores
to itself, every thread helps (2 cores, serving at concurrency 1: a forward took 16-19 ms on 2 threads against
20-22 ms on 1); where other processes want the same cores (several workers on one host, a busy test run, a
hypervisor taking time), the thread they preempt holds the others at each barrier, and one thread fewer can be faster
(wave 4 measured 17 ms on 1 thread against 25 ms on 2, when each gRPC thread had its own OpenMP pool). Which case
holds changes with the load, so the worker times both: most small steps run on the count with the lower median over
its last few steps, and one in `trial_every` runs on the other, to keep its times current (a median, because one
step the kernel preempted for a while must not move the choice). Large steps have long regions and always
use every thread. The choice does not change a result: the bundled model's forward gave the same bits on 1 and 2
threads (bfloat16 and float32, batches of 1 to 64 decodes).

Times are kept per size class (1, 2-3, 4-7, 8-15, 16-31 tokens), so a step of 16 decodes is never compared with one
of 1; and each count serves `first_steps` steps of a class, in turns, before either is preferred there. A 1.2B
model's first decode after its prefills took 1.57 s on 2 threads where the next three took 0.68-0.73 s: judged on
that one step, as this chose before, every later decode ran on 1 thread, the other tried once in 32 steps.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

SMALL_STEP_TOKENS = 32  # steps below this many tokens are small


def size_class(num_tokens: int) -> int:
    """1 -> 1, 2-3 -> 2, 4-7 -> 3, 8-15 -> 4, 16-31 -> 5: steps whose times are compared with each other."""
    return num_tokens.bit_length()


@dataclass
class SmallStepThreads:
    most: int  # the worker's intra-op threads
    trial_every: int = 16
    window: int = 8  # the steps of each count whose median is compared
    first_steps: int = 3  # each count's steps of a class before either is preferred there (a median of 3)
    recent_s: dict[tuple[int, int], deque[float]] = field(default_factory=dict)  # (class, threads) -> last seconds
    small_steps: int = 0

    def _timed(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` tokens has a choice (small, and more than one thread to choose from)."""
        return num_tokens < SMALL_STEP_TOKENS and self.most > 1

    def choose(self, num_tokens: int) -> int:
        """The thread count for a step of `num_tokens` tokens."""
        if not self._timed(num_tokens):
            return self.most
        self.small_steps += 1
        size = size_class(num_tokens)
        counts = (self.most, self.most - 1)
        timed = {n: self.recent_s.get((size, n), ()) for n in counts}
        if any(len(t) < self.first_steps for t in timed.values()):  # in turns, every thread first
            return min(counts, key=lambda n: len(timed[n]))
        best, other = sorted(counts, key=lambda n: statistics.median(timed[n]))
        return other if self.small_steps % self.trial_every == 0 else best

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        """The time a step chosen by `choose` took."""
        if self._timed(num_tokens):
            self.recent_s.setdefault((size_class(num_tokens), threads), deque(maxlen=self.window)).append(seconds)
