-- claim_unbilled.lua: take, for the caller to bill, the ended jobs that gateways gone for
-- a while never settled (their usage records may never have been written; the caller
-- checks). A job of theirs that never left the queue served nothing and is dropped
-- unbilled; one still queued after a lease, or leased, is left for a later call (it is
-- abandoned soon: owner_gone in _lib.lua). A gone gateway with nothing left to settle
-- leaves `billing`. A claimed job is marked (`bl` in its hash): a gateway that was only
-- unresponsive for that long finds it so before writing its own record (claimed_elsewhere).
-- KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 now_ms (unused: the grace runs on Redis's clock), 3 the caller's
--       gateway id (never its own jobs), 4 how long a gateway must have been gone (ms),
--       5 most jobs to claim
-- Returns: per claimed job 5 strings: id, tenant, tier, status, billed prompt tokens.
local gone_ms, limit = tonumber(ARGV[4]), tonumber(ARGV[5])
local out = {}
for _, gateway in ipairs(redis.call('SMEMBERS', K.billing)) do
  if #out >= 5 * limit then break end
  if gateway ~= ARGV[3] and owner_gone(gateway, gone_ms) then
    local set = K.unbilled .. gateway
    for _, id in ipairs(redis.call('SMEMBERS', set)) do
      if #out >= 5 * limit then break end
      local h = redis.call('HMGET', K.job .. id, 'st', 'att', 'tenant', 'tier', 'bp')
      local served = (tonumber(h[2]) or 0) > 0
      local running = h[1] == 'queued' or h[1] == 'leased'
      if not (served and running) then
        redis.call('SREM', set, id)
        if served then
          redis.call('HSET', K.job .. id, 'bl', 1)
          for _, v in ipairs({id, h[3], h[4], h[1], h[5] or '0'}) do out[#out + 1] = v end
        end
      end
    end
    if redis.call('SCARD', set) == 0 then redis.call('SREM', K.billing, gateway) end
  end
end
return out
