-- reclaim.lua: requeue jobs whose lease ran out (their worker died); each resumes after
-- the tokens already in its result stream, so the client sees no duplicate and no gap.
-- KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 now_ms, 3 most jobs to reclaim in one call
-- Returns: the reclaimed job ids, earliest lease end first.
local ids = redis.call('ZRANGEBYSCORE', K.leases, '-inf', ARGV[2], 'LIMIT', 0, ARGV[3])
for _, id in ipairs(ids) do
  requeue_job(id, streamed_csv(id))
end
return ids
