"""CPU-only parts of the worker: the C++ decoder layer loop and the panel-packed matmul weights."""
