"""The scheduler's source of truth in Redis: one block pool, its requests, the worker registry, the lease.

Every key of a pool starts with `{namespace}:{{{pool}}}:` (e.g. `llmserve:{0}:free`); the braces are a
Redis Cluster hash tag, so a whole pool lives on one slot and a Lua script may touch all of it.

    meta          HASH    schema_version (SCHEMA_VERSION when the pool was created), num_blocks, block_size,
                          step_id (last committed), arrival_seq (counter),
                          worker_address, worker_epoch, worker_<key> for the rest of the worker's info
    free          SET     free block ids holding no cached content
    evict         ZSET    free block ids that still hold a cached (hashed) full block, scored by LRU tick
    refs          HASH    block id -> reference count (only counts > 0)
                          invariant: SCARD(free) + ZCARD(evict) + HLEN(refs) == num_blocks
    bhash         HASH    block id -> 16 hash bytes + its tokens packed uint32, for every block in the prefix-cache
                          index
    active        SET     ids of unfinished requests (waiting or running)
    req:{rid}     HASH    written whole when the request joins and when it finishes: the spec -- prompt ("1,2,3"),
                          sampling (JSON object of common.sampling_fields.SamplingParams.to_dict(), e.g.
                          {"temperature": 0.7, ..., "seed": 1234, "logprobs": null}), priority, arrival_time,
                          arrival_seq, stop (JSON list), include_stop, skip_special, cache_salt, fork_of (n > 1:
                          the sequence it forks from; a new leader queues it on its own), lora and lora_path (its
                          LoRA adapter and PEFT directory; absent or "": the base model) -- and the
                          transition fields status, num_preemptions, first_token_time ("" = none), finish_reason
                          ("" = none), each rewritten alone when it changes; num_computed_tokens once finished
    computed      HASH    arrival_seq -> num_computed_tokens of every active request (one HSET per step for all)
    sfree         SET     hybrid models: free state slot ids (meta's num_state_slots of them at creation; 0 for a
                          model without recurrent layers)
    sslot         HASH    state slot -> its owner: "r:<rid>" (a request in the worker's batch), "p:<rid>" (a
                          snapshot that request's step in flight saves), "s:<key hex>:<num_tokens>:<lru tick>" (a
                          prefix-cache snapshot of the recurrent state after the prefix whose last full block has
                          that hash); invariant: SCARD(sfree) + HLEN(sslot) == num_state_slots. The state itself is
                          never stored: a new leader keeps the snapshots (valid as cached blocks are) and resumes
                          every request by recompute
    out:{seq}     STRING  output token ids, packed little-endian uint32, APPENDed each step (seq = arrival_seq,
                          unique in a pool: a decode step names a request in a few bytes whatever its id)
    blk:{seq}     STRING  block table, packed uint32: new ids APPENDed; SET whole on preemption, copy-on-write,
                          resume; deleted when the request finishes
    lp:{seq}      STRING  a request that asked for logprobs: its output tokens' logprobs, one record per token of
                          out:{seq} (codec.pack_logprobs: 8 + 8k bytes for k top logprobs), APPENDed in the same
                          commit as the tokens; expires with out:{seq}
    lease         STRING  "holder:token", PX ttl: the one scheduler allowed to write
    fence         STRING  counter; each new lease takes the next value as its fencing token (a leader whose
                          worker already saw a newer one jumps past it: `advance_fence`)

The layout above is schema_version SCHEMA_VERSION, recorded in meta when `init_pool` creates the pool (version 1
was never recorded; it stored sampling as base64 of the worker's SamplingParams proto bytes; version 2 rewrote
every request's state each step, outputs and tables as text keyed by request id). A scheduler refuses
to start on a pool of another version, or of none: `init_pool` and `load` raise `SchemaMismatch` (a ConfigError,
fatal at start-up); flush the namespace or use another --namespace. Bump SCHEMA_VERSION with any change to the
keys, their encodings or the sampling record's fields.

Each step's effects (new requests, what changed of running ones, appended tokens, finishes, block changes, step id)
go in with ONE EVALSHA (`commit_step`) of one msgpack argument (`ledger_codec.py`: only what differs from what this
lease last wrote), which first checks the caller still holds the lease.
Finished requests leave `active` and `computed`; their req, out and lp keys expire after `finished_ttl_s`. `out:{seq}`
grows only through `StepCommit.appended`; a new request resets its keys (a reused id starts clean). `load()`
returns requests by arrival_seq and a BlockPool whose free list is in id order (the in-memory free order is not
persisted).
A request id may be any string; the script builds its keys inside the pool's hash tag (undeclared keys
in the same slot, which Redis Cluster serves).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis

from common.sampling_fields import SamplingParams
from common.validation import ConfigError
from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.request import Request, Status
from scheduler_svc.core.step_records import StepCommit
from scheduler_svc.ledger import scripts
from scheduler_svc.ledger.codec import CommitEncoder, unpack_cached_block, unpack_ids, unpack_logprobs
from scheduler_svc.ledger.redis_ha import Durability

# The layout of a pool's keys (see the table above). 2: sampling as JSON of SamplingParams.to_dict(). 3: per-step
# state written as deltas (computed hash, packed out/blk strings keyed by arrival_seq, binary bhash records). 5: the
# sampling record gains logit_bias and bad_words (common/sampling_fields.py). 6: the sampling record gains
# prompt_logprobs and embed; a request record may carry its LoRA adapter (lora, lora_path); the lora_adapters hash.
# 7: state slots of hybrid models (meta's num_state_slots, sfree, sslot). 8: output logprobs (lp:{seq}).
SCHEMA_VERSION = 8


class LeaseLost(Exception):
    """The caller's lease expired or another scheduler took the pool over; it must stop writing."""


class LedgerBehind(LeaseLost):
    """The ledger lacks steps this scheduler committed (a fail-over promoted a lagging replica): nothing was
    written; stop, and take the pool over again from what the ledger holds (scheduler_svc/ledger/failover.py)."""


class SchemaMismatch(ConfigError):
    """The pool in Redis was written with another schema_version (or before versions were recorded)."""

    def __init__(self, prefix: str, found: str | None):
        self.found = found
        have = (f"schema_version {found}" if found is not None
                else "no schema_version (written before versions were recorded: schema_version 1)")
        super().__init__(
            f"pool {prefix!r} in Redis has {have}, but this scheduler reads and writes schema_version "
            f"{SCHEMA_VERSION}; refusing to start on it. Flush that namespace's keys (e.g. redis-cli --scan "
            f"--pattern '{prefix}*' | xargs redis-cli unlink; its requests are lost) or start the scheduler "
            "with another --namespace")


def check_schema(prefix: str, found: str | None) -> None:
    """Raise SchemaMismatch unless `found` (meta's schema_version, None if absent) is SCHEMA_VERSION."""
    if found != str(SCHEMA_VERSION):
        raise SchemaMismatch(prefix, found)


class InvariantViolation(Exception):
    """The commit would break SCARD(free) + HLEN(refs) == num_blocks (or names a block outside the pool)."""


@dataclass
class LoadedState:
    requests: list[Request]  # every unfinished request, ordered by arrival_seq
    pool: BlockPool
    step_id: int
    arrival_seq: int
    meta: dict[str, str]
    state_records: dict[int, str]  # hybrid models: state slot -> owner record (sslot), free slots absent


def _text(x: bytes | str) -> str:
    # The client may or may not decode responses.
    return x.decode() if isinstance(x, bytes) else x


def _pairs(flat: list) -> dict[str, str]:
    return {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat), 2)}


def _parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _decode_request(rid: str, f: dict[str, str], out: bytes, blocks: bytes, computed: str | None,
                    lps: bytes = b"") -> Request:
    """A request from its hash, packed output, block table and output logprobs; `computed`: its entry in
    `computed` (active)."""
    ftt = f.get("first_token_time", "")
    sampling = SamplingParams.from_dict(json.loads(f["sampling"]))
    return Request(
        request_id=rid,
        prompt_ids=_parse_ints(f["prompt"]),
        sampling=sampling,
        priority=int(f["priority"]),
        arrival_time=float(f["arrival_time"]),
        arrival_seq=int(f["arrival_seq"]),
        stop=json.loads(f["stop"]),
        include_stop_str_in_output=f["include_stop"] == "1",
        skip_special_tokens=f["skip_special"] == "1",
        cache_salt=f.get("cache_salt", ""),
        fork_of=f.get("fork_of", ""),
        lora_name=f.get("lora", ""),
        lora_path=f.get("lora_path", ""),
        output_ids=unpack_ids(out),
        num_computed_tokens=int(computed if computed is not None else f["num_computed_tokens"]),
        block_ids=unpack_ids(blocks),
        status=Status(f["status"]),
        finish_reason=f.get("finish_reason") or None,
        num_preemptions=int(f["num_preemptions"]),
        first_token_time=float(ftt) if ftt else None,
        output_logprobs=unpack_logprobs(lps) if sampling.logprobs is not None else None,
    )


def _binary_client(client: redis.Redis) -> redis.Redis:
    """`client`, or one on the same server that returns bytes: outputs and block tables are stored packed, which a
    client that decodes responses would try to read as UTF-8."""
    pool = client.connection_pool
    if not pool.connection_kwargs.get("decode_responses"):
        return client
    return redis.Redis(connection_pool=pool.__class__(connection_class=pool.connection_class,
                                                      **{**pool.connection_kwargs, "decode_responses": False}))


def _script_error(e: redis.ResponseError) -> Exception:
    msg = str(e)
    if "LEDGER_BEHIND" in msg:
        return LedgerBehind(msg)
    if "LEASE_LOST" in msg:
        return LeaseLost(msg)
    if "INVARIANT" in msg:
        return InvariantViolation(msg)
    return e


class RedisLedger:
    def __init__(self, client: redis.Redis, namespace: str = "llmserve", pool: str = "0",
                 durability: Durability | None = None):
        if any(c in namespace + pool for c in "{}"):
            raise ValueError(f"namespace {namespace!r} and pool {pool!r} must not contain '{{' or '}}'")
        self.client = _binary_client(client)
        self.durability = durability or Durability()
        self.namespace = namespace
        self.pool_name = pool
        self.prefix = f"{namespace}:{{{pool}}}:"
        p = self.prefix
        self.k_meta, self.k_free, self.k_refs = p + "meta", p + "free", p + "refs"
        self.k_active, self.k_lease, self.k_fence = p + "active", p + "lease", p + "fence"
        client = self.client
        # register_script: EVALSHA, with a one-time SCRIPT LOAD on NOSCRIPT.
        self._acquire = client.register_script(scripts.ACQUIRE)
        self._renew = client.register_script(scripts.RENEW)
        self._release = client.register_script(scripts.RELEASE)
        self._advance = client.register_script(scripts.ADVANCE)
        self._init_pool = client.register_script(scripts.INIT_POOL)
        self._set_worker = client.register_script(scripts.SET_WORKER)
        self._commit = client.register_script(scripts.COMMIT)
        self._load = client.register_script(scripts.LOAD)
        self._get_request = client.register_script(scripts.GET_REQUEST)
        # What this lease last wrote per active request: a commit sends only the differences.
        self._encoder = CommitEncoder()
        self._encoder_token: int | None = None

    # ---- lease -------------------------------------------------------------------------------------------

    def try_acquire_lease(self, holder: str, ttl_ms: int) -> int | None:
        """A new fencing token if the pool had no lease; our own token (renewed) if we hold it; else None."""
        token = self._acquire(keys=[self.k_lease, self.k_fence], args=[holder, ttl_ms])
        return None if token is None else int(token)

    def renew_lease(self, holder: str, token: int, ttl_ms: int) -> bool:
        return bool(self._renew(keys=[self.k_lease], args=[f"{holder}:{token}", ttl_ms]))

    def advance_fence(self, holder: str, token: int, floor: int, ttl_ms: int) -> int:
        """Re-token the lease we hold with a fencing token above `floor` (and above every token this pool issued).

        For a worker that already accepted a token this pool's counter has not reached (Redis lost its data, the
        pool was flushed, or the worker served another namespace): it would reject every plan of ours otherwise.
        Raises LeaseLost if we no longer hold the lease.
        """
        try:
            token = self._advance(keys=[self.k_lease, self.k_fence], args=[f"{holder}:{token}", holder, floor, ttl_ms])
            return int(token)
        except redis.ResponseError as e:
            raise _script_error(e) from None

    def release_lease(self, holder: str, token: int) -> None:
        self._release(keys=[self.k_lease], args=[f"{holder}:{token}"])

    # ---- pool and worker registry --------------------------------------------------------------------------

    def init_pool(self, num_blocks: int, block_size: int, num_state_slots: int = 0) -> bool:
        """Create the pool (all blocks and state slots free, schema_version SCHEMA_VERSION) unless it exists; an
        existing pool must have this schema_version (else SchemaMismatch) and the same shape (else ValueError)."""
        res = self._init_pool(keys=[self.k_meta, self.k_free, self.k_refs, self.prefix + "sfree",
                                    self.prefix + "sslot"],
                              args=[num_blocks, block_size, SCHEMA_VERSION, num_state_slots])
        if res == 1:
            return True
        check_schema(self.prefix, None if res[2] is None else _text(res[2]))
        have = (int(res[0]), int(res[1]), int(res[3] or 0))
        if have != (num_blocks, block_size, num_state_slots):
            raise ValueError(f"pool {self.prefix!r} exists with num_blocks={have[0]}, block_size={have[1]}, "
                             f"num_state_slots={have[2]}; asked for num_blocks={num_blocks}, "
                             f"block_size={block_size}, num_state_slots={num_state_slots} "
                             "(flush that namespace's keys or use another --namespace)")
        return False

    def set_worker(self, token: int, address: str, epoch: str, info: dict[str, str]) -> str | None:
        """Record the pool's worker (fenced by the lease token); returns the previous worker's epoch."""
        args: list[str | int] = [token, address, epoch]
        for k, v in info.items():
            args += [f"worker_{k}", str(v)]
        try:
            prev = self._set_worker(keys=[self.k_lease, self.k_meta], args=args)
        except redis.ResponseError as e:
            raise _script_error(e) from None
        return None if prev is None else _text(prev)

    # ---- the step commit -------------------------------------------------------------------------------------

    def commit_step(self, holder: str, token: int, ttl_ms: int, commit: StepCommit) -> None:
        """Write one step's effects atomically in one round trip, and renew the lease. Raises LeaseLost, or
        LedgerBehind when the ledger does not hold `commit.after_step_id`."""
        if token != self._encoder_token:  # another lease may have written since: start from whole states
            self._encoder.forget()
            self._encoder_token = token
        payload = self._encoder.encode(commit)
        keys = [self.k_lease, self.k_meta, self.k_free, self.k_refs, self.k_active]
        args = [f"{holder}:{token}", ttl_ms, self.prefix, payload]
        wait = self.durability.command()
        try:
            if wait is None:
                self._commit(keys=keys, args=args)
            else:  # one connection: WAIT / WAITAOF count what this connection wrote
                pipe = self.client.pipeline(transaction=False)
                self._commit(keys=keys, args=args, client=pipe)
                pipe.execute_command(*wait)
                self.durability.verify(pipe.execute()[1])
        except Exception as e:
            self._encoder.forget()  # outcome unknown: the next commit writes each request's whole state
            if isinstance(e, redis.ResponseError):
                raise _script_error(e) from None
            raise

    # ---- reads -----------------------------------------------------------------------------------------------

    def load(self) -> LoadedState:
        """Everything a new scheduler needs to rebuild its mirror, read atomically."""
        meta_flat, free, refs_flat, reqs, evict, bhash, computed_flat, sslot = self._load(
            keys=[self.k_meta, self.k_free, self.k_refs, self.k_active], args=[self.prefix])
        meta = _pairs(meta_flat)
        if "num_blocks" not in meta:
            raise RuntimeError(f"pool {self.prefix!r} is not initialised (call init_pool first)")
        check_schema(self.prefix, meta.get("schema_version"))  # before decoding any request in the old layout
        self._encoder.forget()  # the caller rebuilds its state from what is read here
        computed = _pairs(computed_flat)
        requests = []
        for i in range(0, len(reqs), 5):
            fields = _pairs(reqs[i + 1])
            if fields:  # an active id without a hash would be a bug elsewhere; skip rather than crash start-up
                requests.append(_decode_request(_text(reqs[i]), fields, reqs[i + 2], reqs[i + 3],
                                                computed.get(fields["arrival_seq"]), reqs[i + 4]))
        requests.sort(key=lambda r: r.arrival_seq)
        refs = {int(b): int(n) for b, n in _pairs(refs_flat).items()}
        cached = {int(bhash[i]): unpack_cached_block(bhash[i + 1]) for i in range(0, len(bhash), 2)}
        pool = BlockPool(int(meta["num_blocks"]), free_ids=sorted(int(b) for b in free), refs=refs, cached=cached,
                         evictable={int(evict[i]): int(float(evict[i + 1])) for i in range(0, len(evict), 2)})
        return LoadedState(requests=requests, pool=pool, step_id=int(meta.get("step_id", 0)),
                           arrival_seq=int(meta.get("arrival_seq", 0)), meta=meta,
                           state_records={int(s): r for s, r in _pairs(sslot).items()})

    def get_request(self, rid: str) -> Request | None:
        """A request by id, finished ones included while their keys live."""
        res = self._get_request(args=[self.prefix, rid])
        if not res:
            return None
        fields, out, blocks, lps, computed = res
        computed = None if computed is None else _text(computed)
        return _decode_request(rid, _pairs(fields), out, blocks, computed, lps)

    def check_ledger(self) -> dict:
        """Block accounting for tests; asserts nothing itself."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hget(self.k_meta, "num_blocks")
        pipe.smembers(self.k_free)
        pipe.hgetall(self.k_refs)
        pipe.zrange(self.prefix + "evict", 0, -1)
        pipe.hlen(self.prefix + "bhash")
        pipe.scard(self.k_active)
        pipe.hget(self.k_meta, "num_state_slots")
        pipe.smembers(self.prefix + "sfree")
        pipe.hkeys(self.prefix + "sslot")
        total, free, refs, evict, nhash, active, nslots, sfree, sowned = pipe.execute()
        free_ids = {int(b) for b in free}
        evict_ids = {int(b) for b in evict}
        ref_counts = {int(b): int(n) for b, n in refs.items()}
        counts = {"free": len(free_ids), "evictable": len(evict_ids), "allocated": len(ref_counts),
                  "total": int(total or 0), "refs_sum": sum(ref_counts.values()), "cached": nhash, "active": active,
                  "overlap": len(free_ids & ref_counts.keys()) + len(evict_ids & (free_ids | ref_counts.keys()))}
        if nslots and int(nslots):  # hybrid models: the state slots' accounting beside the blocks'
            sfree_ids, sowned_ids = {int(s) for s in sfree}, {int(s) for s in sowned}
            counts.update(state_slots=int(nslots), state_free=len(sfree_ids), state_owned=len(sowned_ids),
                          state_overlap=len(sfree_ids & sowned_ids))
        return counts

    def flush_pool(self) -> None:
        """Delete every key of this namespace + pool (tests)."""
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in self.prefix) + "*"
        batch: list = []
        for key in self.client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                self.client.unlink(*batch)
                batch = []
        if batch:
            self.client.unlink(*batch)
