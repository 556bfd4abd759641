"""The test and benchmark harness: what tests (and the bench/ experiments) start that the product never does."""
