"""LoRA adapters over HTTP (vLLM's API): a request's `model` names the base model or a registered adapter,
/v1/models lists the adapters (parent: the base model), and /v1/load_lora_adapter and /v1/unload_lora_adapter
register and forget them at run time (the scheduler refuses them without --allow-runtime-lora-updating)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from api_svc import errors, openapi
from api_svc.bridge import Bridge
from api_svc.errors import APIError
from protos import llmserve_pb2 as pb


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are what identify adapters here


async def adapters(bridge: Bridge) -> dict[str, str]:
    """The registered adapters (name -> path), asked each time: another API process may have loaded one."""
    try:
        info = await bridge.client.model_info()
    except grpc.aio.AioRpcError as e:
        raise errors.from_grpc(e.code(), e.details() or "") from None
    return {a.name: a.path for a in info.lora_adapters}


def set_adapter(reqs: list[pb.GenerateRequest], model: str, served: str) -> None:
    """Requests for an adapter carry its name (the base model's carry none)."""
    if model != served:
        for r in reqs:
            r.lora_name = model


def model_cards(served: str, found: dict[str, str], created: int) -> list[dict]:
    return [{"id": name, "object": "model", "created": created, "owned_by": "llmserve", "root": path,
             "parent": served} for name, path in found.items()]


def _lora_error(e: grpc.aio.AioRpcError) -> APIError:
    code, details = e.code(), e.details() or ""
    if code == grpc.StatusCode.NOT_FOUND:
        return APIError(404, details, "NotFoundError", "lora_name", "model_not_found")
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS):
        return errors.bad_request(details, "lora_path" if code == grpc.StatusCode.INVALID_ARGUMENT else "lora_name")
    if code == grpc.StatusCode.FAILED_PRECONDITION:  # vLLM does not serve these routes without the flag
        return APIError(404, details, "NotFoundError", None, "not_found")
    return errors.from_grpc(code, details)


def lora_router(bridge_of: Callable[[Request], Bridge], dependencies: list) -> APIRouter:
    router = APIRouter(dependencies=dependencies)

    @router.post("/v1/load_lora_adapter", responses=openapi.LORA)
    async def load(body: LoadLoraAdapterRequest, request: Request):
        bridge = bridge_of(request)
        try:
            resp = await bridge.client.stub.LoadLoraAdapter(
                pb.LoadLoraAdapterRequest(lora_name=body.lora_name, lora_path=body.lora_path),
                metadata=bridge.client.metadata, timeout=180)
        except grpc.aio.AioRpcError as e:
            raise _lora_error(e) from None
        return PlainTextResponse(resp.message)

    @router.post("/v1/unload_lora_adapter", responses=openapi.LORA)
    async def unload(body: UnloadLoraAdapterRequest, request: Request):
        bridge = bridge_of(request)
        try:
            resp = await bridge.client.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name=body.lora_name),
                                                              metadata=bridge.client.metadata, timeout=30)
        except grpc.aio.AioRpcError as e:
            raise _lora_error(e) from None
        return PlainTextResponse(resp.message)

    return router
