"""The public servers' process side: one grpc.aio server for llmserve.v1 and vLLM's engine protocol on one port,
its event loop in a thread of its own, health that follows the driver's readiness, and reflection."""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.auth import api_key_interceptor
from common.config import MAX_MESSAGE_BYTES
from protos import llmserve_pb2_grpc as pb_grpc
from protos import vllm_engine_pb2_grpc as vpb_grpc
from scheduler_svc.driver.driver import Driver
from scheduler_svc.lora_registry import LoraService
from scheduler_svc.servers.servicer import SERVICE_NAME, LLMServeServicer
from scheduler_svc.servers.vllm_engine import SERVICE_NAME as VLLM_SERVICE_NAME
from scheduler_svc.servers.vllm_engine import VllmEngineServicer

log = logging.getLogger("llmserve.scheduler")


class PublicServer:
    """The grpc.aio server of the public API and the event loop it runs on, in a thread of its own ("grpc-aio"), so
    that `llmserve scheduler` and the in-process stacks of the tests drive it the same way: start(), stop(grace)."""

    def __init__(self, driver: Driver, address: str, api_key: str | None, tokenizer_path: str | None,
                 credentials: grpc.ServerCredentials | None, loras: LoraService | None = None):
        self.driver = driver
        self.loras = loras
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio", daemon=True)
        self.thread.start()
        try:
            self.port = self._run(self._build(address, api_key, tokenizer_path, credentials))
        except BaseException:
            self._close_loop()
            raise
        if self.port == 0:
            self._close_loop()
            raise SystemExit(f"cannot listen on {address}")
        driver.outbox.attach(self.loop)
        self._health_lock = threading.Lock()  # health reports in the order of the readiness changes
        self._serving = False
        driver.on_ready_change = self._on_ready

    async def _build(self, address: str, api_key: str | None, tokenizer_path: str | None,
                     credentials: grpc.ServerCredentials | None) -> int:
        interceptors = [api_key_interceptor(api_key)] if api_key else []
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.so_reuseport", 0), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        self.servicer = LLMServeServicer(self.driver, tokenizer_path, self.loras)
        pb_grpc.add_LLMServeServicer_to_server(self.servicer, self.server)
        # vLLM's engine protocol on the same port: what the smg gateway routes to (`--backend vllm`)
        self.vllm_servicer = VllmEngineServicer(self.servicer)
        vpb_grpc.add_VllmEngineServicer_to_server(self.vllm_servicer, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable_server_reflection(
            (SERVICE_NAME, VLLM_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        try:
            return (self.server.add_insecure_port(address) if credentials is None
                    else self.server.add_secure_port(address, credentials))
        except RuntimeError:  # the address is taken or invalid
            return 0

    def add_loopback_listener(self) -> int:
        """A second, plaintext port on 127.0.0.1 for the same services (before start()): where `llmserve serve` has
        its own HTTP API connect when the public port serves TLS, so that API needs no CA or client certificate.
        It is as private as serve's loopback worker, which is plaintext already."""
        async def add() -> int:
            return self.server.add_insecure_port("127.0.0.1:0")

        port = self._run(add())
        if not port:
            raise SystemExit("cannot listen on a loopback port for the HTTP API")
        return port

    def _run(self, coro, timeout: float | None = None):
        """Run `coro` on the loop from another thread and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def _on_ready(self, ready: bool) -> None:
        """From the driver thread: health follows the driver's readiness, SERVING once the tokenizer is loaded too
        (1-2 s for a GGUF's vocabulary, which a first request arriving at SERVING used to wait for)."""
        with self._health_lock:
            self._serving = ready
            if ready:
                threading.Thread(target=self._serve_with_tokenizer, name="load-tokenizer", daemon=True).start()
            else:
                self._report(health_pb2.HealthCheckResponse.NOT_SERVING)

    def _serve_with_tokenizer(self) -> None:
        try:
            self.servicer.tokenizer()
        except Exception as e:  # noqa: BLE001  (requests will name the error; health still follows the worker)
            log.warning("cannot load the tokenizer: %s", e)
        with self._health_lock:  # not if the worker went away or a drain began meanwhile
            if self._serving:
                self._report(health_pb2.HealthCheckResponse.SERVING)

    def _report(self, status) -> None:
        if not self.loop.is_closed():
            asyncio.run_coroutine_threadsafe(self._set_health(status), self.loop)

    def start(self) -> None:
        self._run(self.server.start())

    def stop(self, grace: float | None = None) -> None:
        """Stop accepting calls, let those in progress end for up to `grace` seconds (then cancel them), close."""
        if self.loop.is_closed():
            return
        try:
            self._run(self.server.stop(grace))
        finally:
            self.driver.outbox.attach(None)
            self._close_loop()

    def _close_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


def build_server(driver: Driver, address: str, api_key: str | None = None, tokenizer_path: str | None = None,
                 credentials: grpc.ServerCredentials | None = None,
                 loras: LoraService | None = None) -> tuple[PublicServer, int, object]:
    """The public API server (not started), its port and its health servicer. `credentials` None serves plaintext;
    otherwise TLS (mutual TLS when they require client certificates)."""
    server = PublicServer(driver, address, api_key, tokenizer_path, credentials, loras)
    return server, server.port, server.health
