-- reclaim.lua: requeue jobs whose lease ran out (their worker died); each resumes after
-- the tokens already in its result stream, so the client sees no duplicate and no gap.
-- A job whose gateway has gone (owner_gone in _lib.lua) is abandoned instead. Every lease
-- that ran out counts in `totals` (lease_expirations).
-- KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 now_ms, 3 most jobs to reclaim in one call, 4 gateway grace ms,
--       5 result_ttl_ms, 6 finished_ttl_ms
-- Returns: the requeued job ids, earliest lease end first.
local now = tonumber(ARGV[2])
local ids = redis.call('ZRANGEBYSCORE', K.leases, '-inf', ARGV[2], 'LIMIT', 0, ARGV[3])
local requeued = {}
for _, id in ipairs(ids) do
  local h = redis.call('HMGET', K.job .. id, 'gw', 'tenant')
  if owner_gone(h[1], tonumber(ARGV[4])) then
    abandon(id, h[2], ARGV[5], ARGV[6])
  else
    requeue_job(id, streamed_csv(id))
    requeued[#requeued + 1] = id
  end
end
if #ids > 0 then redis.call('HINCRBY', K.totals, 'lease_expirations', #ids) end
return requeued
