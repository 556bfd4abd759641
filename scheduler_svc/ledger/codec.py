"""One step's commit as a single msgpack argument to the COMMIT script, carrying only what changed.

A decode step changes, per running request, one appended token and `num_computed_tokens`; everything else (status,
preemption count, first-token time, the block table) changes only at transitions or every block_size tokens. The
encoder remembers what it last wrote for each active request (`Written`), so the payload holds only the differences:

    new       [[rid, seq, field, value, ...]]   a joining request's whole record (spec and state)
    state     [[rid, field, value, ...]]        status / num_preemptions / first_token_time, on change only
    computed  [seq, n, seq, n, ...]             num_computed_tokens of active requests, on change only
    blk_add   [seq, packed ids, ...]            block ids appended to a table (the common growth)
    blk_set   [seq, packed ids, ...]            a table rewritten whole (preemption, copy-on-write, resume)
    out       [seq, packed ids, ...]            tokens appended to a request's output
    lp        [seq, packed logprobs, ...]       those tokens' logprobs, for requests that asked (`pack_logprobs`)
    fin       [[rid, seq, field, value, ...]]   a finishing request's final state
    blocks    [block, ref_count, lru_tick, hash record, ...]   the pool's block changes ("" = no cached content)
    states    [slot, owner record, ...]         hybrid models' state slot changes ("" = free; state_pool.py)

`seq` is the request's arrival_seq (unique in a pool): the per-step keys are addressed by it, so a decode step
carries a few bytes per request whatever the length of its id. Token and block ids are packed little-endian uint32
(`pack_ids`), appended to Redis strings as they are. Floats travel as repr() strings: Redis would format a Lua
number with 14 significant digits. Logprobs are float32 on the wire from the worker and stored as such, so what a new
leader re-sends equals what the first one sent.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import msgpack

from scheduler_svc.core.request import Request
from scheduler_svc.core.step_records import Logprobs, StepCommit

HASH_BYTES = 16  # block_pool.hash_block's digest size: a cached block's record is hash bytes + packed tokens


def pack_ids(ids: list[int] | tuple[int, ...]) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


def unpack_ids(data: bytes | None) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}I", data)) if data else []


_NO_LOGPROBS = 0xFFFFFFFF  # a token stored without logprobs (its step result had none): keeps out and lp aligned


def pack_logprobs(lps: list[Logprobs | None]) -> bytes:
    """Per token: uint32 k, float32 logprob, then k pairs (uint32 token id, float32 logprob): 8 + 8k bytes."""
    parts = []
    for lp in lps:
        if lp is None:
            parts.append(struct.pack("<If", _NO_LOGPROBS, 0.0))
            continue
        flat = [x for pair in lp.top for x in pair]
        parts.append(struct.pack(f"<If{'If' * len(lp.top)}", len(lp.top), lp.logprob, *flat))
    return b"".join(parts)


def unpack_logprobs(data: bytes | None) -> list[Logprobs | None]:
    out: list[Logprobs | None] = []
    pos, data = 0, data or b""
    while pos < len(data):
        k, logprob = struct.unpack_from("<If", data, pos)
        pos += 8
        if k == _NO_LOGPROBS:
            out.append(None)
            continue
        flat = struct.unpack_from(f"<{'If' * k}", data, pos)
        pos += 8 * k
        out.append(Logprobs(logprob, [(flat[i], flat[i + 1]) for i in range(0, 2 * k, 2)]))
    return out


def pack_cached_block(block_hash: bytes, tokens: tuple[int, ...]) -> bytes:
    if len(block_hash) != HASH_BYTES:
        raise ValueError(f"block hash of {len(block_hash)} bytes; the ledger stores {HASH_BYTES}")
    return block_hash + pack_ids(tokens)


def unpack_cached_block(record: bytes) -> tuple[bytes, tuple[int, ...]]:
    return record[:HASH_BYTES], tuple(unpack_ids(record[HASH_BYTES:]))


def opt_float(x: float | None) -> str:
    return "" if x is None else repr(x)


def spec_fields(r: Request) -> list[str]:
    """The request's spec, written once when it joins (field, value, ...)."""
    return ["prompt", ",".join(map(str, r.prompt_ids)),
            "sampling", json.dumps(r.sampling.to_dict(), separators=(",", ":")),
            "priority", str(r.priority), "arrival_time", repr(r.arrival_time), "arrival_seq", str(r.arrival_seq),
            "stop", json.dumps(r.stop), "include_stop", "1" if r.include_stop_str_in_output else "0",
            "skip_special", "1" if r.skip_special_tokens else "0", "cache_salt", r.cache_salt, "fork_of", r.fork_of,
            "lora", r.lora_name, "lora_path", r.lora_path]


def final_fields(r: Request) -> list[str]:
    """The transition fields of a request's hash (field, value, ...), all of them."""
    return ["status", r.status.value, "num_preemptions", str(r.num_preemptions),
            "first_token_time", opt_float(r.first_token_time), "finish_reason", r.finish_reason or ""]


@dataclass(slots=True)
class Written:
    """What the ledger holds for an active request, as this encoder last wrote it."""

    seq: int  # arrival_seq: the key of its per-step records
    status: str
    num_computed: int
    num_preemptions: int
    first_token_time: float | None
    blocks: list[int]

    @classmethod
    def of(cls, r: Request) -> Written:
        return cls(r.arrival_seq, r.status.value, r.num_computed_tokens, r.num_preemptions, r.first_token_time,
                   list(r.block_ids))


class CommitEncoder:
    """Turns StepCommits into COMMIT payloads, diffing each request against what was last written.

    The memory is valid only while every commit it encoded reached Redis under one lease: `forget()` it when a
    commit's outcome is unknown or the lease changes, and the next commit of each request writes its whole state.
    """

    def __init__(self) -> None:
        self.written: dict[str, Written] = {}

    def forget(self) -> None:
        self.written.clear()

    def encode(self, commit: StepCommit) -> bytes:
        written = self.written
        new: list[list] = []
        state: list[list] = []
        computed: list[int] = []
        blk_add: list[int | bytes] = []
        blk_set: list[int | bytes] = []
        for r in commit.new_requests:
            seq = r.arrival_seq
            new.append([r.request_id, seq, *spec_fields(r), *final_fields(r)])
            computed += (seq, r.num_computed_tokens)
            if r.block_ids:
                blk_set += (seq, pack_ids(r.block_ids))
            written[r.request_id] = Written.of(r)
        for r in commit.updated:
            seq, w = r.arrival_seq, written.get(r.request_id)
            if w is None:  # never written under this lease (resumed, or after an unknown outcome): all of it
                state.append([r.request_id, "status", r.status.value, "num_preemptions", str(r.num_preemptions),
                              "first_token_time", opt_float(r.first_token_time)])
                computed += (seq, r.num_computed_tokens)
                blk_set += (seq, pack_ids(r.block_ids))
                written[r.request_id] = Written.of(r)
                continue
            changed: list[str] = []
            if r.status.value != w.status:
                w.status = r.status.value
                changed += ("status", w.status)
            if r.num_preemptions != w.num_preemptions:
                w.num_preemptions = r.num_preemptions
                changed += ("num_preemptions", str(w.num_preemptions))
            if r.first_token_time != w.first_token_time:
                w.first_token_time = r.first_token_time
                changed += ("first_token_time", opt_float(w.first_token_time))
            if changed:
                state.append([r.request_id, *changed])
            if r.num_computed_tokens != w.num_computed:
                w.num_computed = r.num_computed_tokens
                computed += (seq, w.num_computed)
            table, old = r.block_ids, w.blocks
            if table != old:
                n = len(old)
                if len(table) > n and table[:n] == old:  # grew at the end: send the new ids only
                    blk_add += (seq, pack_ids(table[n:]))
                    old.extend(table[n:])
                else:  # preempted, copy-on-write, requeued: the whole table
                    blk_set += (seq, pack_ids(table))
                    w.blocks = list(table)
        out: list[int | bytes] = []
        finishing = {r.request_id: r.arrival_seq for r in commit.finished}
        for rid, toks in commit.appended.items():
            if toks:
                w = written.get(rid)
                out += (w.seq if w is not None else finishing[rid], pack_ids(toks))
        lp: list[int | bytes] = []
        for rid, lps in commit.logprobs.items():
            if lps:
                w = written.get(rid)
                lp += (w.seq if w is not None else finishing[rid], pack_logprobs(lps))
        fin: list[list] = []
        for r in commit.finished:
            written.pop(r.request_id, None)
            fin.append([r.request_id, r.arrival_seq, *final_fields(r), "num_computed_tokens",
                        str(r.num_computed_tokens)])
        blocks: list[int | bytes] = []
        for b, st in commit.block_changes.items():
            blocks += (b, st.ref_count, st.lru_tick,
                       pack_cached_block(st.hash, st.tokens) if st.hash is not None else b"")
        payload = {"s": commit.step_id, "a": commit.arrival_seq, "ttl": commit.finished_ttl_s,
                   "check": int(commit.check_invariant), "new": new, "state": state, "computed": computed,
                   "blk_add": blk_add, "blk_set": blk_set, "out": out, "fin": fin, "blocks": blocks}
        if lp:  # only steps with a request that asked for logprobs carry the field
            payload["lp"] = lp
        if commit.state_changes:
            payload["states"] = [x for slot, record in sorted(commit.state_changes.items()) for x in (slot, record)]
        if commit.after_step_id is not None:
            payload["prev"] = commit.after_step_id
        return msgpack.packb(payload, use_bin_type=False)  # Redis's cmsgpack reads raw strings, not the bin type
