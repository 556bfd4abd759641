"""Taking a pool over after a Redis fail-over: is the promoted primary behind what this scheduler committed?

Replication is asynchronous (unless --redis-durability replica), so the replica that Sentinel promotes may lack the
last steps the old primary acknowledged, and whose tokens this scheduler published. The ledger's `step_id` says
how far it got. Nothing is rewritten from memory: every running request resumes from what the ledger holds and
the lost tokens are computed again; a request the ledger lacks entirely is submitted again by its re-attaching
client. Greedy and seeded sampling give the same tokens again (the sampler's draw depends on the seed and the
token's position only). An unseeded request got its seed at admission, stored with it: the same tokens too, unless
its admission was among the lost steps (a new seed is drawn when it is submitted again). The re-attaching client
compares what it is sent again with what it saw (common/client.py raises StreamDiverged instead of accepting it).
"""

from __future__ import annotations

import logging

log = logging.getLogger("llmserve.scheduler")


def steps_lost(last_committed: int | None, ledger_step: int) -> int:
    """How many of this scheduler's committed steps the ledger lacks (0: none, or we never committed)."""
    return 0 if last_committed is None else max(0, last_committed - ledger_step)


def report_behind(last_committed: int | None, ledger_step: int, prefix: str, metrics) -> int:
    """Log and count a ledger found behind our last commit; returns the number of lost steps."""
    lost = steps_lost(last_committed, ledger_step)
    if lost:
        log.warning("pool %s: Redis holds step %d but this scheduler committed up to step %d (a fail-over promoted "
                    "a replica that had not received the last %d steps); resuming from the ledger: greedy and "
                    "seeded requests recompute the same tokens", prefix, ledger_step, last_committed, lost)
        metrics.ledger_rolled_back(lost)
    return lost
