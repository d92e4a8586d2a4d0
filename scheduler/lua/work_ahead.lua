-- work_ahead.lua: the queued work the policy would serve before a new job of a tenant:
-- every job of better tiers, the tenant's own queue, and from each other tenant of its
-- tier the share fair queuing gives it while the new job's tenant is served; and the
-- decode of jobs of its rank or better seated since their worker's report (_lib.lua).
-- Read-only. KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 tier, 3 tenant, 4 weight, 5 the new job's prompt tokens
-- Returns: {prefill tokens, decode tokens, jobs queued in better tiers and its own} as
-- decimal strings.
local prefill, decode, num_jobs = work_ahead(ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]))
return {fmt(prefill), fmt(decode), fmt(num_jobs)}
