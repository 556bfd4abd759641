"""The Lua scripts of the Redis ledger (`store.py`), each run with EVALSHA in one round trip.

Every write script first checks that the caller still holds the lease (`_LEASE_CHECK`), so a scheduler that lost
its lease changes nothing. Requests are written as flat arrays, one stride per request, in the field orders below,
which the Python encoder in store.py shares.
"""

from __future__ import annotations

# Field order shared by the Python encoder and the Lua script (flat arrays, one stride per request).
SPEC_FIELDS = ("prompt", "sampling", "priority", "arrival_time", "arrival_seq", "stop", "include_stop",
               "skip_special", "cache_salt")
STATE_FIELDS = ("status", "num_computed_tokens", "block_ids", "num_preemptions", "first_token_time")
FINAL_FIELDS = (*STATE_FIELDS, "finish_reason")
NEW_FIELDS = (*SPEC_FIELDS, *FINAL_FIELDS)


def _lua_list(names: tuple[str, ...]) -> str:
    return "{" + ",".join(f"'{n}'" for n in names) + "}"


LEASE_CHECK = """
local lease = redis.call('GET', KEYS[1])
if lease ~= ARGV[1] then
  return redis.error_reply('LEASE_LOST lease is ' .. (lease or '(none)') .. ', caller has ' .. ARGV[1])
end
"""

ACQUIRE = """
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

RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

# KEYS: lease fence. ARGV: lease value ("holder:token"), holder, floor, ttl_ms. Re-token our lease above `floor`.
ADVANCE = LEASE_CHECK + """
local token = redis.call('INCR', KEYS[2])
if token <= tonumber(ARGV[3]) then
  token = tonumber(ARGV[3]) + 1
  redis.call('SET', KEYS[2], token)
end
redis.call('SET', KEYS[1], ARGV[2] .. ':' .. token, 'PX', ARGV[4])
return token
"""

RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: meta free refs. ARGV: num_blocks block_size schema_version.
# Returns 1 when created, else {num_blocks, block_size, schema_version (nil if absent)}.
INIT_POOL = """
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
SET_WORKER = """
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
COMMIT = LEASE_CHECK + f"""
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
LOAD = """
local reqs = {}
for _, rid in ipairs(redis.call('SMEMBERS', KEYS[4])) do
  reqs[#reqs + 1] = rid
  reqs[#reqs + 1] = redis.call('HGETALL', ARGV[1] .. 'req:' .. rid)
  reqs[#reqs + 1] = redis.call('GET', ARGV[1] .. 'out:' .. rid) or ''
end
return {redis.call('HGETALL', KEYS[1]), redis.call('SMEMBERS', KEYS[2]), redis.call('HGETALL', KEYS[3]), reqs,
        redis.call('ZRANGE', ARGV[1] .. 'evict', 0, -1, 'WITHSCORES'), redis.call('HGETALL', ARGV[1] .. 'bhash')}
"""
