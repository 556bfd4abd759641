"""Model worker: owns weights and the paged KV cache, executes one step plan per iteration."""
