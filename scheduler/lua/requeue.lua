-- requeue.lua: put a leased job back at its arrival position in its tenant's queue
-- (ahead of every later arrival); it resumes after the tokens already in its result
-- stream, which are what the client has (a worker's own count can miss a publish that
-- reached Redis while the worker was being stopped). Counted in `totals` (requeues).
-- KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 now_ms, 3 job_id, 4 worker_id or '' (any)
-- Returns: 1 when requeued, 0 when the job is not leased (by that worker).
local h = redis.call('HMGET', K.job .. ARGV[3], 'st', 'wk')
if h[1] ~= 'leased' then return 0 end
if ARGV[4] ~= '' and h[2] ~= ARGV[4] then return 0 end
requeue_job(ARGV[3], streamed_csv(ARGV[3]))
redis.call('HINCRBY', K.totals, 'requeues', 1)
return 1
