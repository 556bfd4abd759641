"""The outbox's bridge to the event loop: one publish from the driver thread rings only the streams with news."""

from __future__ import annotations

import asyncio
import threading

from common.sampling_fields import SamplingParams
from scheduler_svc.core.request import Request
from scheduler_svc.core.step_records import Logprobs, SampledToken
from scheduler_svc.driver.outbox import UNAVAILABLE, Outbox, Published


def _request(rid: str) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=8))


def _publish_from_thread(outbox: Outbox, *args) -> None:
    t = threading.Thread(target=outbox.publish, args=args)  # as the driver thread does
    t.start()
    t.join()


async def _settle() -> None:
    for _ in range(3):  # call_soon_threadsafe callbacks run on the next loop iterations
        await asyncio.sleep(0)


def test_a_committed_step_wakes_only_the_streams_with_news():
    async def main():
        outbox = Outbox()
        outbox.attach(asyncio.get_running_loop())
        running, queued = _request("running"), _request("queued")
        for req in (running, queued):
            outbox.published[req.request_id] = Published(req)
        w_running, w_queued = outbox.watch(["running"]), outbox.watch(["queued"])
        for step in range(5):
            _publish_from_thread(outbox, [(running, [SampledToken("running", 100 + step)])], [])
            await _settle()
            assert w_running.event.is_set()
            await w_running.wait()
        assert w_running.wakes == 5 and w_queued.wakes == 0
        assert not w_queued.event.is_set()
        assert outbox.get("running").token_ids == [100, 101, 102, 103, 104]

        running.finish_reason = "length"
        _publish_from_thread(outbox, [], [running])
        await _settle()
        assert w_running.wakes == 6 and w_queued.wakes == 0

        outbox.unwatch(w_running)
        _publish_from_thread(outbox, [(queued, [SampledToken("queued", 7)])], [])
        await _settle()
        assert w_running.wakes == 6 and w_queued.wakes == 1

    asyncio.run(main())


def test_one_watch_for_the_n_sequences_of_a_request_and_end_all_rings_everyone():
    async def main():
        outbox = Outbox()
        outbox.attach(asyncio.get_running_loop())
        seqs = [_request(f"r#{i}") for i in range(3)]
        other = _request("other")
        for req in (*seqs, other):
            outbox.published[req.request_id] = Published(req)
        w_seqs, w_other = outbox.watch([r.request_id for r in seqs]), outbox.watch(["other"])
        # One step with news for two of the siblings: the request's stream wakes once, `other` not at all.
        _publish_from_thread(outbox, [(seqs[0], [SampledToken("r#0", 5)]), (seqs[2], [SampledToken("r#2", 6)])], [])
        await _settle()
        assert w_seqs.wakes == 1 and w_other.wakes == 0

        pubs = [outbox.get(r.request_id) for r in (*seqs, other)]
        left = await asyncio.to_thread(outbox.end_all)
        await _settle()
        assert {r.request_id for r in left} == {"r#0", "r#1", "r#2", "other"}
        assert w_seqs.wakes == 2 and w_other.wakes == 1
        assert all(p.finish_reason == UNAVAILABLE for p in pubs)

    asyncio.run(main())


def test_without_a_loop_publishing_only_records():
    outbox = Outbox()  # the driver alone (unit tests of the loop, --direct benchmarks): nobody to ring
    req = _request("a")
    outbox.published["a"] = Published(req)
    outbox.publish([(req, [SampledToken("a", 9)])], [])
    assert outbox.get("a").token_ids == [9]


def test_a_request_read_back_from_redis_carries_its_stored_logprobs():
    """A new leader re-sends stored tokens with the logprobs stored beside them (None past the stored ones)."""
    req = _request("r")
    req.output_ids = [5, 6, 7]
    req.output_logprobs = [Logprobs(-0.5, [(5, -0.5)]), None]
    pub = Published.of_stored(req, finished=False)
    assert pub.token_ids == [5, 6, 7] and pub.logprobs == [Logprobs(-0.5, [(5, -0.5)]), None, None]
    req.output_logprobs = None  # a request that asked for none
    assert Published.of_stored(req, finished=False).logprobs == [None, None, None]
