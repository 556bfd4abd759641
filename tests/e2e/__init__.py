"""End-to-end and integration tests: real redis-server, worker and scheduler processes, the bundled weights
with Hugging Face as the oracle, the Triton interpreter, the bench scripts."""
