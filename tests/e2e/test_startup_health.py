"""Health says SERVING only once a first request would not wait for start-up work: the scheduler's tokenizer is
loaded (a GGUF vocabulary takes 1-2 s of CPU, which the first request used to wait behind), and the API reports 503
while its own tokenizer is still loading."""

from __future__ import annotations

import asyncio

from api_svc.bridge import Bridge
from tests.support.cluster import wait_healthy
from tests.support.stack import Stack


def test_the_scheduler_serves_once_its_tokenizer_is_loaded():
    with Stack(["--num-gpu-blocks-override", "64"]) as stack:
        wait_healthy(stack.address)
        assert stack.scheduler.server.servicer._tokenizer is not None


def test_the_api_is_not_ready_while_its_tokenizer_loads():
    with Stack(["--num-gpu-blocks-override", "64"]) as stack:
        wait_healthy(stack.address)

        async def check() -> tuple[str | None, str | None]:
            bridge = Bridge(stack.address)
            loading = asyncio.get_running_loop().create_future()  # what model_info starts, not yet done
            bridge._tokenizer_future = loading
            while_loading = await bridge.health()
            loading.set_result(None)
            return while_loading, await bridge.health()

        while_loading, loaded = asyncio.run(check())
        assert while_loading == "the API is still loading its tokenizer"
        assert loaded is None
