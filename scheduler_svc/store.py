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
    bhash         HASH    block id -> "hashhex|t1,t2,..." for every block in the prefix-cache index
    active        SET     ids of unfinished requests (waiting or running)
    req:{rid}     HASH    spec, written once: prompt ("1,2,3"), sampling (JSON object of
                          scheduler_svc.sampling.SamplingParams.to_dict(), e.g. {"temperature": 0.7, ...,
                          "seed": 1234, "logprobs": null}), priority, arrival_time, arrival_seq,
                          stop (JSON list), include_stop, skip_special, cache_salt;
                          state: status, num_computed_tokens, block_ids ("4,7"), num_preemptions,
                          first_token_time ("" = none), finish_reason ("" = none)
    out:{rid}     STRING  output token ids as "12,54," -- APPENDed each step, O(new tokens)
    lease         STRING  "holder:token", PX ttl: the one scheduler allowed to write
    fence         STRING  counter; each new lease takes the next value as its fencing token (a leader whose
                          worker already saw a newer one jumps past it: `advance_fence`)

The layout above is schema_version SCHEMA_VERSION, recorded in meta when `init_pool` creates the pool (version 1
was never recorded; it stored sampling as base64 of the worker's SamplingParams proto bytes). A scheduler refuses
to start on a pool of another version, or of none: `init_pool` and `load` raise `SchemaMismatch` (a ConfigError,
fatal at start-up); flush the namespace or use another --namespace. Bump SCHEMA_VERSION with any change to the
keys, their encodings or the sampling record's fields.

Each step's effects (new requests, state changes, appended tokens, finishes, block ref counts, step id)
go in with ONE EVALSHA (`commit_step`), which first checks the caller still holds the lease.
Finished requests leave `active` and their two keys expire after `finished_ttl_s`. `out:{rid}` grows only
through `StepCommit.appended`; a new request resets both its keys (a reused id starts clean). A block table is
re-sent only when it differs from what this lease token last wrote. `load()` returns requests by arrival_seq
and a BlockPool whose free list is in id order (the in-memory free order is not persisted).
A request id may be any string; the script builds its keys inside the pool's hash tag (undeclared keys
in the same slot, which Redis Cluster serves).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis

from common.validation import ConfigError
from scheduler_svc.block_pool import BlockPool
from scheduler_svc.outputs import StepCommit
from scheduler_svc.request import Request, Status
from scheduler_svc.sampling import SamplingParams

# The layout of a pool's keys (see the table above). 2: sampling as JSON of SamplingParams.to_dict().
SCHEMA_VERSION = 2


class LeaseLost(Exception):
    """The caller's lease expired or another scheduler took the pool over; it must stop writing."""


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


# Field order shared by the Python encoder and the Lua script (flat arrays, one stride per request).
SPEC_FIELDS = ("prompt", "sampling", "priority", "arrival_time", "arrival_seq", "stop", "include_stop",
               "skip_special", "cache_salt")
STATE_FIELDS = ("status", "num_computed_tokens", "block_ids", "num_preemptions", "first_token_time")
FINAL_FIELDS = (*STATE_FIELDS, "finish_reason")
NEW_FIELDS = (*SPEC_FIELDS, *FINAL_FIELDS)


def _lua_list(names: tuple[str, ...]) -> str:
    return "{" + ",".join(f"'{n}'" for n in names) + "}"


_LEASE_CHECK = """
local lease = redis.call('GET', KEYS[1])
if lease ~= ARGV[1] then
  return redis.error_reply('LEASE_LOST lease is ' .. (lease or '(none)') .. ', caller has ' .. ARGV[1])
end
"""

_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local holder, token = string.match(cur, '^(.*):(%d+)$')
  if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return tonumber(token)
  end
  return nil
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. token, 'PX', ARGV[2])
return token
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

# KEYS: lease fence. ARGV: lease value ("holder:token"), holder, floor, ttl_ms. Re-token our lease above `floor`.
_ADVANCE = _LEASE_CHECK + """
local token = redis.call('INCR', KEYS[2])
if token <= tonumber(ARGV[3]) then
  token = tonumber(ARGV[3]) + 1
  redis.call('SET', KEYS[2], token)
end
redis.call('SET', KEYS[1], ARGV[2] .. ':' .. token, 'PX', ARGV[4])
return token
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: meta free refs. ARGV: num_blocks block_size schema_version.
# Returns 1 when created, else {num_blocks, block_size, schema_version (nil if absent)}.
_INIT_POOL = """
local have = redis.call('HMGET', KEYS[1], 'num_blocks', 'block_size', 'schema_version')
if have[1] then return have end
redis.call('DEL', KEYS[2], KEYS[3])
local n = tonumber(ARGV[1])
local ids = {}
for b = 0, n - 1 do
  ids[#ids + 1] = b
  if #ids == 4000 then redis.call('SADD', KEYS[2], unpack(ids)); ids = {} end
end
if #ids > 0 then redis.call('SADD', KEYS[2], unpack(ids)) end
redis.call('HSET', KEYS[1], 'schema_version', ARGV[3], 'num_blocks', ARGV[1], 'block_size', ARGV[2], 'step_id', 0,
           'arrival_seq', 0)
return 1
"""

# KEYS: lease meta. ARGV: token address epoch, then info field/value pairs (already "worker_"-prefixed).
_SET_WORKER = """
local lease = redis.call('GET', KEYS[1])
if not lease or string.match(lease, ':(%d+)$') ~= ARGV[1] then
  return redis.error_reply('LEASE_LOST lease is ' .. (lease or '(none)') .. ', caller has token ' .. ARGV[1])
end
local prev = redis.call('HGET', KEYS[2], 'worker_epoch')
for _, f in ipairs(redis.call('HKEYS', KEYS[2])) do
  if string.sub(f, 1, 7) == 'worker_' then redis.call('HDEL', KEYS[2], f) end  -- forget the old worker
end
local args = {}
for i = 4, #ARGV do args[#args + 1] = ARGV[i] end
args[#args + 1] = 'worker_address'; args[#args + 1] = ARGV[2]
args[#args + 1] = 'worker_epoch'; args[#args + 1] = ARGV[3]
redis.call('HSET', KEYS[2], unpack(args))
return prev
"""

# KEYS: lease meta free refs active. ARGV: lease value, ttl_ms, key prefix, JSON payload.
_COMMIT = _LEASE_CHECK + f"""
local c = cjson.decode(ARGV[4])
local pre = ARGV[3]
local blocks = c.b

-- Validate before any write, so a rejected commit changes nothing.
local k_evict, k_bhash = pre .. 'evict', pre .. 'bhash'
if c.check == 1 then
  local total = tonumber(redis.call('HGET', KEYS[2], 'num_blocks'))
  local nfree, nref = redis.call('SCARD', KEYS[3]), redis.call('HLEN', KEYS[4])
  local nev = redis.call('ZCARD', k_evict)
  for i = 1, #blocks, 4 do
    local b, n, h = blocks[i], blocks[i + 1], blocks[i + 2]
    if b < 0 or b >= total then return redis.error_reply('INVARIANT block ' .. b .. ' outside 0..' .. total - 1) end
    if redis.call('SISMEMBER', KEYS[3], b) == 1 then nfree = nfree - 1 end
    if redis.call('HEXISTS', KEYS[4], b) == 1 then nref = nref - 1 end
    if redis.call('ZSCORE', k_evict, b) then nev = nev - 1 end
    if n > 0 then nref = nref + 1 elseif h ~= '' then nev = nev + 1 else nfree = nfree + 1 end
  end
  if nfree + nev + nref ~= total then
    return redis.error_reply('INVARIANT free ' .. nfree .. ' + evictable ' .. nev .. ' + allocated ' .. nref ..
                             ' ~= total ' .. total)
  end
end

local function hset_stride(list, names, finish)
  local w = #names + 1
  for i = 1, #list, w do
    local rid = list[i]
    local args = {{}}
    for j = 1, #names do
      local v = list[i + j]
      if v ~= false then args[#args + 1] = names[j]; args[#args + 1] = v end  -- false: unchanged, skip
    end
    redis.call('HSET', pre .. 'req:' .. rid, unpack(args))
    if finish then
      redis.call('SREM', KEYS[5], rid)
      redis.call('EXPIRE', pre .. 'req:' .. rid, c.ttl)
      redis.call('EXPIRE', pre .. 'out:' .. rid, c.ttl)
    end
  end
end

-- New requests start clean (a reused id must not inherit an old output or TTL).
local n = c.n
for i = 1, #n, {len(NEW_FIELDS) + 1} do redis.call('DEL', pre .. 'req:' .. n[i], pre .. 'out:' .. n[i]) end
hset_stride(n, {_lua_list(NEW_FIELDS)}, false)
for i = 1, #n, {len(NEW_FIELDS) + 1} do redis.call('SADD', KEYS[5], n[i]) end
hset_stride(c.u, {_lua_list(STATE_FIELDS)}, false)
local o = c.o
for i = 1, #o, 2 do redis.call('APPEND', pre .. 'out:' .. o[i], o[i + 1]) end
-- Finish last: a token appended above then keeps the TTL set here.
hset_stride(c.f, {_lua_list(FINAL_FIELDS)}, true)

for i = 1, #blocks, 4 do
  local b, n, h, t = blocks[i], blocks[i + 1], blocks[i + 2], blocks[i + 3]
  if n > 0 then
    redis.call('HSET', KEYS[4], b, n); redis.call('SREM', KEYS[3], b); redis.call('ZREM', k_evict, b)
  elseif h ~= '' then
    redis.call('HDEL', KEYS[4], b); redis.call('SREM', KEYS[3], b); redis.call('ZADD', k_evict, t, b)
  else
    redis.call('HDEL', KEYS[4], b); redis.call('SADD', KEYS[3], b); redis.call('ZREM', k_evict, b)
  end
  if h ~= '' then redis.call('HSET', k_bhash, b, h) else redis.call('HDEL', k_bhash, b) end
end
redis.call('HSET', KEYS[2], 'step_id', c.s, 'arrival_seq', c.a)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: meta free refs active. ARGV: key prefix. One consistent snapshot of the pool.
_LOAD = """
local reqs = {}
for _, rid in ipairs(redis.call('SMEMBERS', KEYS[4])) do
  reqs[#reqs + 1] = rid
  reqs[#reqs + 1] = redis.call('HGETALL', ARGV[1] .. 'req:' .. rid)
  reqs[#reqs + 1] = redis.call('GET', ARGV[1] .. 'out:' .. rid) or ''
end
return {redis.call('HGETALL', KEYS[1]), redis.call('SMEMBERS', KEYS[2]), redis.call('HGETALL', KEYS[3]), reqs,
        redis.call('ZRANGE', ARGV[1] .. 'evict', 0, -1, 'WITHSCORES'), redis.call('HGETALL', ARGV[1] .. 'bhash')}
"""


def _text(x: bytes | str) -> str:
    # The client may or may not decode responses.
    return x.decode() if isinstance(x, bytes) else x


def _pairs(flat: list) -> dict[str, str]:
    return {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat), 2)}


def _ints(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def _parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _opt_float(x: float | None) -> str:
    return "" if x is None else repr(x)


def _state(r: Request, blocks: str | bool) -> list[str | bool]:
    return [r.status.value, str(r.num_computed_tokens), blocks, str(r.num_preemptions), _opt_float(r.first_token_time)]


def _spec(r: Request) -> list[str]:
    return [_ints(r.prompt_ids), json.dumps(r.sampling.to_dict(), separators=(",", ":")), str(r.priority),
            repr(r.arrival_time), str(r.arrival_seq), json.dumps(r.stop), "1" if r.include_stop_str_in_output else "0",
            "1" if r.skip_special_tokens else "0", r.cache_salt]


def _decode_request(rid: str, f: dict[str, str], out: str) -> Request:
    ftt = f.get("first_token_time", "")
    return Request(
        request_id=rid,
        prompt_ids=_parse_ints(f["prompt"]),
        sampling=SamplingParams.from_dict(json.loads(f["sampling"])),
        priority=int(f["priority"]),
        arrival_time=float(f["arrival_time"]),
        arrival_seq=int(f["arrival_seq"]),
        stop=json.loads(f["stop"]),
        include_stop_str_in_output=f["include_stop"] == "1",
        skip_special_tokens=f["skip_special"] == "1",
        cache_salt=f.get("cache_salt", ""),
        output_ids=_parse_ints(out),
        num_computed_tokens=int(f["num_computed_tokens"]),
        block_ids=_parse_ints(f["block_ids"]),
        status=Status(f["status"]),
        finish_reason=f.get("finish_reason") or None,
        num_preemptions=int(f["num_preemptions"]),
        first_token_time=float(ftt) if ftt else None,
    )


def _script_error(e: redis.ResponseError) -> Exception:
    msg = str(e)
    if "LEASE_LOST" in msg:
        return LeaseLost(msg)
    if "INVARIANT" in msg:
        return InvariantViolation(msg)
    return e


class RedisLedger:
    def __init__(self, client: redis.Redis, namespace: str = "llmserve", pool: str = "0"):
        if any(c in namespace + pool for c in "{}"):
            raise ValueError(f"namespace {namespace!r} and pool {pool!r} must not contain '{{' or '}}'")
        self.client = client
        self.namespace = namespace
        self.pool_name = pool
        self.prefix = f"{namespace}:{{{pool}}}:"
        p = self.prefix
        self.k_meta, self.k_free, self.k_refs = p + "meta", p + "free", p + "refs"
        self.k_active, self.k_lease, self.k_fence = p + "active", p + "lease", p + "fence"
        # register_script: EVALSHA, with a one-time SCRIPT LOAD on NOSCRIPT.
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._advance = client.register_script(_ADVANCE)
        self._init_pool = client.register_script(_INIT_POOL)
        self._set_worker = client.register_script(_SET_WORKER)
        self._commit = client.register_script(_COMMIT)
        self._load = client.register_script(_LOAD)
        # rid -> block table as last written under lease token `_blocks_token` (see commit_step).
        self._blocks_sent: dict[str, list[int]] = {}
        self._blocks_token: int | None = None

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

    def init_pool(self, num_blocks: int, block_size: int) -> bool:
        """Create the pool (all blocks free, schema_version SCHEMA_VERSION) unless it exists; an existing pool must
        have this schema_version (else SchemaMismatch) and the same shape (else ValueError)."""
        res = self._init_pool(keys=[self.k_meta, self.k_free, self.k_refs],
                              args=[num_blocks, block_size, SCHEMA_VERSION])
        if res == 1:
            return True
        check_schema(self.prefix, None if res[2] is None else _text(res[2]))
        have_n, have_bs = int(res[0]), int(res[1])
        if (have_n, have_bs) != (num_blocks, block_size):
            raise ValueError(f"pool {self.prefix!r} exists with num_blocks={have_n}, block_size={have_bs}; "
                             f"asked for num_blocks={num_blocks}, block_size={block_size} "
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
        """Write one step's effects atomically in one round trip, and renew the lease. Raises LeaseLost."""
        # Block tables change once per block_size tokens: resend one only when it differs from what this
        # lease last wrote (stringifying 256 tables every step would dominate the commit).
        if token != self._blocks_token:
            self._blocks_sent.clear()
            self._blocks_token = token
        sent = self._blocks_sent
        new: list[str | bool] = []
        for r in commit.new_requests:
            sent[r.request_id] = list(r.block_ids)
            new.append(r.request_id)
            new += _spec(r)
            new += _state(r, _ints(r.block_ids))
            new.append(r.finish_reason or "")
        upd: list[str | bool] = []
        for r in commit.updated:
            blocks: str | bool = False
            if sent.get(r.request_id) != r.block_ids:
                blocks = _ints(r.block_ids)
                sent[r.request_id] = list(r.block_ids)
            upd.append(r.request_id)
            upd += _state(r, blocks)
        fin: list[str | bool] = []
        for r in commit.finished:
            sent.pop(r.request_id, None)
            fin.append(r.request_id)
            fin += _state(r, _ints(r.block_ids))
            fin.append(r.finish_reason or "")
        out: list[str] = []
        for rid, toks in commit.appended.items():
            if toks:
                out += [rid, ",".join(map(str, toks)) + ","]
        changes: list[int | str] = []
        for b, st in commit.block_changes.items():
            h = f"{st.hash.hex()}|{_ints(st.tokens)}" if st.hash is not None else ""
            changes += (b, st.ref_count, h, st.lru_tick)
        payload = json.dumps(
            {"s": str(commit.step_id), "a": str(commit.arrival_seq), "n": new, "u": upd, "o": out, "f": fin,
             "b": changes, "ttl": commit.finished_ttl_s, "check": int(commit.check_invariant)},
            separators=(",", ":"), ensure_ascii=False)
        keys = [self.k_lease, self.k_meta, self.k_free, self.k_refs, self.k_active]
        try:
            self._commit(keys=keys, args=[f"{holder}:{token}", ttl_ms, self.prefix, payload])
        except Exception as e:
            self._blocks_sent.clear()  # outcome unknown: next commit writes every block table again
            if isinstance(e, redis.ResponseError):
                raise _script_error(e) from None
            raise

    # ---- reads -----------------------------------------------------------------------------------------------

    def load(self) -> LoadedState:
        """Everything a new scheduler needs to rebuild its mirror, read atomically."""
        meta_flat, free, refs_flat, reqs, evict, bhash = self._load(
            keys=[self.k_meta, self.k_free, self.k_refs, self.k_active], args=[self.prefix])
        meta = _pairs(meta_flat)
        if "num_blocks" not in meta:
            raise RuntimeError(f"pool {self.prefix!r} is not initialised (call init_pool first)")
        check_schema(self.prefix, meta.get("schema_version"))  # before decoding any request in the old layout
        requests = []
        for i in range(0, len(reqs), 3):
            fields = _pairs(reqs[i + 1])
            if fields:  # an active id without a hash would be a bug elsewhere; skip rather than crash start-up
                requests.append(_decode_request(_text(reqs[i]), fields, _text(reqs[i + 2])))
        requests.sort(key=lambda r: r.arrival_seq)
        refs = {int(b): int(n) for b, n in _pairs(refs_flat).items()}
        cached = {}
        for b, v in _pairs(bhash).items():
            h, toks = v.split("|")
            cached[int(b)] = (bytes.fromhex(h), tuple(_parse_ints(toks)))
        pool = BlockPool(int(meta["num_blocks"]), free_ids=sorted(int(b) for b in free), refs=refs, cached=cached,
                         evictable={int(evict[i]): int(float(evict[i + 1])) for i in range(0, len(evict), 2)})
        return LoadedState(requests=requests, pool=pool, step_id=int(meta.get("step_id", 0)),
                           arrival_seq=int(meta.get("arrival_seq", 0)), meta=meta)

    def get_request(self, rid: str) -> Request | None:
        """A request by id, finished ones included while their keys live."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hgetall(self.prefix + "req:" + rid)
        pipe.get(self.prefix + "out:" + rid)
        fields, out = pipe.execute()
        if not fields:
            return None
        return _decode_request(rid, {_text(k): _text(v) for k, v in fields.items()}, _text(out or ""))

    def check_ledger(self) -> dict:
        """Block accounting for tests; asserts nothing itself."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hget(self.k_meta, "num_blocks")
        pipe.smembers(self.k_free)
        pipe.hgetall(self.k_refs)
        pipe.zrange(self.prefix + "evict", 0, -1)
        pipe.hlen(self.prefix + "bhash")
        pipe.scard(self.k_active)
        total, free, refs, evict, nhash, active = pipe.execute()
        free_ids = {int(b) for b in free}
        evict_ids = {int(b) for b in evict}
        ref_counts = {int(b): int(n) for b, n in refs.items()}
        return {"free": len(free_ids), "evictable": len(evict_ids), "allocated": len(ref_counts),
                "total": int(total or 0), "refs_sum": sum(ref_counts.values()), "cached": nhash, "active": active,
                "overlap": len(free_ids & ref_counts.keys()) + len(evict_ids & (free_ids | ref_counts.keys()))}

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
