"""The scheduler's record of how a sequence samples, as decided at admission: common/sampling_fields.py's
SamplingParams (one dataclass for scheduler and worker, derived from the field table).

Plain data, independent of the worker's wire format (`scheduler_svc.worker_wire.sampling_to_wire`) and of the
client's request. This is also what the ledger stores in Redis (`to_dict()` as JSON), under the store's
SCHEMA_VERSION: changing the table's rows changes the Redis schema, and must bump that version.
"""

from common.sampling_fields import SamplingParams

__all__ = ["SamplingParams"]
