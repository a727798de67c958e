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
from protocol.queue.placement import ADAPTERS_FIELD, ROOM_FIELD, WAITING_FIELD

# The entry fields a script names, by their placeholder: `'$cost'` in a script is `'c'`; and a
# prefix summary's load fields (`'$room'`).
_FIELDS = {"ver": VERSION_FIELD, "msg": MESSAGE_FIELD, "batch": BATCH_FIELD, "cost": COST_FIELD}
_FIELDS |= {"room": ROOM_FIELD, "waiting": WAITING_FIELD, "loras": ADAPTERS_FIELD}


# READ's placement part (see READ): the own streams found in the listing, and `read` made to
# take a queue's next entries from its own, shared and stealable streams, oldest first: by
# their heads (a stream's next unread id: XINFO GROUPS, then one XRANGE entry), one entry at a
# time while several streams have some, the rest at once from the last one. The shared stream
# alone (nothing in the own stream, nothing to take from others) costs what it did without.
_PLACEMENT_READ = """
local own_stream, add_bases, bases, next_steal = nil, nil, {}, nil
if placed then
  local mark, summaries = ARGV[6], ARGV[7]
  local steal_after, steal = tonumber(ARGV[8]), ARGV[9] == '1'
  local owners, members, needed = {}, {}, {}
  local flat = redis.call('HGETALL', KEYS[5])
  for i = 1, #flat, 2 do owners[flat[i]] = flat[i + 1] end
  own_stream = function(stream, priority)
    local worker = owners[stream]
    if not worker then return false end
    local suffix = mark .. worker
    if string.sub(stream, -#suffix) ~= suffix then return false end
    local queue = string.sub(stream, 1, #stream - #suffix)
    if not members[queue] then
      members[queue] = {others = {}}
      table.insert(needed, {queue, priority})
    end
    if worker == consumer then members[queue].own = stream
    else table.insert(members[queue].others, {stream, worker}) end
    table.insert(bases, stream)
    table.insert(bases, queue)
    return true
  end
  add_bases = function()  -- a queue known only by its own streams is read all the same
    for _, n in ipairs(needed) do
      local present = false
      for _, q in ipairs(levels[n[2]] or {}) do present = present or q == n[1] end
      if not present then add(n[1], n[2]) end
    end
  end
  local function field(g, name)
    for i = 1, #g, 2 do if g[i] == name then return g[i + 1] end end
  end
  local function after(stream, id)  -- the id of the entry after `id` (nil: none)
    local e = redis.call('XRANGE', stream, '(' .. id, '+', 'COUNT', 1)[1]
    return e and e[1]
  end
  local function first(stream)  -- the id of its next entry no consumer has read (nil: none)
    local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', stream)
    if not ok then return nil end
    for _, g in ipairs(groups) do
      if field(g, 'name') == group then
        if field(g, 'lag') == 0 then return nil end
        return after(stream, field(g, 'last-delivered-id'))
      end
    end
    redis.call('XGROUP', 'CREATE', stream, group, '0')
    return after(stream, '0-0')
  end
  local function ms(id) return tonumber(string.match(id, '^(%d+)')) end
  local function older(a, b)
    local am, as = string.match(a, '^(%d+)-(%d+)')
    local bm, bs = string.match(b, '^(%d+)-(%d+)')
    am, bm = tonumber(am), tonumber(bm)
    return am < bm or (am == bm and tonumber(as) < tonumber(bs))
  end
  local now = nil
  local function ready(s)  -- s's next entry this consumer may take now (true: not looked up)
    if s.head == false then s.head = after(s.stream, s.last) end
    if s.head and s.bound then  -- another's, live: only once its owner left it past the bound
      if not now then
        local t = redis.call('TIME')
        now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
      end
      local wait = ms(s.head) + steal_after - now
      if wait > 0 then
        if not next_steal or wait < next_steal then next_steal = wait end
        s.head = nil
      end
    end
    return s.head
  end
  local function prepare(queue, m)  -- the streams this consumer may read a queue's entries from
    m.streams = {}
    local function take(stream, bound, head)
      if head then table.insert(m.streams, {stream = stream, head = head, bound = bound}) end
      return head
    end
    if m.own then take(m.own, false, first(m.own)) end
    for _, o in ipairs(steal and m.others or {}) do
      if redis.call('EXISTS', summaries .. o[2]) == 1 then
        take(o[1], true, first(o[1]))
      elseif not take(o[1], false, first(o[1])) and redis.call('XLEN', o[1]) == 0 then
        redis.call('DEL', o[1])  -- the empty stream of a worker gone or leaving
        redis.call('ZREM', KEYS[1], o[1])
        redis.call('HDEL', KEYS[5], o[1])
      end
    end
    -- the shared stream alone is read as without placement; beside others, by its head
    take(queue, false, #m.streams == 0 or first(queue))
  end
  local plain = read
  read = function(queue, n)
    local m = members[queue]
    if not m then return plain(queue, n) end
    if not m.streams then prepare(queue, m) end
    local entries = {}
    while #entries < n do
      local live = {}
      for _, s in ipairs(m.streams) do if ready(s) then table.insert(live, s) end end
      m.streams = live
      if #live == 0 then break end
      local s, k = live[1], 1
      if #live == 1 and not s.bound then
        k = n - #entries  -- the one stream left: the rest from it at once
      else
        for i = 2, #live do if older(live[i].head, s.head) then s = live[i] end end
      end
      local got = plain(s.stream, k)
      for _, e in ipairs(got) do table.insert(entries, {e[1], e[2], s.stream}) end
      if #got < k then s.head = nil else s.head, s.last = false, got[#got][1] end
    end
    return entries
  end
end
"""
_FIELDS["placement_read"] = _PLACEMENT_READ


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

# Prefix-aware placement (protocol/queue/placement.py). The cached prefix of a prompt on each
# candidate worker: how many of the prompt's leading blocks its summary holds, its load, and
# how many entries wait unread in its own stream of the request's queue (its lag, or its
# undelivered entries counted up to a bound), and whether it holds the request's LoRA adapter
# resident (its adapters field, " a b ", holds " name "; every worker holds the base model).
# KEYS: per candidate, its prefix summary then its own stream of the queue.
# ARGV: group, count bound, the adapter ('' for none), the prompt's block hashes (summary form)
# first block first.
# Returns per candidate {cached blocks, room, waiting, unread, holds the adapter (1|0)}, or {-1}
# without a summary.
LOOKUP = _lua("""
local function field(g, name)
  for i = 1, #g, 2 do if g[i] == name then return g[i + 1] end end
end
local wanted = ' ' .. ARGV[3] .. ' '
local out = {}
for i = 1, #KEYS, 2 do
  local values = redis.call('HMGET', KEYS[i], '$room', '$waiting', '$loras', unpack(ARGV, 4))
  if not values[1] then
    table.insert(out, {-1})
  else
    local held = 1
    if ARGV[3] ~= '' and not string.find(values[3] or '', wanted, 1, true) then held = 0 end
    local hit = 0
    for j = 4, #values do
      if not values[j] then break end
      hit = hit + 1
    end
    local unread = 0
    local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[i + 1])
    for _, g in ipairs(ok and groups or {}) do
      if field(g, 'name') == ARGV[1] then
        unread = field(g, 'lag') or #redis.call('XRANGE', KEYS[i + 1],
          '(' .. field(g, 'last-delivered-id'), '+', 'COUNT', ARGV[2])
      end
    end
    table.insert(out, {hit, tonumber(values[1]) or 0, tonumber(values[2]) or 0, unread, held})
  end
end
return out
""")

# Enqueue one request as ENQUEUE does, into the target worker's own stream of its queue while
# that worker's prefix summary exists (its lease holds and it is not leaving), else into the
# queue itself. The own stream is listed in the queue set at the queue's priority (its group at
# id 0) and in the owners hash. Returns {stream, entry id}.
# KEYS: queue set, weights, queue stream, queued-token counter, owners, the target's own stream
# of the queue, the target's prefix summary.
# ARGV: priority, weight, group, v, m, cost, prompt tokens, the target's worker id.
PLACE = _lua("""
local function listed(stream)
  if redis.call('ZADD', KEYS[1], ARGV[1], stream) == 1 then
    redis.pcall('XGROUP', 'CREATE', stream, ARGV[3], '0', 'MKSTREAM')
  end
end
listed(KEYS[3])
redis.call('HSET', KEYS[2], KEYS[3], ARGV[2])
local stream = KEYS[3]
if redis.call('EXISTS', KEYS[7]) == 1 then
  stream = KEYS[6]
  listed(stream)
  redis.call('HSET', KEYS[5], stream, ARGV[8])
end
local id = redis.call('XADD', stream, '*', '$ver', ARGV[4], '$msg', ARGV[5], '$cost', ARGV[6])
redis.call('INCRBY', KEYS[4], ARGV[7])
return {stream, id}
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
#
# With prefix-aware placement (protocol/queue/placement.py) the call adds KEYS[5], the owners
# hash (own stream -> worker), and ARGV[6..9]: the own-stream mark, the prefix summaries' key
# prefix, the steal bound (ms) and whether to steal now (1|0). A queue then reads as one with
# its workers' own streams: this consumer takes the oldest of its own stream's and the shared
# stream's next entries, and, when stealing, those of another worker's stream that its owner has
# not read within the bound or whose owner's summary is gone (dead or leaving; such a stream,
# once empty, is dropped). Fair share is the queue's, whichever stream an entry waits in. The
# reply adds {own streams and their queues (flat), the ms until another's entry becomes
# stealable, or -1}. A queue without own streams is read exactly as without placement.
READ = _lua("""
local group, consumer, want = ARGV[1], ARGV[2], tonumber(ARGV[3])
local below, quantum = ARGV[4], tonumber(ARGV[5])
local placed = KEYS[5] ~= nil
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
$placement_read
local default_listed = false
for i = 1, #listed, 2 do
  if not (placed and own_stream(listed[i], tonumber(listed[i + 1]))) then
    add(listed[i], tonumber(listed[i + 1]))
    default_listed = default_listed or listed[i] == KEYS[4]
  end
end
if not default_listed then
  add(KEYS[4], 0)
  table.insert(listed, KEYS[4])
  table.insert(listed, '0')
end
if placed then add_bases() end
table.sort(order)
local out = {}
local function taken(queue, e)
  table.insert(out, {e[3] or queue, e[1], e[2]})
end
for _, priority in ipairs(order) do
  if #out >= want or priority >= tonumber(below) then break end
  local queues = levels[priority]
  if #queues == 1 then
    for _, e in ipairs(read(queues[1], want - #out)) do
      taken(queues[1], e)
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
            taken(queues[k], e)
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
if placed then return {listed, out, bases, next_steal or -1} end
return {listed, out}
""")

# One step's replies and acks, applied atomically unless this worker has been fenced (another
# worker judged it dead and took its requests over): a fenced worker's late writes would
# interleave with its successor's. Returns 0 when fenced, 1 when applied, 2 when applied but the
# prefix summary was gone (below); worker/redis_io.py's PublishResult names them.
# KEYS: fence flag, the model's queue deficits. ARGV: group, reply maxlen, then operations:
#   R stream nomkstream(0|1) v b   (one XADD: a gateway's replies of this step, as a batch)
#   A queue entry_id               (XACK + XDEL of a request queue's entry)
#   F queue tokens                 (a fair-share refund: it lowers the queue's debt, never
#                                   past 0, and only for a queue the round robin keeps)
#   S key ttl_ms reset(0|1) n_added n_removed n_load, then the added block hashes, the removed
#     ones and the load's field value pairs (a prefix summary's changes, protocol/queue/
#     placement.py); `reset` starts the summary afresh, expiring in ttl_ms (the heartbeat
#     renews it). Without `reset`, a summary that is gone (Redis restarted, it expired) is left
#     alone and the script returns 2: the worker resends it whole.
# The reply stream is also the record a takeover continues from (WorkerRedis.claim): no write
# per request besides its reply, which halves what Redis does per streamed token.
PUBLISH = _lua("""
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local group, maxlen = ARGV[1], ARGV[2]
local status = 1
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
  elseif op == 'S' then
    local key, ttl, reset = ARGV[i+1], ARGV[i+2], ARGV[i+3]
    local added, removed, load = tonumber(ARGV[i+4]), tonumber(ARGV[i+5]), tonumber(ARGV[i+6])
    local first = i + 7
    i = first + added + removed + 2 * load
    if reset == '1' then
      redis.call('DEL', key)
    elseif redis.call('EXISTS', key) == 0 then
      status = 2
    end
    if status ~= 2 then
      local flat = {}
      for k = first, first + added - 1 do
        table.insert(flat, ARGV[k])
        table.insert(flat, '')
      end
      for k = first + added + removed, i - 1 do table.insert(flat, ARGV[k]) end
      if #flat > 0 then redis.call('HSET', key, unpack(flat)) end
      if removed > 0 then
        redis.call('HDEL', key, unpack(ARGV, first + added, first + added + removed - 1))
      end
      if reset == '1' then redis.call('PEXPIRE', key, ttl) end  -- then the heartbeat renews it
    end
  else  -- 'F'
    if redis.call('HEXISTS', KEYS[2], ARGV[i+1]) == 1 then
      if redis.call('HINCRBY', KEYS[2], ARGV[i+1], ARGV[i+2]) > 0 then
        redis.call('HSET', KEYS[2], ARGV[i+1], 0)
      end
    end
    i = i + 3
  end
end
return status
""")

# The heartbeat renews the lease only while not fenced: a fenced worker must not look alive
# until it has handed back what it still holds. It also says whether the model card exists (a
# Redis restart loses it): one call, not a pipeline (a pipeline of scripts costs a SCRIPT EXISTS
# round trip first). The lease is renewed in the model's worker set too (what gateways check to
# serve the model); ids an hour stale leave it (ids are per process: the set would only grow).
# KEYS: fence flag, workers, model card, model workers. ARGV: worker id, now.
# Returns {renewed (1) or fenced (0), card exists (1|0)}. A worker publishing a prefix summary
# adds it as KEYS[5] and its time to live (ms) as ARGV[3]: it expires with the lease.
HEARTBEAT = _lua("""
local has_card = redis.call('EXISTS', KEYS[3])
if redis.call('EXISTS', KEYS[1]) == 1 then return {0, has_card} end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[2] - 3600)
if KEYS[5] then redis.call('PEXPIRE', KEYS[5], ARGV[3]) end
return {1, has_card}
""")
