-- dispatch.lua: drop timed-out jobs, pick the next job by the tier policy, lease it and
-- charge its prompt tokens on its first lease (scheduler/policy.py states the rules).
-- One call leases up to a given number of jobs, each exactly as a dispatch of its own
-- at the same now_ms would, so dispatch_many pays the per-call cost once. A picked job
-- whose gateway has gone (owner_gone in _lib.lua) is abandoned, not leased, and the
-- next one picked (at most max_expired_per_dispatch of them per call).
-- KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 now_ms, 3 worker_id, 4 lease_ms, 5 input_token_weight,
--       6 output_token_weight, 7 share_bucket_ms, 8 share_buckets, 9 deadline_margin_ms,
--       10 max_expired_per_dispatch, 11 finished_ttl_ms, 12 result_ttl_ms, 13 most jobs,
--       14 gateway grace ms
-- Returns: one string per leased job, in order: "<rank>|<resumed token csv>|<job JSON>"
-- (fewer jobs than asked, or none, when the queue runs dry). One string per job,
-- because parsing reply elements was a large part of the client's cost. The leased jobs
-- come off the free sequence slots of the worker's capacity report, until they end.
local now, worker, lease_ms = tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local in_w, out_w = tonumber(ARGV[5]), tonumber(ARGV[6])
local bucket_ms, num_buckets = tonumber(ARGV[7]), tonumber(ARGV[8])
local margin_ms = tonumber(ARGV[9])
local current = math.floor(now / bucket_ms)
local tiers = tier_policy()

-- Once the window has moved past a bucket, delete it from every share hash, whether or
-- not a min_share check reads them (one HLEN per call while nothing is stale).
if redis.call('HLEN', K.share_total) > num_buckets then
  window_sum(K.share_total, current, num_buckets)
  for name in pairs(tiers) do window_sum(K.share .. name, current, num_buckets) end
end

-- Later jobs of one call skip reads whose answer cannot change within the call: nothing
-- here adds expiries or deadlines, so once every timed-out job is dropped none is left,
-- and once the earliest deadline is not at risk no later one is. The floor is written
-- once per tier at the end (dispatch never reads it).
local expiries_done, deadlines_done = false, false
local num_abandoned = 0
local floors = {}
-- Kept in this call instead of read and written per job (see _lib.lua).
share_pending = {}
depth_cache = {}
local flat_depth = redis.call('HGETALL', K.depth)
for i = 1, #flat_depth, 2 do depth_cache[flat_depth[i]] = tonumber(flat_depth[i + 1]) end

local leased_ids, leased_decode, leased_rank = {}, {}, {}

local function dispatch_one()
  -- 1. Queue timeouts: drop and tell the client through its result stream.
  if not expiries_done then
    local expired = redis.call('ZRANGEBYSCORE', K.expiries, '-inf', now, 'LIMIT', 0, ARGV[10])
    for _, eid in ipairs(expired) do
      local h = redis.call('HMGET', K.job .. eid, 'tier', 'tenant', 'pin', 'dec', 'dl')
      unqueue(eid, h[1], h[2], tonumber(h[3]), tonumber(h[4]), h[5], 'ex', false)
      emit(eid, ARGV[12], {'k', 'error', 'c', 'queue_timeout', 'm', 'queued longer than max_queue_ms'})
      finish(eid, h[2], 'dropped', ARGV[11])
    end
    expiries_done = #expired < tonumber(ARGV[10])
  end

  -- 2. Batch work whose deadline is at risk goes first, earliest deadline first.
  local id, popped = nil, false
  if not deadlines_done then
    local d = redis.call('ZRANGE', K.deadlines, 0, 0, 'WITHSCORES')
    if d[1] and tonumber(d[2]) - now <= margin_ms then
      id = d[1]
    else
      deadlines_done = true
    end
  end

  -- 3. Across tiers: a tier below its min_share first, else the best rank; within the
  --    tier the tenant with the smallest counter; within the tenant the earliest arrival.
  local counter = nil  -- the tenant's counter when the pick already read it
  if not id then
    if next(depth_cache) == nil then return nil end
    local any_name, any_rank, starved_name, starved_rank = nil, nil, nil, nil
    local total = nil  -- read only when a backlogged tier has a min_share
    for name in pairs(depth_cache) do
      local rank, min_share = UNCONFIGURED_TIER_RANK, 0
      local c = tiers[name]
      if c then rank, min_share = c.rank, c.min_share end
      if not any_name or tier_less(name, rank, any_name, any_rank) then
        any_name, any_rank = name, rank
      end
      if min_share > 0 then
        total = total or window_sum(K.share_total, current, num_buckets)
        if total > 0 and window_sum(K.share .. name, current, num_buckets) < min_share * total then
          if not starved_name or tier_less(name, rank, starved_name, starved_rank) then
            starved_name, starved_rank = name, rank
          end
        end
      end
    end
    local tier = starved_name or any_name
    -- A backlogged tenant's score is its counter (activate and charge write both).
    local low = redis.call('ZRANGE', K.active .. tier, 0, 0, 'WITHSCORES')
    counter = low[2]
    id = redis.call('ZPOPMIN', K.tq .. tier .. ':' .. low[1])[1]
    popped = true
  end

  -- 4. Lease it.
  local key = K.job .. id
  local h = redis.call('HMGET', key, 'tier', 'tenant', 'pin', 'dec', 'w', 'chg', 'j', 'res',
    'dl', 'ex', 'att', 'gw')
  local tier, tenant, pin = h[1], h[2], tonumber(h[3])
  local is_active = unqueue(id, tier, tenant, pin, tonumber(h[4]), h[9], h[10], popped)
  if num_abandoned < tonumber(ARGV[10]) and owner_gone(h[12], tonumber(ARGV[14])) then
    num_abandoned = num_abandoned + 1
    abandon(id, tenant, ARGV[12], ARGV[11])
    return dispatch_one()
  end
  if not counter then counter = redis.call('HGET', K.vtc .. tier, tenant) end
  floors[tier] = counter
  if h[6] ~= '1' then  -- 'chg': absent until the first lease charges the prompt
    charge(tier, tenant, tonumber(h[5]), pin, 0, in_w, out_w, now, bucket_ms, counter, is_active)
  end
  local lease_until = now + lease_ms
  redis.call('HSET', key, 'st', 'leased', 'wk', worker, 'lu', lease_until, 'chg', 1,
    'att', (tonumber(h[11]) or 0) + 1)
  redis.call('ZADD', K.leases, lease_until, id)
  leased_ids[#leased_ids + 1] = id
  leased_decode[#leased_ids] = tonumber(h[4]) or 0
  leased_rank[#leased_ids] = string.format('%d', rank_of(tiers, tier))
  return leased_rank[#leased_ids] .. '|' .. (h[8] or '') .. '|' .. h[7]
end

local leased = {}
for _ = 1, tonumber(ARGV[13]) do
  local one = dispatch_one()
  if not one then break end
  leased[#leased + 1] = one
end
for tier, counter in pairs(floors) do redis.call('HSET', K.floor, tier, counter) end
for key, tokens in pairs(share_pending) do redis.call('HINCRBY', key, current, tokens) end
-- The jobs take sequence slots the worker last reported free: admission stops counting
-- them before its next report (its hash is left alone once it has lapsed), and counts
-- their decode as held by the worker, per rank (seated:<worker>), until that report
-- does. Each job that took one is marked with the report it came after, to give both
-- back when it ends (free_seq in _lib.lua).
if #leased > 0 then
  local cap = K.cap .. worker
  local c = redis.call('HMGET', cap, 'num_free_seqs', 'rs')
  local free = tonumber(c[1] or '0')
  local taken = math.min(free, #leased_ids)
  if taken > 0 then
    redis.call('HSET', cap, 'num_free_seqs', free - taken)
    for i = 1, taken do
      redis.call('HSET', K.job .. leased_ids[i], 'sl', 1, 'sr', c[2] or '0', 'sk', leased_rank[i])
      redis.call('HINCRBY', K.seated .. worker, leased_rank[i], leased_decode[i])
    end
    redis.call('PEXPIRE', K.seated .. worker, math.max(1, redis.call('PTTL', cap)))
  end
end
return leased
