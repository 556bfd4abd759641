"""Which LoRA adapters the deployment serves: one Redis hash, `{namespace}:lora_adapters` (name -> PEFT directory),
shared by every scheduler of the namespace, so a new leader, a standby and a restarted worker (whose requests carry
the path) know every adapter registered at start-up (--lora-modules) or at run time (/v1/load_lora_adapter).

Requests keep the path they were admitted with (their ledger record), so unloading an adapter never strands one in
flight: they finish with it; new requests naming it get NOT_FOUND.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import redis

from common.lora import parse_lora_modules
from common.validation import ConfigError
from protos import worker_pb2 as wpb
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.driver.admission import AdmissionError


def _text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


class LoraRegistry:
    def __init__(self, client: redis.Redis, namespace: str):
        self.client = client
        self.key = f"{namespace}:lora_adapters"

    def path_of(self, name: str) -> str | None:
        path = self.client.hget(self.key, name)
        return None if path is None else _text(path)

    def all(self) -> dict[str, str]:
        return {_text(k): _text(v) for k, v in sorted(self.client.hgetall(self.key).items())}

    def register(self, name: str, path: str) -> None:
        self.client.hset(self.key, name, path)

    def unregister(self, name: str) -> bool:
        return bool(self.client.hdel(self.key, name))


class LoraService:
    """The scheduler's LoRA operations over the registry: the adapter of a request at admission, the list for
    GetModelInfo, and run-time registration, which the worker checks first (INVALID_ARGUMENT naming the file and the
    module) so that a bad adapter is refused at load, not when a request first runs with it."""

    def __init__(self, registry: LoraRegistry, worker_stub_of: Callable[[], object], *, enabled: bool,
                 allow_runtime_updating: bool):
        self.registry = registry
        self.worker_stub_of = worker_stub_of  # the worker's current stub (the channel is reopened on reconnects)
        self.enabled = enabled
        self.allow_runtime_updating = allow_runtime_updating

    def path_for(self, name: str) -> str:
        """The PEFT directory of a registered adapter; AdmissionError NOT_FOUND for an unknown one."""
        path = self.registry.path_of(name) if self.enabled else None
        if path is None:
            known = ", ".join(self.registry.all()) if self.enabled else "none (started without --enable-lora)"
            raise AdmissionError(grpc.StatusCode.NOT_FOUND,
                                 f"lora_name {name!r} is not a registered LoRA adapter (registered: {known or 'none'})")
        return path

    def adapters(self) -> dict[str, str]:
        return self.registry.all() if self.enabled else {}

    def _check_runtime(self, what: str) -> None:
        if not self.enabled or not self.allow_runtime_updating:
            raise AdmissionError(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"{what} needs --enable-lora and --allow-runtime-lora-updating")

    def load(self, name: str, path: str, timeout: float = 120.0) -> str:
        self._check_runtime("/v1/load_lora_adapter")
        if not name or not path:
            raise AdmissionError(grpc.StatusCode.INVALID_ARGUMENT, "lora_name and lora_path are required")
        if self.registry.path_of(name) is not None:
            raise AdmissionError(grpc.StatusCode.ALREADY_EXISTS, f"LoRA adapter {name!r} is already loaded; unload "
                                 "it first")
        try:
            self.worker_stub_of().LoadLoraAdapter(wpb.LoraAdapterRef(name=name, path=path), timeout=timeout)
        except grpc.RpcError as e:
            raise AdmissionError(e.code(), e.details() or "") from None
        self.registry.register(name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str) -> str:
        """Unregister at once: new requests naming it get NOT_FOUND; admitted ones finish with it (they carry its
        path, and the worker keeps it while a row of its batch uses it)."""
        self._check_runtime("/v1/unload_lora_adapter")
        if not self.registry.unregister(name):
            raise AdmissionError(grpc.StatusCode.NOT_FOUND, f"lora_name {name!r} is not a registered LoRA adapter")
        try:  # let the worker drop its host copy; the device slot goes when evicted
            self.worker_stub_of().LoadLoraAdapter(wpb.LoraAdapterRef(name=name, unload=True), timeout=10)
        except grpc.RpcError:
            pass  # a worker that is away has no copy to drop
        return f"Success: LoRA adapter '{name}' removed successfully."


def lora_service(cfg: SchedulerConfig, client: redis.Redis, worker_stub_of: Callable[[], object]) -> LoraService:
    """The service, with --lora-modules registered (they replace entries of the same name)."""
    if cfg.lora_modules and not cfg.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    registry = LoraRegistry(client, cfg.namespace)
    try:
        modules = parse_lora_modules(cfg.lora_modules)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for name, path in modules:
        registry.register(name, path)
    return LoraService(registry, worker_stub_of, enabled=cfg.enable_lora,
                       allow_runtime_updating=cfg.allow_runtime_lora_updating)
