"""The scheduler -> worker protocol's version and limits (protos/worker.proto), shared by both sides."""

from protos import worker_pb2

PACKAGE = worker_pb2.DESCRIPTOR.package  # "llmserve.worker.v2": a peer built from another version finds no service
SERVICE = f"{PACKAGE}.Worker"
# Request slots are rows of the worker's persistent batch: bounded, so a bad plan cannot make it allocate without
# limit. The scheduler hands out the lowest free slot, so it needs at most about twice --max-num-seqs of them.
MAX_SLOTS = 1 << 14
