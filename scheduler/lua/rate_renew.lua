-- rate_renew.lua: keep alive the concurrency slots a gateway still holds (mirrors
-- MemoryRateLimiter.renew in scheduler/rate_limit.py). A slot not renewed lapses after
-- its hold, so the slots of a gateway that died come free within one hold.
-- KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 now_ms, 3 hold_ms, then triples: tenant, reservation id, slots
-- Returns: how many of the reservations were still held (and are renewed).
local now, hold = tonumber(ARGV[2]), tonumber(ARGV[3])
local renewed = 0
for a = 4, #ARGV, 3 do
  local key = K.rl_inflight .. ARGV[a]
  local lapses = redis.call('ZSCORE', key, ARGV[a + 1])
  if lapses and tonumber(lapses) > now then
    redis.call('ZADD', key, 'XX', now + hold, ARGV[a + 1])
    for i = 1, tonumber(ARGV[a + 2]) - 1 do
      redis.call('ZADD', key, 'XX', now + hold, ARGV[a + 1] .. '#' .. i)
    end
    if redis.call('PTTL', key) < hold then redis.call('PEXPIRE', key, hold) end
    renewed = renewed + 1
  end
end
return renewed
