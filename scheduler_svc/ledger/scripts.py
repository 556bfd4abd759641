"""The Lua scripts of the Redis ledger (`store.py`), each run with EVALSHA in one round trip.

Every write script first checks that the caller still holds the lease (`LEASE_CHECK`), so a scheduler that lost
its lease changes nothing. COMMIT reads one msgpack payload whose sections `codec.py` describes and writes.
"""

from __future__ import annotations

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

# KEYS: meta free refs sfree sslot. ARGV: num_blocks block_size schema_version num_state_slots.
# Returns 1 when created, else {num_blocks, block_size, schema_version (nil if absent), num_state_slots}.
INIT_POOL = """
local have = redis.call('HMGET', KEYS[1], 'num_blocks', 'block_size', 'schema_version', 'num_state_slots')
if have[1] then return have end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5])
local slots = {}
for s = 0, tonumber(ARGV[4]) - 1 do
  slots[#slots + 1] = s
  if #slots == 4000 then redis.call('SADD', KEYS[4], unpack(slots)); slots = {} end
end
if #slots > 0 then redis.call('SADD', KEYS[4], unpack(slots)) end
local n = tonumber(ARGV[1])
local ids = {}
for b = 0, n - 1 do
  ids[#ids + 1] = b
  if #ids == 4000 then redis.call('SADD', KEYS[2], unpack(ids)); ids = {} end
end
if #ids > 0 then redis.call('SADD', KEYS[2], unpack(ids)) end
redis.call('HSET', KEYS[1], 'schema_version', ARGV[3], 'num_blocks', ARGV[1], 'block_size', ARGV[2], 'step_id', 0,
           'arrival_seq', 0, 'num_state_slots', ARGV[4])
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

# KEYS: lease meta free refs active. ARGV: lease value, ttl_ms, key prefix, msgpack payload (codec.py).
COMMIT = LEASE_CHECK + """
local c = cmsgpack.unpack(ARGV[4])
local pre = ARGV[3]
local k_evict, k_bhash, k_computed = pre .. 'evict', pre .. 'bhash', pre .. 'computed'
local k_sfree, k_sslot = pre .. 'sfree', pre .. 'sslot'
local function req(rid) return pre .. 'req:' .. rid end
local function out(seq) return pre .. 'out:' .. seq end
local function blk(seq) return pre .. 'blk:' .. seq end
local function lp(seq) return pre .. 'lp:' .. seq end

-- The ledger must hold the step this one follows: a promoted replica that lacks the last commits, reached over a
-- connection that never broke, is refused before any write (the scheduler then takes the pool over from it).
if c.prev then
  local held = redis.call('HGET', KEYS[2], 'step_id')
  if tonumber(held) ~= c.prev then
    return redis.error_reply('LEDGER_BEHIND the ledger holds step ' .. (held or '(none)') ..
                             ', this commit follows step ' .. c.prev)
  end
end

-- One command per up to 1000 arguments (Lua's unpack is bounded by its C stack); nothing for an empty list.
local function bulk(cmd, key, list)
  for i = 1, #list, 1000 do redis.call(cmd, key, unpack(list, i, math.min(i + 999, #list))) end
end
local function bulk_read(cmd, key, list)
  local res = {}
  for i = 1, #list, 1000 do
    local part = redis.call(cmd, key, unpack(list, i, math.min(i + 999, #list)))
    for j = 1, #part do res[#res + 1] = part[j] end
  end
  return res
end

-- Validate before any write, so a rejected commit changes nothing.
local blocks = c.blocks
if c.check == 1 then
  local total = tonumber(redis.call('HGET', KEYS[2], 'num_blocks'))
  local ids = {}
  for i = 1, #blocks, 4 do
    local b = blocks[i]
    if b < 0 or b >= total then return redis.error_reply('INVARIANT block ' .. b .. ' outside 0..' .. total - 1) end
    ids[#ids + 1] = b
  end
  local nfree, nref, nev = redis.call('SCARD', KEYS[3]), redis.call('HLEN', KEYS[4]), redis.call('ZCARD', k_evict)
  local in_free, in_refs = bulk_read('SMISMEMBER', KEYS[3], ids), bulk_read('HMGET', KEYS[4], ids)
  local in_evict = bulk_read('ZMSCORE', k_evict, ids)
  for j = 1, #ids do
    local n, h = blocks[4 * j - 2], blocks[4 * j]
    if in_free[j] == 1 then nfree = nfree - 1 end
    if in_refs[j] then nref = nref - 1 end
    if in_evict[j] then nev = nev - 1 end
    if n > 0 then nref = nref + 1 elseif h ~= '' then nev = nev + 1 else nfree = nfree + 1 end
  end
  if nfree + nev + nref ~= total then
    return redis.error_reply('INVARIANT free ' .. nfree .. ' + evictable ' .. nev .. ' + allocated ' .. nref ..
                             ' ~= total ' .. total)
  end
  -- State slots (hybrid models): free + owned (requests, pending and ready snapshots) == num_state_slots.
  local states = c.states or {}
  if #states > 0 then
    local nslots = tonumber(redis.call('HGET', KEYS[2], 'num_state_slots') or '0')
    local sids = {}
    for i = 1, #states, 2 do
      local s = states[i]
      if s < 0 or s >= nslots then
        return redis.error_reply('INVARIANT state slot ' .. s .. ' outside 0..' .. nslots - 1)
      end
      sids[#sids + 1] = s
    end
    local sfree, sowned = redis.call('SCARD', k_sfree), redis.call('HLEN', k_sslot)
    local was_free, was_owned = bulk_read('SMISMEMBER', k_sfree, sids), bulk_read('HMGET', k_sslot, sids)
    for j = 1, #sids do
      if was_free[j] == 1 then sfree = sfree - 1 end
      if was_owned[j] then sowned = sowned - 1 end
      if states[2 * j] == '' then sfree = sfree + 1 else sowned = sowned + 1 end
    end
    if sfree + sowned ~= nslots then
      return redis.error_reply('INVARIANT state slots free ' .. sfree .. ' + owned ' .. sowned .. ' ~= total ' ..
                               nslots)
    end
  end
end

-- Joining requests: the whole record; a reused id must not inherit an old output, table or TTL.
for _, r in ipairs(c.new) do
  local rid, seq = r[1], r[2]
  redis.call('DEL', req(rid), out(seq), blk(seq), lp(seq))
  redis.call('HSET', req(rid), unpack(r, 3))
  redis.call('SADD', KEYS[5], rid)
end
-- Running requests: only what changed.
for _, r in ipairs(c.state) do redis.call('HSET', req(r[1]), unpack(r, 2)) end
bulk('HSET', k_computed, c.computed)
local t = c.blk_set
for i = 1, #t, 2 do
  if t[i + 1] == '' then redis.call('DEL', blk(t[i])) else redis.call('SET', blk(t[i]), t[i + 1]) end
end
t = c.blk_add
for i = 1, #t, 2 do redis.call('APPEND', blk(t[i]), t[i + 1]) end
t = c.out
for i = 1, #t, 2 do redis.call('APPEND', out(t[i]), t[i + 1]) end
t = c.lp or {}
for i = 1, #t, 2 do redis.call('APPEND', lp(t[i]), t[i + 1]) end
-- Finish last: a token appended above then keeps the TTL set here.
for _, r in ipairs(c.fin) do
  local rid, seq = r[1], r[2]
  redis.call('HSET', req(rid), unpack(r, 3))
  redis.call('SREM', KEYS[5], rid)
  redis.call('HDEL', k_computed, seq)
  redis.call('DEL', blk(seq))
  redis.call('EXPIRE', req(rid), c.ttl)
  redis.call('EXPIRE', out(seq), c.ttl)
  redis.call('EXPIRE', lp(seq), c.ttl)
end

-- Block changes, grouped: a handful of commands whatever their number.
local ref_set, ref_del, free_add, free_del, ev_add, ev_del, hash_set, hash_del = {}, {}, {}, {}, {}, {}, {}, {}
for i = 1, #blocks, 4 do
  local b, n, tick, h = blocks[i], blocks[i + 1], blocks[i + 2], blocks[i + 3]
  if n > 0 then
    ref_set[#ref_set + 1] = b; ref_set[#ref_set + 1] = n
    free_del[#free_del + 1] = b; ev_del[#ev_del + 1] = b
  elseif h ~= '' then  -- free, but its cached content stays reusable until evicted
    ref_del[#ref_del + 1] = b; free_del[#free_del + 1] = b
    ev_add[#ev_add + 1] = tick; ev_add[#ev_add + 1] = b
  else
    ref_del[#ref_del + 1] = b; free_add[#free_add + 1] = b; ev_del[#ev_del + 1] = b
  end
  if h ~= '' then hash_set[#hash_set + 1] = b; hash_set[#hash_set + 1] = h else hash_del[#hash_del + 1] = b end
end
bulk('HDEL', KEYS[4], ref_del); bulk('HSET', KEYS[4], ref_set)
bulk('SREM', KEYS[3], free_del); bulk('SADD', KEYS[3], free_add)
bulk('ZREM', k_evict, ev_del); bulk('ZADD', k_evict, ev_add)
bulk('HDEL', k_bhash, hash_del); bulk('HSET', k_bhash, hash_set)
-- State slot owners: a request ("r:<id>"), a pending snapshot ("p:<id>"), a ready one ("s:<key>:<tokens>:<tick>").
local s_own, s_ids, s_del = {}, {}, {}
t = c.states or {}
for i = 1, #t, 2 do
  if t[i + 1] == '' then
    s_del[#s_del + 1] = t[i]
  else
    s_own[#s_own + 1] = t[i]; s_own[#s_own + 1] = t[i + 1]; s_ids[#s_ids + 1] = t[i]
  end
end
bulk('HDEL', k_sslot, s_del); bulk('SADD', k_sfree, s_del)
bulk('HSET', k_sslot, s_own); bulk('SREM', k_sfree, s_ids)
redis.call('HSET', KEYS[2], 'step_id', c.s, 'arrival_seq', c.a)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: meta free refs active. ARGV: key prefix. One consistent snapshot of the pool: per active request its id,
# hash, output, block table and output logprobs; then num_computed_tokens of every active request by seq.
LOAD = """
local pre = ARGV[1]
local reqs = {}
for _, rid in ipairs(redis.call('SMEMBERS', KEYS[4])) do
  local seq = redis.call('HGET', pre .. 'req:' .. rid, 'arrival_seq') or ''
  reqs[#reqs + 1] = rid
  reqs[#reqs + 1] = redis.call('HGETALL', pre .. 'req:' .. rid)
  reqs[#reqs + 1] = redis.call('GET', pre .. 'out:' .. seq) or ''
  reqs[#reqs + 1] = redis.call('GET', pre .. 'blk:' .. seq) or ''
  reqs[#reqs + 1] = redis.call('GET', pre .. 'lp:' .. seq) or ''
end
return {redis.call('HGETALL', KEYS[1]), redis.call('SMEMBERS', KEYS[2]), redis.call('HGETALL', KEYS[3]), reqs,
        redis.call('ZRANGE', pre .. 'evict', 0, -1, 'WITHSCORES'), redis.call('HGETALL', pre .. 'bhash'),
        redis.call('HGETALL', pre .. 'computed'), redis.call('HGETALL', pre .. 'sslot')}
"""

# ARGV: key prefix, request id. {hash, output, block table, output logprobs, num_computed_tokens (nil once
# finished)}, or {} if unknown.
GET_REQUEST = """
local pre, k = ARGV[1], ARGV[1] .. 'req:' .. ARGV[2]
local seq = redis.call('HGET', k, 'arrival_seq')
if not seq then return {} end
return {redis.call('HGETALL', k), redis.call('GET', pre .. 'out:' .. seq) or '',
        redis.call('GET', pre .. 'blk:' .. seq) or '', redis.call('GET', pre .. 'lp:' .. seq) or '',
        redis.call('HGET', pre .. 'computed', seq)}
"""
