"""vLLM's gRPC engine protocol (vllm.grpc.engine.VllmEngine) on the scheduler's port, next to llmserve.v1.

A gateway that speaks it (smg) tokenizes, routes and detokenizes itself; here each call is translated onto the same
admission and streaming path as llmserve.v1's Generate, so both APIs validate, queue, stream and abort alike. Fields
llmserve cannot honour yet are refused with INVALID_ARGUMENT naming them, never silently dropped.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import time
import uuid
import zipfile
from datetime import datetime, timezone
from typing import TYPE_CHECKING

import grpc

from common.sampling_wire import vllm_to_public
from protos import llmserve_pb2 as pb
from protos import vllm_engine_pb2 as vpb
from protos import vllm_engine_pb2_grpc as vpb_grpc
from scheduler_svc.driver import embed
from scheduler_svc.driver.admission import abort_sequences
from scheduler_svc.servers.held_embed import held_embed
from scheduler_svc.servers.held_stream import HeldStream
from scheduler_svc.servers.store_errors import retryable_store_errors

if TYPE_CHECKING:
    from scheduler_svc.servers.servicer import LLMServeServicer

SERVICE_NAME = "vllm.grpc.engine.VllmEngine"
TOKENIZER_CHUNK_BYTES = 1 << 20
# Files of a HF model directory that describe its tokenizer and generation defaults (sent as they are).
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                       "chat_template.jinja", "config.json")
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed timestamps: the same model gives the same zip, hence the same sha256


class _Refused(Exception):
    pass


def _rename(message: str) -> str:
    """llmserve.v1's field names in a refusal -> the names of this protocol."""
    return (message.replace("sampling.", "sampling_params.")
            .replace("prompt token_ids", "tokenized.input_ids"))


def to_llmserve(req: vpb.GenerateRequest, tokenize) -> pb.GenerateRequest:
    """The llmserve.v1 request for a vLLM one, or _Refused naming the first field llmserve cannot honour.
    `tokenize(text) -> ids` is needed only for truncate_prompt_tokens on a text prompt."""
    s = req.sampling_params
    constraint = s.WhichOneof("constraint")
    if constraint == "structural_tag":
        raise _Refused("sampling_params.structural_tag: structural tags are not supported by llmserve (json_schema, "
                       "regex, grammar, json_object and choice are)")
    if s.HasField("logprobs") and s.logprobs < 0:
        raise _Refused(f"sampling_params.logprobs must be 0..20, got {s.logprobs} (-1, the whole vocabulary, is "
                       "not supported)")
    if req.HasField("kv_transfer_params") or req.HasField("kv_transfer_params_json"):
        raise _Refused("kv_transfer_params: prefill/decode disaggregation is not supported by llmserve")
    if req.HasField("mm_inputs"):
        raise _Refused("mm_inputs: multimodal input is not supported by llmserve")
    if req.HasField("data_parallel_rank") and req.data_parallel_rank != 0:
        raise _Refused(f"data_parallel_rank must be 0 (an llmserve pool is one engine), got {req.data_parallel_rank}")

    out = pb.GenerateRequest(request_id=req.request_id)
    kind = req.WhichOneof("input")
    if kind is None:
        raise _Refused("input is missing: set tokenized or text")
    if s.HasField("truncate_prompt_tokens"):
        keep = s.truncate_prompt_tokens
        if keep < -1 or keep == 0:
            raise _Refused(f"sampling_params.truncate_prompt_tokens must be -1 or >= 1, got {keep}")
        ids = list(req.tokenized.input_ids) if kind == "tokenized" else tokenize(req.text)
        if keep > 0:
            ids = ids[-keep:]
        out.token_ids.ids.extend(ids)  # keep == -1 (max-model-len): build_request refuses a longer prompt by name
    elif kind == "tokenized":
        out.token_ids.ids.extend(req.tokenized.input_ids)
    else:
        out.text = req.text

    o = out.sampling
    refused = vllm_to_public(s, o)  # the sampling table's fields, by vLLM's names (proto3 zeros it forbids: unset)
    if refused is not None:
        raise _Refused(refused)
    o.stop.extend(s.stop)
    o.skip_special_tokens = s.skip_special_tokens
    o.n = max(1, s.n)
    o.include_stop_str_in_output = s.include_stop_str_in_output
    if constraint == "choice":
        o.choice.choices.extend(s.choice.choices)
    elif constraint is not None:  # json_schema, regex, grammar, json_object: the same names in llmserve.v1
        setattr(o, constraint, getattr(s, constraint))
    return out


class _Sequence:
    """What one of the n sequences has produced so far (for the final GenerateComplete)."""

    def __init__(self):
        self.ids: list[int] = []
        self.logprobs = vpb.OutputLogProbs()


def _add_logprobs(dst: vpb.OutputLogProbs, msg: pb.GenerateResponse) -> None:
    for lp in msg.logprobs:
        dst.token_logprobs.append(lp.logprob)
        dst.token_ids.append(lp.token_id)
        dst.top_logprobs.add(values=[t.logprob for t in lp.top], token_ids=[t.token_id for t in lp.top])


def input_logprobs(msg: pb.GenerateResponse) -> vpb.InputLogProbs:
    """llmserve.v1's prompt logprobs as vLLM's InputLogProbs: one entry per prompt token, the first without a
    value."""
    out = vpb.InputLogProbs(token_ids=msg.prompt_token_ids)
    out.token_logprobs.add()
    out.top_logprobs.add()
    for lp in msg.prompt_logprobs:
        out.token_logprobs.add(value=lp.logprob)
        out.top_logprobs.add(values=[t.logprob for t in lp.top], token_ids=[t.token_id for t in lp.top])
    return out


class VllmEngineServicer(vpb_grpc.VllmEngineServicer):
    def __init__(self, public: LLMServeServicer):
        self.public = public
        self.driver = public.driver
        self.started = time.time()
        self.last_receive = 0.0
        self._tokenizer_zip: tuple[bytes, str] | None = None

    @retryable_store_errors
    async def Generate(self, request: vpb.GenerateRequest, context):
        self.last_receive = time.time()
        try:
            lreq = to_llmserve(request, lambda text: self.public.tokenizer().encode(text))
        except _Refused as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # An id of its own from the start: admitted again by it after a stand-down (held_stream.py).
        lreq.request_id = lreq.request_id or uuid.uuid4().hex
        rid, streams = await self.public.admit(lreq, context, _rename)
        want_logprobs = request.sampling_params.HasField("logprobs")
        prompt_lps = None  # vLLM's InputLogProbs, from the first message (with sampling_params.prompt_logprobs)
        seqs = [_Sequence() for _ in streams]
        held = HeldStream(self.public, lreq, rid, streams, context, _rename)
        async for msg in held:
            i = msg.index
            streams = held.streams  # new ones after a stand-down
            req = streams[i].pub.request
            seq = seqs[i]
            seq.ids.extend(msg.token_ids)
            if want_logprobs:
                _add_logprobs(seq.logprobs, msg)
            first_prompt_lps = None
            if msg.prompt_token_ids:
                first_prompt_lps = prompt_lps = input_logprobs(msg)
            if request.stream and msg.token_ids:
                chunk = vpb.GenerateStreamChunk(token_ids=msg.token_ids, prompt_tokens=req.num_prompt_tokens,
                                                completion_tokens=len(seq.ids), cached_tokens=req.num_cached_tokens,
                                                index=i)
                if want_logprobs:
                    _add_logprobs(chunk.output_logprobs, msg)
                if first_prompt_lps is not None:
                    chunk.input_logprobs.CopyFrom(first_prompt_lps)
                yield vpb.GenerateResponse(chunk=chunk)
            if msg.finish_reason:
                done = vpb.GenerateComplete(
                    output_ids=seq.ids, finish_reason=msg.finish_reason, prompt_tokens=req.num_prompt_tokens,
                    completion_tokens=msg.usage.completion_tokens, cached_tokens=req.num_cached_tokens, index=i)
                if want_logprobs:
                    done.output_logprobs.CopyFrom(seq.logprobs)
                if prompt_lps is not None:
                    done.input_logprobs.CopyFrom(prompt_lps)
                if streams[i].stopped_by_string:
                    done.matched_stop_str = streams[i].detok.stopped_by
                elif msg.finish_reason == "stop" and seq.ids and (seq.ids[-1] in req.sampling.stop_token_ids
                                                                  or seq.ids[-1] in self._eos_ids()):
                    done.matched_token_id = seq.ids[-1]
                yield vpb.GenerateResponse(complete=done)

    @retryable_store_errors
    async def Embed(self, request: vpb.EmbedRequest, context):
        self.last_receive = time.time()
        if not request.tokenized.input_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tokenized.input_ids is empty: an embedding needs a "
                                "prompt")
        lreq = pb.EmbedRequest(request_id=request.request_id)
        lreq.token_ids.ids.extend(request.tokenized.input_ids)
        # Held across a stand-down like Generate (a gateway does not send it again): servers/held_embed.py.
        out = await held_embed(self.public, embed.generate_request(lreq, request.request_id or uuid.uuid4().hex),
                               context, _rename)
        return vpb.EmbedResponse(embedding=out.embedding, prompt_tokens=out.prompt_tokens,
                                 embedding_dim=len(out.embedding))

    def _eos_ids(self) -> set[int]:
        info = self.driver.worker_info
        return set(info.model.eos_token_ids) if info is not None else set()

    @retryable_store_errors
    async def Abort(self, request: vpb.AbortRequest, context):
        await self.public.refuse_unless_leading(context)
        for rid in request.request_ids:
            abort_sequences(self.driver.abort, rid)
        return vpb.AbortResponse()

    async def HealthCheck(self, request, context):
        if self.driver.ready.is_set() and not self.driver.draining.is_set():
            return vpb.HealthCheckResponse(healthy=True, message="serving")
        why = "draining" if self.driver.draining.is_set() else "no worker registered yet (or a standby)"
        return vpb.HealthCheckResponse(healthy=False, message=why)

    async def GetModelInfo(self, request, context):
        info = self.driver.worker_info
        if info is None or not self.driver.ready.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is registered with this scheduler yet")
        m = info.model
        tok = await asyncio.get_running_loop().run_in_executor(None, self.public.tokenizer)
        bos = m.bos_token_id if m.HasField("bos_token_id") else (tok.bos_token_id or 0)
        return vpb.GetModelInfoResponse(
            model_path=m.path, is_generation=True, max_context_length=info.max_model_len, vocab_size=m.vocab_size,
            supports_vision=False, served_model_name=m.name, tokenizer_path=self.public._tokenizer_path or m.path,
            model_type=m.architecture.lower().removesuffix("forcausallm"), architectures=[m.architecture],
            eos_token_ids=list(m.eos_token_ids), pad_token_id=0, bos_token_id=bos,
            max_req_input_len=info.max_model_len - 1, default_sampling_params_json="{}")

    def _active(self) -> int:
        return len(self.driver.outbox.unfinished_ids())

    async def GetServerInfo(self, request, context):
        return vpb.GetServerInfoResponse(
            active_requests=self._active(), is_paused=self.driver.draining.is_set(),
            last_receive_timestamp=self.last_receive, uptime_seconds=time.time() - self.started,
            server_type="llmserve-grpc", data_parallel_size=1)

    async def GetLoads(self, request, context):
        # Read without the driver lock: a snapshot for load balancing, at most one step old.
        core, info = self.driver.core, self.driver.worker_info
        load = vpb.SchedulerLoad(dp_rank=0, max_running_requests=self.driver.cfg.policy.max_num_seqs)
        if core is not None and info is not None:
            load.num_running_reqs, load.num_waiting_reqs = len(core.running), len(core.waiting)
            load.num_total_reqs = load.num_running_reqs + load.num_waiting_reqs
            load.num_used_tokens = core.pool.num_used * info.block_size
            load.max_total_num_tokens = core.pool.num_blocks * info.block_size
            load.token_usage = core.pool.usage
        return vpb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(), version="llmserve",
                                    dp_rank_count=1, loads=[load])

    async def GetTokenizer(self, request, context):
        if self.driver.worker_info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is registered with this scheduler yet")
        if self._tokenizer_zip is None:
            self._tokenizer_zip = await asyncio.get_running_loop().run_in_executor(None, self._build_tokenizer_zip)
        data, digest = self._tokenizer_zip
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            last = start + TOKENIZER_CHUNK_BYTES >= len(data)
            yield vpb.GetTokenizerChunk(data=data[start:start + TOKENIZER_CHUNK_BYTES], sha256=digest if last else "")

    def _build_tokenizer_zip(self) -> tuple[bytes, str]:
        data = tokenizer_zip(self.public._tokenizer_path or self.driver.worker_info.model.path,
                             self.public.tokenizer(), self.driver.worker_info)
        return data, hashlib.sha256(data).hexdigest()


def tokenizer_files(path: str, tokenizer, info) -> dict[str, bytes]:
    """The tokenizer files of the model at `path`: a HF directory's own, or, for a GGUF, files built from its
    metadata (tokenizer.json from the assembled BPE tokenizer; the chat template and BOS/EOS in tokenizer_config.json;
    the EOS ids in generation_config.json)."""
    if os.path.isdir(path):
        files = {}
        for name in _HF_TOKENIZER_FILES:
            full = os.path.join(path, name)
            if os.path.exists(full):
                with open(full, "rb") as f:
                    files[name] = f.read()
        return files

    def text(token_id):
        return tokenizer.id_to_token(token_id) if token_id is not None else None
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": info.max_model_len,
              "bos_token": text(tokenizer.bos_token_id), "eos_token": text(tokenizer.eos_token_id),
              "clean_up_tokenization_spaces": False}
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    generation = {"eos_token_id": list(info.model.eos_token_ids) or tokenizer.eos_token_id}
    if tokenizer.bos_token_id is not None:
        generation["bos_token_id"] = tokenizer.bos_token_id
    return {"tokenizer.json": tokenizer.backend.to_str().encode(),
            "tokenizer_config.json": json.dumps(config, indent=2).encode(),
            "generation_config.json": json.dumps(generation, indent=2).encode()}


def tokenizer_zip(path: str, tokenizer, info) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in sorted(tokenizer_files(path, tokenizer, info).items()):
            z.writestr(zipfile.ZipInfo(name, _ZIP_DATE), data, zipfile.ZIP_DEFLATED)
    return buf.getvalue()
