"""The harness every test tier shares (and the experiments/ scripts, for what they start that the product never
does): real processes with test log files (`cluster`, `stack`), the session's redis-server (`redis_fixture`), worker
plans and an in-process driver (`plans`, `driver`), random-weight checkpoints, the per-row host path kept as an
oracle, and the experiments' runner (`bench_runs`)."""
