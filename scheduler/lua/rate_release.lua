-- rate_release.lua: end a reservation: free its concurrency slot and refund the tokens it
-- reserved but did not use. Releasing twice refunds once.
-- KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 now_ms, 3 tenant, 4 rpm (0 = none), 5 tpm (0 = none),
--       6 reservation id, 7 tokens to refund, 8 slots (see rate_reserve.lua)
-- Returns: 1 when released, 0 when the reservation was unknown (released or lapsed).
local U = 60000
local now, tenant = tonumber(ARGV[2]), ARGV[3]
local rpm, tpm = tonumber(ARGV[4]), tonumber(ARGV[5])
local bucket_key = K.rl .. tenant
if redis.call('ZREM', K.rl_inflight .. tenant, ARGV[6]) == 0 then return 0 end
for i = 1, tonumber(ARGV[8] or 1) - 1 do
  redis.call('ZREM', K.rl_inflight .. tenant, ARGV[6] .. '#' .. i)
end
local h = redis.call('HMGET', bucket_key, 'req', 'tok', 'ts')
if not h[3] then return 1 end
-- Both levels move to now together, since they share one timestamp.
local elapsed = math.max(0, now - tonumber(h[3]))
local req = math.min(rpm * U, tonumber(h[1] or rpm * U) + elapsed * rpm)
local tok = math.min(tpm * U, tonumber(h[2] or tpm * U) + elapsed * tpm + tonumber(ARGV[7]) * U)
-- An unlimited bucket keeps no level (see rate_reserve.lua).
local levels, unlimited = {'ts', now}, {}
if rpm > 0 then table.insert(levels, 'req'); table.insert(levels, string.format('%d', req))
else table.insert(unlimited, 'req') end
if tpm > 0 then table.insert(levels, 'tok'); table.insert(levels, string.format('%d', tok))
else table.insert(unlimited, 'tok') end
redis.call('HSET', bucket_key, unpack(levels))
if #unlimited > 0 then redis.call('HDEL', bucket_key, unpack(unlimited)) end
return 1
