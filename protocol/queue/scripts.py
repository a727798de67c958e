"""The request queue's Lua scripts: every script that touches a request or reply stream.

Both ends register them (redis-py's Script: EVALSHA, and SCRIPT LOAD + EVALSHA again on
NOSCRIPT, as after a restart) and call them with the KEYS and ARGV that protocol/queue/calls.py
builds; each comment here says that layout. Every key named in ARGV shares the deployment's hash
tag (protocol.Keys): one cluster slot. An entry's field names are filled in from entry.py and
messages.py (`_FIELDS`), so a field is spelled once. tests/test_layers.py checks that no
other module spells a stream script.
"""

from __future__ import annotations

from string import Template

from protocol.messages import BATCH_FIELD, MESSAGE_FIELD, VERSION_FIELD
from protocol.queue.entry import COST_FIELD

# The entry fields a script names, by their placeholder: `'$cost'` in a script is `'c'`.
_FIELDS = {"ver": VERSION_FIELD, "msg": MESSAGE_FIELD, "batch": BATCH_FIELD, "cost": COST_FIELD}


def _lua(source: str) -> str:
    return Template(source).substitute(_FIELDS)


# ----- the gateway's ---------------------------------------------------------------------------

# Enqueue one request into its queue (a stream per model, priority and fair-share key; the
# queue's key is made and listed in the model's queue set on first use, with its consumer group
# at id 0 so nothing queued before any worker is skipped), and count its prompt tokens.
# KEYS: queue set, weights, queue stream, queued-token counter.
# ARGV: priority, weight, group, v, m, cost (tokens, for fair share), prompt tokens.
ENQUEUE = _lua("""
if redis.call('ZADD', KEYS[1], ARGV[1], KEYS[3]) == 1 then
  redis.pcall('XGROUP', 'CREATE', KEYS[3], ARGV[3], '0', 'MKSTREAM')
end
redis.call('HSET', KEYS[2], KEYS[3], ARGV[2])
local id = redis.call('XADD', KEYS[3], '*', '$ver', ARGV[4], '$msg', ARGV[5], '$cost', ARGV[6])
redis.call('INCRBY', KEYS[4], ARGV[7])
return id
""")

# The model's backlog over all its queues: {lag, pending, queued tokens}. Resets the queued-token
# counter to 0 when nothing is queued, so a counter a crashed worker left too high heals the next
# time the queue drains. A queue without the group gets it at id 0 (nothing queued before any
# worker is skipped). KEYS: queue set, default queue, counter. ARGV: group, count bound (for a
# queue whose lag Redis cannot say after deletions: its undelivered entries are counted).
BACKLOG = _lua("""
local function field(t, name)
  for i = 1, #t, 2 do if t[i] == name then return t[i + 1] end end
end
local queues = redis.call('ZRANGE', KEYS[1], 0, -1)
table.insert(queues, KEYS[2])
local seen, lag, pending = {}, 0, 0
for _, q in ipairs(queues) do
  if not seen[q] then
    seen[q] = true
    local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', q)
    local found = false
    for _, g in ipairs(ok and groups or {}) do
      if field(g, 'name') == ARGV[1] then
        local n = field(g, 'lag')
        if not n then
          local from = '(' .. field(g, 'last-delivered-id')
          n = #redis.call('XRANGE', q, from, '+', 'COUNT', ARGV[2])
        end
        lag, pending, found = lag + n, pending + field(g, 'pending'), true
      end
    end
    if not found then  -- no group yet (or lost in a restart): every entry is unread
      redis.pcall('XGROUP', 'CREATE', q, ARGV[1], '0', 'MKSTREAM')
      lag = lag + redis.call('XLEN', q)
    end
  end
end
local tokens = tonumber(redis.call('GET', KEYS[3]) or '0')
if lag == 0 and tokens > 0 then
  redis.call('SET', KEYS[3], 0)
  tokens = 0
end
return {lag, pending, tokens}
""")

# ----- the worker's (they run every step or second, so they go by SHA) --------------------------

# Read up to `count` new entries of a model's queues for this consumer: most urgent priority
# first; between the queues of one priority, deficit round robin counted in tokens (each entry's
# `c`), weighted by each queue's weight, with the deficits kept in a hash so shares hold across
# reads. Only queues more urgent than ARGV[4] are read (a full worker reads only what it would
# preempt for). A queue without the group gets it at id 0 (a restart without persistence).
# Returns {queues with their priorities (flat), entries as {queue, id, fields}}.
# KEYS: queue set, weights, deficits, default queue. ARGV: group, consumer, count, below
# (a priority, exclusive; READ_ALL for all), quantum (tokens a weight-1 queue gets per round).
READ = _lua("""
local group, consumer, want = ARGV[1], ARGV[2], tonumber(ARGV[3])
local below, quantum = ARGV[4], tonumber(ARGV[5])
local function read(queue, n)
  local r = redis.pcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n, 'STREAMS', queue, '>')
  if type(r) == 'table' and r.err then
    if not string.find(r.err, 'NOGROUP') then error(r.err) end
    redis.call('XGROUP', 'CREATE', queue, group, '0', 'MKSTREAM')
    r = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n, 'STREAMS', queue, '>')
  end
  if not r then return {} end
  return r[1][2]
end
local function cost(fields)
  for i = 1, #fields, 2 do
    if fields[i] == '$cost' then return tonumber(fields[i + 1]) or 1 end
  end
  return 1
end
local listed = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local levels, order = {}, {}
local function add(queue, priority)
  if not levels[priority] then levels[priority] = {}; table.insert(order, priority) end
  table.insert(levels[priority], queue)
end
local default_listed = false
for i = 1, #listed, 2 do
  add(listed[i], tonumber(listed[i + 1]))
  default_listed = default_listed or listed[i] == KEYS[4]
end
if not default_listed then
  add(KEYS[4], 0)
  table.insert(listed, KEYS[4])
  table.insert(listed, '0')
end
table.sort(order)
local out = {}
for _, priority in ipairs(order) do
  if #out >= want or priority >= tonumber(below) then break end
  local queues = levels[priority]
  if #queues == 1 then
    for _, e in ipairs(read(queues[1], want - #out)) do
      table.insert(out, {queues[1], e[1], e[2]})
    end
  else
    local weights = redis.call('HMGET', KEYS[2], unpack(queues))
    local deficits = redis.call('HMGET', KEYS[3], unpack(queues))
    local live = #queues
    for k = 1, #queues do
      weights[k] = tonumber(weights[k]) or 1
      deficits[k] = tonumber(deficits[k]) or 0
    end
    local empty = {}
    while #out < want and live > 0 do
      local served = false
      for k = 1, #queues do
        if not empty[k] and deficits[k] > 0 and #out < want then
          local e = read(queues[k], 1)[1]
          if e then
            table.insert(out, {queues[k], e[1], e[2]})
            deficits[k] = deficits[k] - cost(e[2])
            served = true
          else  -- nothing waiting: an idle queue keeps no credit
            empty[k], live = true, live - 1
            if deficits[k] > 0 then deficits[k] = 0 end
          end
        end
      end
      if not served and live > 0 then  -- a new round: enough quanta that one queue can go
        local rounds = math.huge
        for k = 1, #queues do
          if not empty[k] then
            local share = quantum * weights[k]
            rounds = math.min(rounds, math.floor((0 - deficits[k]) / share) + 1)
          end
        end
        for k = 1, #queues do
          if not empty[k] then deficits[k] = deficits[k] + rounds * quantum * weights[k] end
        end
      end
    end
    local flat = {}
    for k = 1, #queues do table.insert(flat, queues[k]); table.insert(flat, deficits[k]) end
    redis.call('HSET', KEYS[3], unpack(flat))
  end
end
return {listed, out}
""")

# One step's replies and acks, applied atomically unless this worker has been fenced (another
# worker judged it dead and took its requests over): a fenced worker's late writes would
# interleave with its successor's. Returns 0 when fenced, 1 when applied.
# KEYS: fence flag, the model's queue deficits. ARGV: group, reply maxlen, then operations:
#   R stream nomkstream(0|1) v b   (one XADD: a gateway's replies of this step, as a batch)
#   A queue entry_id               (XACK + XDEL of a request queue's entry)
#   F queue tokens                 (a fair-share refund: it lowers the queue's debt, never
#                                   past 0, and only for a queue the round robin keeps)
# The reply stream is also the record a takeover continues from (WorkerRedis.claim): no write
# per request besides its reply, which halves what Redis does per streamed token.
PUBLISH = _lua("""
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local group, maxlen = ARGV[1], ARGV[2]
local i = 3
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'R' then
    local stream, nomk, v, b = ARGV[i+1], ARGV[i+2], ARGV[i+3], ARGV[i+4]
    if nomk == '1' then
      redis.call('XADD', stream, 'NOMKSTREAM', 'MAXLEN', '~', maxlen, '*', '$ver', v, '$batch', b)
    else
      redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', '$ver', v, '$batch', b)
    end
    i = i + 5
  elseif op == 'A' then
    -- pcall: after a restart without persistence the group may be gone; nothing to ack then
    redis.pcall('XACK', ARGV[i+1], group, ARGV[i+2])
    redis.call('XDEL', ARGV[i+1], ARGV[i+2])
    i = i + 3
  else  -- 'F'
    if redis.call('HEXISTS', KEYS[2], ARGV[i+1]) == 1 then
      if redis.call('HINCRBY', KEYS[2], ARGV[i+1], ARGV[i+2]) > 0 then
        redis.call('HSET', KEYS[2], ARGV[i+1], 0)
      end
    end
    i = i + 3
  end
end
return 1
""")

# The heartbeat renews the lease only while not fenced: a fenced worker must not look alive
# until it has handed back what it still holds. It also says whether the model card exists (a
# Redis restart loses it): one call, not a pipeline (a pipeline of scripts costs a SCRIPT EXISTS
# round trip first). The lease is renewed in the model's worker set too (what gateways check to
# serve the model); ids an hour stale leave it (ids are per process: the set would only grow).
# KEYS: fence flag, workers, model card, model workers. ARGV: worker id, now.
# Returns {renewed (1) or fenced (0), card exists (1|0)}.
HEARTBEAT = _lua("""
local has_card = redis.call('EXISTS', KEYS[3])
if redis.call('EXISTS', KEYS[1]) == 1 then return {0, has_card} end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[2] - 3600)
return {1, has_card}
""")
