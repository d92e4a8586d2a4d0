-- set_tenant_weight.lua: change a tenant's fair-share weight for the jobs it has queued or
-- leased; every later charge of theirs divides by it. Nothing already charged changes:
-- counters keep their units (tokens per unit of weight), so comparing them and lifting a
-- returning tenant to the smallest backlogged one stay fair.
-- KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 tenant, 3 weight
-- Returns: 1 when the tenant has jobs (they take the weight), 0 when it has none (nothing
--          is stored: its next job brings the weight with it).
if not redis.call('HGET', K.live_jobs, ARGV[2]) then return 0 end
redis.call('HSET', K.weights, ARGV[2], ARGV[3])
return 1
