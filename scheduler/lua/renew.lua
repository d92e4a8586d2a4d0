-- renew.lua: extend the lease of a job the worker still holds. A job whose gateway has
-- gone (owner_gone in _lib.lua) is abandoned instead: nobody is left to read it, and the
-- worker stops it as it stops a job whose client went away.
-- KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 now_ms, 3 worker_id, 4 job_id, 5 lease_ms, 6 gateway grace ms,
--       7 result_ttl_ms, 8 finished_ttl_ms
-- Returns: 1 when renewed, 0 when the worker no longer holds the job (or it was abandoned).
local key = K.job .. ARGV[4]
local h = redis.call('HMGET', key, 'st', 'wk', 'gw', 'tenant')
if h[1] ~= 'leased' or h[2] ~= ARGV[3] then return 0 end
local now = tonumber(ARGV[2])
if owner_gone(h[3], tonumber(ARGV[6])) then
  abandon(ARGV[4], h[4], ARGV[7], ARGV[8])
  return 0
end
local lease_until = now + tonumber(ARGV[5])
redis.call('HSET', key, 'lu', lease_until)
redis.call('ZADD', K.leases, lease_until, ARGV[4])
return 1
