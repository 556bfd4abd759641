"""Start-up validation: settings that cannot work fail at once, with a message naming the flags and the values."""

from __future__ import annotations


class ConfigError(Exception):
    """A combination of settings that cannot work; the message names the flags and their values."""


def power_of_two(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def check_limits(*, block_size: int | None, budget: int | None, max_model_len: int | None, chunked: bool,
                 budget_is_default: bool = False) -> None:
    """The checks that need the block size / max-model-len (known from the flags in `llmserve serve`, from the
    worker's Describe in a standalone scheduler). Raises ConfigError."""
    budget_flag = "--max-num-batched-tokens" + (" (default for this device)" if budget_is_default else "")
    if block_size is not None and not power_of_two(block_size):
        raise ConfigError(f"--block-size must be a power of two >= 1 (the paged-attention kernels index blocks "
                          f"by shifts), got {block_size}")
    if block_size and budget and budget < block_size:
        raise ConfigError(f"{budget_flag} ({budget}) is smaller than --block-size ({block_size}): a step could not "
                          "fill a single KV block; raise the budget or lower the block size")
    if not chunked and budget and max_model_len and budget < max_model_len:
        raise ConfigError(f"--no-enable-chunked-prefill needs {budget_flag} ({budget}) >= --max-model-len "
                          f"({max_model_len}): a whole prompt must fit one step; raise the budget, lower "
                          "--max-model-len or enable chunked prefill")


def check_pool(*, max_model_len: int, num_blocks: int, block_size: int) -> None:
    """The worker's KV pool must hold at least one sequence of --max-model-len tokens."""
    pool_tokens = num_blocks * block_size
    if max_model_len > pool_tokens:
        raise ConfigError(f"--max-model-len ({max_model_len}) is larger than the KV pool ({pool_tokens} tokens = "
                          f"{num_blocks} blocks x --block-size {block_size}): a sequence that long could never "
                          "run; lower --max-model-len or give the pool more room with --num-gpu-blocks-override, "
                          "--kv-cache-memory (CPU) or --gpu-memory-utilization (GPU)")
