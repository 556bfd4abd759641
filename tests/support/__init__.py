"""The harness every test tier shares: real processes with test log files (`cluster`), the session's redis-server
(`redis_fixture`), worker plans and an in-process driver (`plans`, `driver`), random-weight checkpoints, the
per-row host path kept as an oracle, and the bench scripts' runner."""
