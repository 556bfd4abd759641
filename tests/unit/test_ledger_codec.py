"""The step commit's encoding: a step writes only what changed since the last commit of the same lease."""

from __future__ import annotations

import msgpack

from common.sampling_fields import SamplingParams
from scheduler_svc.core.block_pool import BlockState
from scheduler_svc.core.request import Request, Status
from scheduler_svc.core.step_records import StepCommit
from scheduler_svc.ledger.codec import CommitEncoder, pack_ids, unpack_cached_block, unpack_ids

SECTIONS = ("new", "state", "computed", "blk_add", "blk_set", "out", "fin", "blocks")


def running(i: int, blocks: list[int]) -> Request:
    return Request(request_id=f"{i:032x}", prompt_ids=list(range(3, 40)), arrival_seq=i + 1, status=Status.RUNNING,
                   sampling=SamplingParams(max_tokens=100, seed=i), block_ids=blocks, num_computed_tokens=37,
                   first_token_time=1000.0 + i)


def decode(reqs: list[Request], token: int) -> StepCommit:
    for r in reqs:
        r.output_ids.append(token)
        r.num_computed_tokens += 1
    return StepCommit(token, len(reqs), updated=reqs, appended={r.request_id: [token] for r in reqs})


def sections(payload: bytes) -> dict:
    return msgpack.unpackb(payload, raw=True, strict_map_key=False)


def nonempty(payload: bytes) -> set[str]:
    return {k.decode() for k, v in sections(payload).items() if k.decode() in SECTIONS and v}


def joined(n: int) -> tuple[CommitEncoder, list[Request]]:
    enc, reqs = CommitEncoder(), [running(i, [3 * i, 3 * i + 1, 3 * i + 2]) for i in range(n)]
    enc.encode(StepCommit(1, n, new_requests=reqs))
    return enc, reqs


def test_decode_step_writes_one_token_and_num_computed_per_request():
    enc, reqs = joined(3)
    p = enc.encode(decode(reqs, 77))
    assert nonempty(p) == {"computed", "out"}
    c = sections(p)
    assert c[b"computed"] == [v for r in reqs for v in (r.arrival_seq, r.num_computed_tokens)]
    assert c[b"out"] == [v for r in reqs for v in (r.arrival_seq, pack_ids([77]))]


def test_decode_commit_size_is_linear_and_small_per_request():
    sizes = {}
    for n in (1, 10, 100):
        enc, reqs = joined(n)
        enc.encode(decode(reqs, 5))
        sizes[n] = len(enc.encode(decode(reqs, 6)))
    per_request = (sizes[100] - sizes[10]) / 90
    # Linear (msgpack ints above 127 take one more byte), and small: seq + num_computed + one packed token; the
    # 32-character request id is not sent.
    assert abs(per_request - (sizes[10] - sizes[1]) / 9) <= 1
    assert per_request <= 12
    assert sizes[1] < 120


def test_block_table_grows_by_appending_and_is_rewritten_on_preemption_or_copy():
    enc, (r,) = joined(1)
    r.block_ids = [*r.block_ids, 9]
    c = sections(enc.encode(decode([r], 1)))
    assert c[b"blk_add"] == [r.arrival_seq, pack_ids([9])] and c[b"blk_set"] == []
    # Copy-on-write replaces the last block in place: the whole table goes.
    r.block_ids = [*r.block_ids[:-1], 11]
    c = sections(enc.encode(StepCommit(2, 1, updated=[r])))
    assert c[b"blk_set"] == [r.arrival_seq, pack_ids(r.block_ids)] and c[b"blk_add"] == []
    # Preemption: empty table, status and count change, progress restarts.
    r.block_ids, r.status, r.num_preemptions, r.num_computed_tokens = [], Status.WAITING, 1, 0
    c = sections(enc.encode(StepCommit(3, 1, updated=[r])))
    assert c[b"blk_set"] == [r.arrival_seq, b""]
    assert c[b"state"] == [[r.request_id.encode(), b"status", b"waiting", b"num_preemptions", b"1"]]
    assert c[b"computed"] == [r.arrival_seq, 0]
    # Unchanged since: nothing but the step itself.
    assert nonempty(enc.encode(StepCommit(4, 1, updated=[r]))) == set()


def test_first_token_time_is_written_once():
    enc = CommitEncoder()
    r = running(0, [1])
    r.first_token_time = None
    enc.encode(StepCommit(1, 1, new_requests=[r]))
    r.first_token_time = 1234.5678901234567
    c = sections(enc.encode(decode([r], 3)))
    assert c[b"state"] == [[r.request_id.encode(), b"first_token_time", repr(r.first_token_time).encode()]]
    assert sections(enc.encode(decode([r], 4)))[b"state"] == []


def test_forgotten_memory_writes_whole_states_and_finish_writes_the_final_record():
    enc, (r,) = joined(1)
    enc.forget()  # a commit's outcome was unknown, or another lease wrote since
    c = sections(enc.encode(decode([r], 1)))
    assert c[b"state"] == [[r.request_id.encode(), b"status", b"running", b"num_preemptions", b"0",
                            b"first_token_time", repr(r.first_token_time).encode()]]
    assert c[b"blk_set"] == [r.arrival_seq, pack_ids(r.block_ids)]
    r.status, r.finish_reason, r.block_ids = Status.FINISHED, "stop", []
    c = sections(enc.encode(StepCommit(2, 1, finished=[r], appended={r.request_id: [8]})))
    assert c[b"out"] == [r.arrival_seq, pack_ids([8])]
    (fin,) = c[b"fin"]
    assert fin[:2] == [r.request_id.encode(), r.arrival_seq] and b"finish_reason" in fin and b"stop" in fin
    assert r.request_id not in enc.written


def test_block_changes_and_cached_block_records_round_trip():
    h = bytes(range(16))
    c = sections(CommitEncoder().encode(StepCommit(1, 0, block_changes={4: BlockState(2), 5: BlockState(0, h, (7, 8),
                                                                                                          lru_tick=3)})))
    assert c[b"blocks"][:4] == [4, 2, 0, b""]
    assert c[b"blocks"][4:7] == [5, 0, 3] and unpack_cached_block(c[b"blocks"][7]) == (h, (7, 8))
    assert unpack_ids(pack_ids([0, 1, 2**32 - 1])) == [0, 1, 2**32 - 1] and unpack_ids(b"") == []
