"""Tensor parallelism: the rank group (processes, collectives) and how weights are sharded over it."""
