"""Why a worker refused a step plan, as the worker tells the scheduler: gRPC trailing metadata, never message text.

The worker sets `llmserve-plan-error: <reason>` (and `llmserve-plan-request-id: <id>` when one request's entry is
at fault) on every refused ExecuteStep; the scheduler's worker client turns them into typed errors.
"""

REASON_KEY = "llmserve-plan-error"
REQUEST_ID_KEY = "llmserve-plan-request-id"

FENCED = "fenced"  # the plan's fencing token is older than one already seen: its scheduler lost the lease
STALE_STEP = "stale_step"  # step_id not newer than the last executed step
EPOCH_MISMATCH = "epoch_mismatch"  # expected_epoch is not this worker's: its KV cache is gone
INVALID = "invalid"  # a malformed entry; the request id names the request at fault when there is one
