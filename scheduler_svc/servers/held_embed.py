"""A vLLM-protocol Embed admitted before a stand-down of this scheduler, kept alive until it has its vector.

An embedding is one reply: there are no tokens to resume from. llmserve.v1 clients send an accepted Embed again
themselves (common/client.py); a gateway speaking vLLM's engine protocol (smg) would see UNAVAILABLE for a request
the pool had accepted. So the handler waits here, as a held Generate does (held_stream.py), until this scheduler
leads again, admits the same request again (resumed from the Redis ledger, or submitted anew) and waits for its
vector. Past --reattach-timeout without leading again the call ends UNAVAILABLE, naming the setting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from protos import llmserve_pb2 as pb
from scheduler_svc.core.request import FINISH_LENGTH, FINISH_STOP
from scheduler_svc.driver import embed
from scheduler_svc.driver.outbox import UNAVAILABLE
from scheduler_svc.servers.held_stream import admit_when_leading

if TYPE_CHECKING:
    from scheduler_svc.servers.servicer import LLMServeServicer


async def held_embed(public: LLMServeServicer, request: pb.GenerateRequest, context,
                     rename: Callable[[str], str]) -> pb.EmbedResponse:
    """The vector of the embed request `request` (embed.generate_request's), across any number of stand-downs."""
    _, streams = await public.admit(request, context, rename, embed=True)
    pub, stood_down, runs, again = streams[0].pub, False, 0, request
    while True:
        finish, vector = await embed.until_finished(public.driver, pub)
        if vector is not None:
            return pb.EmbedResponse(embedding=vector, prompt_tokens=pub.request.num_prompt_tokens)
        if finish == UNAVAILABLE:
            stood_down = True
        elif stood_down and finish in (FINISH_LENGTH, FINISH_STOP):
            # Finished in Redis, its vector lost with the stand-down (the commit landed, its reply did not): run it
            # again under an id of its own, since the first one names a finished request for a while.
            runs += 1
            again = pb.GenerateRequest()
            again.CopyFrom(request)
            again.request_id = f"{request.request_id}-again{runs}"
        else:
            await context.abort(*embed.failure_status(pub, finish))
        streams = await admit_when_leading(public, again, context, rename, [pub.request.request_id], embed=True)
        pub = streams[0].pub
