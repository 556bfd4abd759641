"""The public gRPC servers (llmserve.v1 and vLLM's engine protocol) and the wiring of a scheduler process."""
