"""Why a worker refused a step plan, as the worker tells the scheduler: gRPC trailing metadata, never message text.

The worker sets `llmserve-plan-error: <reason>` on every refused ExecuteStep, and when one request's entry is at fault
`llmserve-plan-slot: <slot>` with `llmserve-plan-request-id: <id>` (when the worker knows the id: a new or resumed
entry, or a slot it holds); the scheduler's worker client turns them into typed errors and maps the slot back to the
request it gave that slot.
"""

REASON_KEY = "llmserve-plan-error"
REQUEST_ID_KEY = "llmserve-plan-request-id"
SLOT_KEY = "llmserve-plan-slot"

FENCED = "fenced"  # the plan's fencing token is older than one already seen: its scheduler lost the lease
STALE_STEP = "stale_step"  # step_id not newer than the last executed step
EPOCH_MISMATCH = "epoch_mismatch"  # expected_epoch is not this worker's: its KV cache is gone
PREDECESSOR_REFUSED = "predecessor_refused"  # the plan it was pipelined behind (after_step_id) was refused
INVALID = "invalid"  # a malformed entry; the request id names the request at fault when there is one
