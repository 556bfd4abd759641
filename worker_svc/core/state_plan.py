"""A plan's recurrent-state part, checked before anything is applied (hybrid models; worker_svc/state_cache.py).

The contract (worker_svc/plan.py): every joining request of a hybrid model names a state slot of its own; one that
already has computed tokens (a prefix-cache hit, an n > 1 fork, a resumed request past zero) must get its state by
a copy of the same plan; the copies and saves name slots in range. A model without recurrent layers takes no state
fields at all. Any breach is an InvalidPlan naming the request or the field; nothing is applied.
"""

from __future__ import annotations

import numpy as np

from worker_svc.core.errors import InvalidPlan
from worker_svc.core.plan import StepPlan


def check_state_plan(plan: StepPlan, num_slots: int, owned: np.ndarray) -> None:
    """`num_slots`: the pool's size (0: not a hybrid model); `owned`: the slots of the rows that stay live."""
    pairs = {}
    for field in ("state_copy", "state_save"):
        src, dst = (np.asarray(getattr(plan, f"{field}_{end}"), dtype=np.int64) for end in ("src", "dst"))
        if len(src) != len(dst):
            raise InvalidPlan(f"{field}_src has {len(src)} entries, {field}_dst {len(dst)}")
        if len(src) and not num_slots:
            raise InvalidPlan(f"{field}_src / {field}_dst: this model has no recurrent layers (no state slots)")
        bad = np.flatnonzero((src < 0) | (src >= num_slots) | (dst < 0) | (dst >= num_slots) | (src == dst))
        if len(bad):
            i = int(bad[0])
            raise InvalidPlan(f"{field}[{i}]: src {src[i]} and dst {dst[i]} must be distinct state slots in "
                              f"[0, {num_slots})")
        if len(np.unique(dst)) < len(dst):
            raise InvalidPlan(f"{field}_dst names a state slot more than once")
        pairs[field] = dst
    restored = set(pairs["state_copy"].tolist())
    taken = set(owned.tolist())
    for kind, entries in (("new_requests", plan.new_requests), ("resumed_requests", plan.resumed_requests)):
        for r in entries:
            where = f"{kind}[slot {r.slot}, {r.request_id!r}]"
            if not num_slots:
                if r.state_slot != -1:
                    raise _blamed(f"{where}: state_slot {r.state_slot} given, but this model has no recurrent "
                                  "layers (expected -1)", r)
                continue
            if not 0 <= r.state_slot < num_slots:
                raise _blamed(f"{where}: state_slot {r.state_slot} is not a state slot in [0, {num_slots}) "
                              "(a hybrid model needs one per request)", r)
            if r.state_slot in taken:
                raise _blamed(f"{where}: state_slot {r.state_slot} is already held by another request", r)
            taken.add(r.state_slot)
            if r.num_computed_tokens > 0 and r.state_slot not in restored:
                raise _blamed(f"{where}: num_computed_tokens {r.num_computed_tokens} > 0 but no state_copy fills "
                              f"its state_slot {r.state_slot} (the state after those tokens)", r)


def _blamed(msg: str, r) -> InvalidPlan:
    return InvalidPlan(msg, r.request_id, r.slot)
