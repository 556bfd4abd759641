"""Start-up validation: settings that cannot work fail at once, with a message naming the flags and the values."""

from __future__ import annotations

import ssl


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


def _check_cert_pair(cert_flag: str, cert: str, key_flag: str, key: str) -> None:
    try:  # also proves the key belongs to the certificate
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"cannot use {cert_flag} {cert} with {key_flag} {key}: {e}") from None


def _check_ca(flag: str, path: str) -> None:
    try:
        ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"cannot use {flag} {path} as a CA bundle: {e}") from None


def check_server_tls(*, cert: str | None, key: str | None, client_ca: str | None) -> None:
    """--tls-cert/--tls-key/--tls-client-ca of a gRPC server: cert and key together, readable, matching."""
    if (cert is None) != (key is None):
        pair = ("--tls-cert", "--tls-key")
        given, missing = pair if key is None else pair[::-1]
        raise ConfigError(f"{given} needs {missing}: the server certificate and its key go together")
    if client_ca is not None and cert is None:
        raise ConfigError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key: client certificates are "
                          "checked only on a TLS server")
    if cert is not None:
        _check_cert_pair("--tls-cert", cert, "--tls-key", key)
    if client_ca is not None:
        _check_ca("--tls-client-ca", client_ca)


def check_channel_tls(*, ca: str | None, cert: str | None, key: str | None, server_name: str | None,
                      prefix: str = "--worker-tls") -> None:
    """--worker-tls-ca/--worker-tls-cert/--worker-tls-key/--worker-tls-server-name of the scheduler->worker
    channel (`prefix` names the flags of another channel: the API's --scheduler-tls-*): TLS is on with the CA; the
    client certificate and the name override need it."""
    if (cert is None) != (key is None):
        pair = (f"{prefix}-cert", f"{prefix}-key")
        given, missing = pair if key is None else pair[::-1]
        raise ConfigError(f"{given} needs {missing}: the client certificate and its key go together")
    if ca is None:
        for flag, value in ((f"{prefix}-cert", cert), (f"{prefix}-server-name", server_name)):
            if value is not None:
                raise ConfigError(f"{flag} needs {prefix}-ca (the CA that signed the server's certificate): "
                                  "TLS is on only with it")
        return
    _check_ca(f"{prefix}-ca", ca)
    if cert is not None:
        _check_cert_pair(f"{prefix}-cert", cert, f"{prefix}-key", key)


check_ca, check_cert_pair = _check_ca, _check_cert_pair  # for the HTTP API's --ssl-* flags
