"""The service address of the chaos stack: a TCP forwarder in front of a leader and its standby that sends new
connections to whichever scheduler answers SERVING, as a load balancer with a gRPC readiness check does. When the
leader changes it closes the connections to the others, so clients' channels reconnect to the new leader."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from llmserve.processes import health

POLL_S = 0.1  # how often each scheduler's health is asked
CHUNK = 1 << 16


class Forwarder:
    def __init__(self, backends: list[str]):
        self.backends = backends
        self.serving: str | None = None  # the backend that last answered SERVING
        self.port = 0
        self._conns: dict[str, set[asyncio.StreamWriter]] = {b: set() for b in backends}
        self._loop = asyncio.new_event_loop()
        self._stopping = threading.Event()
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), name="forwarder", daemon=True).start()
        ready.wait(10)
        threading.Thread(target=self._poll, name="forwarder-health", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._stopping.set()
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _shutdown(self) -> None:
        self._server.close()
        for writers in self._conns.values():
            for w in list(writers):
                w.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- health ------------------------------------------------------------------------------------------------

    def _poll(self) -> None:
        while not self._stopping.is_set():
            found = next((b for b in self.backends if health(b, timeout=0.5) == "SERVING"), None)
            if found is not None:
                # Every poll, not only on a change: a connection opened to another scheduler while the leader
                # was changing (its accept raced this poll) would otherwise stay on a standby for good.
                self.serving = found
                self._loop.call_soon_threadsafe(self._drop_others, found)
            time.sleep(POLL_S)

    def _drop_others(self, keep: str) -> None:
        for backend, writers in self._conns.items():
            if backend != keep:
                for w in list(writers):
                    w.close()

    # ---- forwarding --------------------------------------------------------------------------------------------

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        sock = socket.create_server(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, sock=sock))
        ready.set()
        self._loop.run_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # No leader yet: any scheduler, so a health check still gets an answer (NOT_SERVING) and a call UNAVAILABLE.
        order = [self.serving] if self.serving else []
        order += [b for b in self.backends if b not in order]
        for backend in order:
            host, port = backend.rsplit(":", 1)
            try:
                up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 1.0)
            except (OSError, asyncio.TimeoutError):
                continue
            self._conns[backend].update((writer, up_writer))
            try:
                await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
            finally:
                self._conns[backend].discard(writer)
                self._conns[backend].discard(up_writer)
            return
        writer.close()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(CHUNK):
                writer.write(data)
                await writer.drain()
        except (OSError, ConnectionError):
            pass
        finally:
            writer.close()
