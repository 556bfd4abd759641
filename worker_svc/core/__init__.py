"""The worker's pure core: a StepPlan in, a StepOutput of plain arrays out (no protobuf, no gRPC)."""
