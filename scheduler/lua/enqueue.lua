-- enqueue.lua: queue admitted jobs, in order, each at the tail of its tenant's queue.
-- One call takes a batch so that enqueue_many pays the per-call cost once; each job's
-- outcome is exactly that of enqueueing it alone.
-- KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 now_ms, 3 an SLO budget or '' (below), 4 the enqueueing gateway's
--       id or '' (its jobs are abandoned once it has gone: owner_gone in _lib.lua), then
--       3 per job: job_id, job JSON, and the fields the queue reads in one tab-separated
--       string (fewer arguments cost the client less): tier, weight (the tenant's from
--       now on), prompt tokens, max_tokens, deadline ms or '', expire-at ms or '', the
--       prompt tokens billed should the gateway go unsettled or '' (not tracked: see
--       `unbilled` in scheduler/keys.py), tenant (last, so it may hold any character)
--       The SLO budget is SloBudget's fields, space-separated: ttft_slo_ms, prefill and
--       decode tokens/s, held prefill and decode tokens, decode fraction, free sequence
--       slots, slots it may preempt, requests held without a slot ahead of it, 1 if
--       slot releases follow, the releases in ms (all
--       optional; slo_predict in _lib.lua). With it, each job's TTFT is predicted from the work queued
--       ahead of it (work_ahead) and the job refused when the prediction exceeds the SLO
--       (or its own prefill, if longer).
-- Returns: the jobs' outcomes in order, space-separated, each 'ok', 'unknown_tier',
--          'duplicate' or 'queue_full' (one string parses faster than an array); with a
--          budget 'ok:<predicted ms>' or 'slo:<predicted ms>' (refused) instead of 'ok'.
local policies = {}  -- tier -> {max_queued} or false, read once per call
-- Arrival numbers: the first from INCR, the rest counted here and added at the end.
local seq, first_seq = nil, nil
local outcomes = {}
depth_pending = {}

local FIELDS = '^([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t(.*)$'
local num_unbilled = 0
local budget = nil
local held = nil
if ARGV[3] ~= '' then
  budget = {}
  for x in string.gmatch(ARGV[3], '%S+') do budget[#budget + 1] = tonumber(x) end
  -- The gateway's budget comes from reports it read up to a moment ago. The free slots
  -- and the work engines hold are counted here as the workers' latest reports say now:
  -- the free slots less those leases took since and plus those ended jobs gave back
  -- (dispatch.lua, free_seq); the decode of the jobs seated in them counts in the work
  -- ahead (seated_decode in _lib.lua) until a report holds it. From the budget alone,
  -- a burst arriving a few milliseconds apart saw the same free slots, and was admitted
  -- past them to wait for releases nobody knew of; and a report that took in the seated
  -- jobs' work while the gateway still held the report before it counted it nowhere.
  local free = 0
  local live = redis.call('ZRANGEBYSCORE', K.workers, '(' .. ARGV[2], '+inf')
  -- {rank, prefill, decode} per rank of each live worker's report; with no report to go
  -- by, the budget's own work stands.
  if #live > 0 then held = {} end
  for _, worker in ipairs(live) do
    local c = redis.call('HMGET', K.cap .. worker, 'num_free_seqs',
      'unprefilled_tokens_by_rank', 'decode_tokens_by_rank')
    free = free + (tonumber(c[1]) or 0)
    local prefill = c[2] and c[2] ~= '' and cjson.decode(c[2]) or {}
    local decode = c[3] and c[3] ~= '' and cjson.decode(c[3]) or {}
    for r, n in pairs(prefill) do held[#held + 1] = {tonumber(r), n, 0} end
    for r, n in pairs(decode) do held[#held + 1] = {tonumber(r), 0, n} end
  end
  if #live > 0 and #budget >= 7 then budget[7] = free end
end

local function enqueue_one(id, json, fields)
  local tier, weight, pin, dec, dl, ex, bp, tenant = string.match(fields, FIELDS)
  local p = policies[tier]
  if p == nil then
    local h = redis.call('HMGET', K.tier_policy, 'rank:' .. tier, 'max_queued:' .. tier)
    p = h[1] and {rank = tonumber(h[1]), max_queued = tonumber(h[2])} or false
    policies[tier] = p
  end
  if not p then return 'unknown_tier' end
  local ok = 'ok'
  if budget then
    local prefill, decode, num_jobs = work_ahead(tier, tenant, tonumber(weight), tonumber(pin))
    if held then  -- the work engines hold of its rank or better (backlog_ahead)
      budget[4], budget[5] = 0, 0
      for _, w in ipairs(held) do
        if w[1] <= p.rank then budget[4], budget[5] = budget[4] + w[2], budget[5] + w[3] end
      end
    end
    local predicted = slo_predict(budget, prefill, decode, num_jobs, tonumber(pin))
    -- SloBudget.limit_ms: the SLO, or the job's own prefill if that alone exceeds it.
    local limit = math.max(budget[1], 1000.0 * tonumber(pin) / budget[2])
    if predicted > limit then return 'slo:' .. fmt(predicted) end
    ok = 'ok:' .. fmt(predicted)
  end
  if p.max_queued then
    if redis.call('EXISTS', K.job .. id) == 1 then return 'duplicate' end
    local queued = tonumber(redis.call('HGET', K.depth, tier) or '0')
    if queued + (depth_pending[tier] or 0) >= p.max_queued then return 'queue_full' end
    redis.call('HSET', K.job .. id, 'j', json)
  elseif redis.call('HSETNX', K.job .. id, 'j', json) == 0 then
    -- Without a cap nothing can refuse the job after this check, so the existence test
    -- and the first write are one call. Every job hash holds 'j' until it expires.
    return 'duplicate'
  end
  if seq then
    seq = seq + 1
  else
    seq = redis.call('INCR', K.seq)
    first_seq = seq
  end
  -- Fields a lease writes later ('chg', 'att', 'res', 'wk', 'lu') start out absent.
  redis.call('HSET', K.job .. id, 'tier', tier, 'tenant', tenant, 'w', weight, 'pin', pin,
    'dec', dec, 'seq', seq, 'dl', dl, 'ex', ex, 'st', 'queued', 'gw', ARGV[4])
  -- The job's weight is the latest the gateway knew: it becomes the tenant's current one,
  -- which charges of all its jobs divide by.
  redis.call('HSET', K.weights, tenant, weight)
  redis.call('HINCRBY', K.live_jobs, tenant, 1)
  if bp ~= '' and ARGV[4] ~= '' then
    redis.call('HSET', K.job .. id, 'bp', bp)
    redis.call('SADD', K.unbilled .. ARGV[4], id)
    num_unbilled = num_unbilled + 1
  end
  push(id, tier, tenant, seq, tonumber(pin), tonumber(dec), dl)
  if ex ~= '' then redis.call('ZADD', K.expiries, ex, id) end
  return ok
end

for a = 5, #ARGV, 3 do
  outcomes[#outcomes + 1] = enqueue_one(ARGV[a], ARGV[a + 1], ARGV[a + 2])
end
if seq and seq > first_seq then redis.call('INCRBY', K.seq, seq - first_seq) end
for tier, n in pairs(depth_pending) do redis.call('HINCRBY', K.depth, tier, n) end
if num_unbilled > 0 then redis.call('SADD', K.billing, ARGV[4]) end
return table.concat(outcomes, ' ')
