-- cancel.lua: drop a queued or leased job (its client went away). A worker holding it
-- learns at its next renew or publish, which then fail.
-- KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 now_ms, 3 job_id, 4 finished_ttl_ms
-- Returns: 1 when cancelled, 0 when the job is unknown or already finished.
local id = ARGV[3]
local h = redis.call('HMGET', K.job .. id, 'st', 'tier', 'tenant', 'pin', 'dec', 'dl', 'ex')
if h[1] == 'queued' then
  unqueue(id, h[2], h[3], tonumber(h[4]), tonumber(h[5]), h[6], h[7], false)
elseif h[1] ~= 'leased' then
  return 0
end
finish(id, h[3], 'cancelled', ARGV[4])
return 1
