-- charge.lua: add served tokens to the tenant's virtual counter and its tier's share.
-- KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 now_ms, 3 job_id, 4 input tokens, 5 output tokens,
--       6 input_token_weight, 7 output_token_weight, 8 share_bucket_ms
-- Returns: 1 when charged, 0 when the job is unknown (expired).
local h = redis.call('HMGET', K.job .. ARGV[3], 'tier', 'tenant', 'w')
if not h[1] then return 0 end
charge(h[1], h[2], tonumber(h[3]), tonumber(ARGV[4]), tonumber(ARGV[5]),
  tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[2]), tonumber(ARGV[8]))
return 1
