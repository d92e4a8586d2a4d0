-- work_ahead.lua: the queued work the policy would serve before a new job of a tenant:
-- every job of better tiers, the tenant's own queue, and from each other tenant of its
-- tier the share fair queuing gives it while the new job's tenant is served.
-- Read-only. KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 tier, 3 tenant, 4 weight, 5 the new job's prompt tokens
-- Returns: {prefill tokens, decode tokens} as decimal strings.
local tier, tenant, weight = ARGV[2], ARGV[3], tonumber(ARGV[4])
local tiers = tier_policy()
local my_rank = rank_of(tiers, tier)
local prefill, decode = 0, 0
local depth = redis.call('HGETALL', K.depth)
for i = 1, #depth, 2 do
  local name = depth[i]
  if name ~= tier and tier_less(name, rank_of(tiers, name), tier, my_rank) then
    for _, v in ipairs(redis.call('HVALS', K.qprefill .. name)) do prefill = prefill + tonumber(v) end
    for _, v in ipairs(redis.call('HVALS', K.qdecode .. name)) do decode = decode + tonumber(v) end
  end
end
local own_prefill = tonumber(redis.call('HGET', K.qprefill .. tier, tenant) or '0')
prefill = prefill + own_prefill
decode = decode + tonumber(redis.call('HGET', K.qdecode .. tier, tenant) or '0')
local mine = tonumber(ARGV[5]) + own_prefill
local queued = redis.call('HGETALL', K.qprefill .. tier)
for i = 1, #queued, 2 do
  local other, q = queued[i], tonumber(queued[i + 1])
  if other ~= tenant and q > 0 then
    local w = tonumber(redis.call('HGET', K.weights .. tier, other))
    local take = math.min(q, mine * w / weight)
    prefill = prefill + take
    decode = decode + tonumber(redis.call('HGET', K.qdecode .. tier, other) or '0') * take / q
  end
end
return {fmt(prefill), fmt(decode)}
