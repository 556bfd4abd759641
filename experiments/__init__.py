"""Benchmark scripts; run each from the repository root as `python -m experiments.NAME` (see experiments/README.md)."""
