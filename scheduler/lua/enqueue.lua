-- enqueue.lua: queue one admitted job at the tail of its tenant's queue.
-- KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 now_ms, 3 job_id, 4 job JSON, 5 tier, 6 tenant, 7 weight,
--       8 prompt tokens, 9 max_tokens, 10 deadline ms or '', 11 expire-at ms or ''
-- Returns: 'ok', 'unknown_tier', 'duplicate' or 'queue_full'.
local id, tier, tenant = ARGV[3], ARGV[5], ARGV[6]
local cfg_json = redis.call('HGET', K.tiers, tier)
if not cfg_json then return 'unknown_tier' end
if redis.call('EXISTS', K.job .. id) == 1 then return 'duplicate' end
local cfg = cjson.decode(cfg_json)
if cfg.max_queued_jobs ~= cjson.null
    and tonumber(redis.call('HGET', K.depth, tier) or '0') >= cfg.max_queued_jobs then
  return 'queue_full'
end
local seq = redis.call('INCR', K.seq)
redis.call('HSET', K.job .. id, 'j', ARGV[4], 'tier', tier, 'tenant', tenant, 'w', ARGV[7],
  'pin', ARGV[8], 'dec', ARGV[9], 'seq', seq, 'dl', ARGV[10], 'chg', 0, 'att', 0,
  'res', '', 'wk', '', 'lu', 0)
redis.call('HSET', K.weights .. tier, tenant, ARGV[7])
push(id, tier, tenant, seq, tonumber(ARGV[8]), tonumber(ARGV[9]), ARGV[10])
if ARGV[11] ~= '' then redis.call('ZADD', K.expiries, ARGV[11], id) end
return 'ok'
