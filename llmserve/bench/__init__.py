"""`llmserve bench`: load generator, Hugging Face baselines, sweeps and the KV-waste report."""
