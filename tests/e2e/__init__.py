"""End-to-end tests: several real processes (redis-server, workers, schedulers, the HTTP API, `serve`, smg, the
bench scripts) talking over gRPC, HTTP and Redis, with the bundled weights and Hugging Face as the oracle; and the
Triton kernels under the interpreter (minutes of CPU)."""
