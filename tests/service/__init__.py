"""Service tests: one part at a time, in this process where it can be (the worker's runner and model against Hugging
Face, the tokenizer, the GGUF cache, the scheduler's Redis ledger on a real redis-server, diagnose on metric
snapshots); no multi-process stack. `./scripts/test.sh --fast` runs them with tests/unit."""
