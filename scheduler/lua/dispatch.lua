-- dispatch.lua: drop timed-out jobs, pick the next job by the tier policy, lease it and
-- charge its prompt tokens on its first lease (scheduler/policy.py states the rules).
-- KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 now_ms, 3 worker_id, 4 lease_ms, 5 input_token_weight,
--       6 output_token_weight, 7 share_bucket_ms, 8 share_buckets, 9 deadline_margin_ms,
--       10 max_expired_per_dispatch, 11 finished_ttl_ms, 12 result_ttl_ms
-- Returns: false when nothing is queued, else {job_id, job JSON, resumed token csv, rank}.
local now, worker, lease_ms = tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local in_w, out_w = tonumber(ARGV[5]), tonumber(ARGV[6])
local bucket_ms, num_buckets = tonumber(ARGV[7]), tonumber(ARGV[8])

-- 1. Queue timeouts: drop and tell the client through its result stream.
local expired = redis.call('ZRANGEBYSCORE', K.expiries, '-inf', now, 'LIMIT', 0, ARGV[10])
for _, eid in ipairs(expired) do
  local h = redis.call('HMGET', K.job .. eid, 'tier', 'tenant', 'pin', 'dec')
  unqueue(eid, h[1], h[2], tonumber(h[3]), tonumber(h[4]))
  emit(eid, ARGV[12], {'k', 'error', 'c', 'queue_timeout', 'm', 'queued longer than max_queue_ms'})
  finish(eid, 'dropped', ARGV[11])
end

local tiers = tier_table()

-- 2. Batch work whose deadline is at risk goes first, earliest deadline first.
local id = nil
local d = redis.call('ZRANGE', K.deadlines, 0, 0, 'WITHSCORES')
if d[1] and tonumber(d[2]) - now <= tonumber(ARGV[9]) then id = d[1] end

-- 3. Across tiers: a tier below its min_share first, else the best rank; within the tier
--    the tenant with the smallest counter; within the tenant the earliest arrival.
if not id then
  local depth = redis.call('HGETALL', K.depth)
  if #depth == 0 then return false end
  local current = math.floor(now / bucket_ms)
  local function window_sum(key)
    local flat = redis.call('HGETALL', key)
    local sum = 0
    for i = 1, #flat, 2 do
      if tonumber(flat[i]) > current - num_buckets then
        sum = sum + tonumber(flat[i + 1])
      else
        redis.call('HDEL', key, flat[i])
      end
    end
    return sum
  end
  local total = window_sum(K.share_total)
  local any_name, any_rank, starved_name, starved_rank = nil, nil, nil, nil
  for i = 1, #depth, 2 do
    local name = depth[i]
    local rank, min_share = UNCONFIGURED_TIER_RANK, 0
    if tiers[name] then rank, min_share = tiers[name].rank, tiers[name].min_share end
    if not any_name or tier_less(name, rank, any_name, any_rank) then
      any_name, any_rank = name, rank
    end
    if min_share > 0 and total > 0 and window_sum(K.share .. name) < min_share * total then
      if not starved_name or tier_less(name, rank, starved_name, starved_rank) then
        starved_name, starved_rank = name, rank
      end
    end
  end
  local tier = starved_name or any_name
  local tenant = redis.call('ZRANGE', K.active .. tier, 0, 0)[1]
  id = redis.call('ZRANGE', K.tq .. tier .. ':' .. tenant, 0, 0)[1]
end

-- 4. Lease it.
local h = redis.call('HMGET', K.job .. id, 'tier', 'tenant', 'pin', 'dec', 'w', 'chg', 'j', 'res')
local tier, tenant, pin = h[1], h[2], tonumber(h[3])
unqueue(id, tier, tenant, pin, tonumber(h[4]))
redis.call('HSET', K.floor, tier, redis.call('HGET', K.vtc .. tier, tenant))
if h[6] == '0' then
  charge(tier, tenant, tonumber(h[5]), pin, 0, in_w, out_w, now, bucket_ms)
end
local lease_until = now + lease_ms
redis.call('HSET', K.job .. id, 'st', 'leased', 'wk', worker, 'lu', lease_until, 'chg', 1)
redis.call('HINCRBY', K.job .. id, 'att', 1)
redis.call('ZADD', K.leases, lease_until, id)
return {id, h[7], h[8], rank_of(tiers, tier)}
