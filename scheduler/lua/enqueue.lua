-- enqueue.lua: queue admitted jobs, in order, each at the tail of its tenant's queue.
-- One call takes a batch so that enqueue_many pays the per-call cost once; each job's
-- outcome is exactly that of enqueueing it alone.
-- KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 now_ms, then 9 per job: job_id, job JSON, tier, tenant, weight,
--       prompt tokens, max_tokens, deadline ms or '', expire-at ms or ''
-- Returns: per job 'ok', 'unknown_tier', 'duplicate' or 'queue_full'.
local policies = {}  -- tier -> {rank, max_queued} or false, read once per call
local seq = tonumber(redis.call('GET', K.seq) or '0')
local first_seq = seq
local outcomes = {}

local function enqueue_one(a)
  local id, tier, tenant = ARGV[a], ARGV[a + 2], ARGV[a + 3]
  local p = policies[tier]
  if p == nil then
    local h = redis.call('HMGET', K.tier_policy, 'rank:' .. tier, 'max_queued:' .. tier)
    p = h[1] and {max_queued = tonumber(h[2])} or false
    policies[tier] = p
  end
  if not p then return 'unknown_tier' end
  if redis.call('EXISTS', K.job .. id) == 1 then return 'duplicate' end
  if p.max_queued and tonumber(redis.call('HGET', K.depth, tier) or '0') >= p.max_queued then
    return 'queue_full'
  end
  seq = seq + 1
  redis.call('HSET', K.job .. id, 'j', ARGV[a + 1], 'tier', tier, 'tenant', tenant,
    'w', ARGV[a + 4], 'pin', ARGV[a + 5], 'dec', ARGV[a + 6], 'seq', seq, 'dl', ARGV[a + 7],
    'ex', ARGV[a + 8], 'chg', 0, 'att', 0, 'res', '', 'wk', '', 'lu', 0, 'st', 'queued')
  redis.call('HSET', K.weights .. tier, tenant, ARGV[a + 4])
  push(id, tier, tenant, seq, tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6]), ARGV[a + 7])
  if ARGV[a + 8] ~= '' then redis.call('ZADD', K.expiries, ARGV[a + 8], id) end
  return 'ok'
end

for a = 3, #ARGV, 9 do
  outcomes[#outcomes + 1] = enqueue_one(a)
end
if seq ~= first_seq then redis.call('SET', K.seq, seq) end
return outcomes
