"""--speculative-config as the scheduler reads it: the parser lives in common/speculative_config.py, since the worker
reads the same flag to load an eagle3 / mtp head."""

from common.speculative_config import (  # noqa: F401
    FLAG,
    HEAD_METHODS,
    MAX_SPECULATIVE_TOKENS,
    METHODS,
    SpeculativeConfig,
    parse_speculative_config,
)
