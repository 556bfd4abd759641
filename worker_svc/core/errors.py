"""Why the worker refuses a step plan, as typed exceptions: the core raises them, the gRPC edge (worker_svc/server.py)
maps each kind to its status code and `common.plan_errors` trailing metadata.

    PlanError
    +-- InvalidPlan            a malformed entry or an impossible request (INVALID_ARGUMENT)
    `-- OutOfTurnPlan          a well-formed plan this worker cannot run now (FAILED_PRECONDITION)
        +-- FencedPlan         its scheduler lost the lease
        +-- StaleStep          step_id not newer than the last executed step
        +-- EpochMismatch      planned for another process: its KV cache is gone
        `-- PredecessorRefused the plan it was pipelined behind was refused
"""

from __future__ import annotations

from common import plan_errors


class PlanError(Exception):
    """A refused plan. Nothing of it was applied. `slot` and `request_id` name the entry at fault, when one is."""

    reason = plan_errors.INVALID

    def __init__(self, message: str, request_id: str = "", slot: int | None = None):
        super().__init__(message)
        self.request_id = request_id
        self.slot = slot


class InvalidPlan(PlanError):
    reason = plan_errors.INVALID


class OutOfTurnPlan(PlanError):
    pass


class FencedPlan(OutOfTurnPlan):
    reason = plan_errors.FENCED


class StaleStep(OutOfTurnPlan):
    reason = plan_errors.STALE_STEP


class EpochMismatch(OutOfTurnPlan):
    reason = plan_errors.EPOCH_MISMATCH


class PredecessorRefused(OutOfTurnPlan):
    reason = plan_errors.PREDECESSOR_REFUSED
