-- renew.lua: extend the lease of a job the worker still holds.
-- KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 now_ms, 3 worker_id, 4 job_id, 5 lease_ms
-- Returns: 1 when renewed, 0 when the worker no longer holds the job.
local key = K.job .. ARGV[4]
local h = redis.call('HMGET', key, 'st', 'wk')
if h[1] ~= 'leased' or h[2] ~= ARGV[3] then return 0 end
local lease_until = tonumber(ARGV[2]) + tonumber(ARGV[5])
redis.call('HSET', key, 'lu', lease_until)
redis.call('ZADD', K.leases, lease_until, ARGV[4])
return 1
