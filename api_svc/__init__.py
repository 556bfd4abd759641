"""The OpenAI-compatible HTTP API: a stateless FastAPI process in front of the scheduler's public gRPC API."""
