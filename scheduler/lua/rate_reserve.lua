-- rate_reserve.lua: atomically reserve one request and prompt + max_tokens tokens from a
-- tenant's RPM and TPM buckets and its concurrency slots (mirrors scheduler/rate_limit.py).
-- Bucket levels are integers in 1/60000 of a token (or request), so a bucket of L per
-- minute refills exactly L units per ms and every wait is exact. A bucket with no limit
-- keeps no level: a limit set later starts it full, as a new tenant's.
-- KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 now_ms, 3 tenant, 4 rpm (0 = none), 5 tpm (0 = none),
--       6 max_concurrency (0 = none), 7 tokens to reserve, 8 reservation id, 9 hold_ms,
--       10 slots (one per sequence: the id's entry, then id#1, id#2, ...)
-- Returns: {outcome, wait_ms, request units, token units, in flight} where outcome is
--          'ok', 'requests', 'tokens', 'concurrency' or 'too_large'.
local U = 60000
local now, tenant = tonumber(ARGV[2]), ARGV[3]
local rpm, tpm, max_conc = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local cost, slots = tonumber(ARGV[7]), tonumber(ARGV[10] or 1)
local bucket_key, inflight_key = K.rl .. tenant, K.rl_inflight .. tenant
redis.call('ZREMRANGEBYSCORE', inflight_key, '-inf', now)
local inflight = redis.call('ZCARD', inflight_key)
local h = redis.call('HMGET', bucket_key, 'req', 'tok', 'ts')
local elapsed = 0
if h[3] then elapsed = math.max(0, now - tonumber(h[3])) end
local req = math.min(rpm * U, tonumber(h[1] or rpm * U) + elapsed * rpm)
local tok = math.min(tpm * U, tonumber(h[2] or tpm * U) + elapsed * tpm)
local function reply(outcome, wait)
  return {outcome, tostring(wait), string.format('%d', req), string.format('%d', tok), inflight}
end
if tpm > 0 and cost > tpm then return reply('too_large', 0) end
if max_conc > 0 and inflight + slots > max_conc then return reply('concurrency', 0) end
local req_wait, tok_wait = 0, 0
if rpm > 0 and req < U then req_wait = math.ceil((U - req) / rpm) end
if tpm > 0 and tok < cost * U then tok_wait = math.ceil((cost * U - tok) / tpm) end
if req_wait > 0 or tok_wait > 0 then
  if req_wait >= tok_wait then return reply('requests', req_wait) end
  return reply('tokens', tok_wait)
end
if rpm > 0 then req = req - U end
if tpm > 0 then tok = tok - cost * U end
local levels, unlimited = {'ts', now}, {}
if rpm > 0 then table.insert(levels, 'req'); table.insert(levels, string.format('%d', req))
else table.insert(unlimited, 'req') end
if tpm > 0 then table.insert(levels, 'tok'); table.insert(levels, string.format('%d', tok))
else table.insert(unlimited, 'tok') end
redis.call('HSET', bucket_key, unpack(levels))
if #unlimited > 0 then redis.call('HDEL', bucket_key, unpack(unlimited)) end
redis.call('PEXPIRE', bucket_key, 120000)
local entries = {now + tonumber(ARGV[9]), ARGV[8]}
for i = 1, slots - 1 do
  table.insert(entries, now + tonumber(ARGV[9])); table.insert(entries, ARGV[8] .. '#' .. i)
end
redis.call('ZADD', inflight_key, unpack(entries))
redis.call('PEXPIRE', inflight_key, tonumber(ARGV[9]))
inflight = inflight + slots
return reply('ok', 0)
