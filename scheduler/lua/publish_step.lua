-- publish_step.lua: one engine step of a leased job in one call: its tokens event, their
-- charge to the tenant's counter and, when the step ended the job, its done event. The
-- same as publish (tokens), charge and publish (done) in turn, without three round trips.
-- KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 now_ms, 3 job_id, 4 worker_id, 5 token ids csv, 6 text,
--       7 output tokens, 8 input_token_weight, 9 output_token_weight, 10 share_bucket_ms,
--       11 finish reason ('' while the job runs on), 12 result_ttl_ms, 13 finished_ttl_ms,
--       14 queue wait ms or '' (on the step's first event; see ResultEvent),
--       15 the tokens' log-probabilities (scheduler/logprobs.py) or ''
-- Stream entry fields: k kind, q queue wait, t token ids, x text, l log-probabilities,
--       f finish reason. The job hash's 'nt' counts the tokens streamed (an entry holds
--       a step's, or several steps' when the worker batches them).
-- A lease's first event (the one with the queue wait) for a job that streamed tokens
-- before begins a new run of the job, after the lapse of a dead worker's lease or a
-- hand-back: the job hash's 'rf' holds the ms of that entry's id and 'rb' the tokens
-- streamed before it (JobProgress.run_first_token_ms, read by job_progress).
-- Returns: 1 when published, 0 when the worker no longer holds the job (nothing written).
local id = ARGV[3]
local h = redis.call('HMGET', K.job .. id, 'st', 'wk', 'tier', 'tenant', 'w', 'nt')
if h[1] ~= 'leased' or h[2] ~= ARGV[4] then return 0 end
local wait = ARGV[14]
local function mark_run(sid)
  local before = h[6] or '0'
  if tonumber(before) > 0 then
    redis.call('HSET', K.job .. id, 'rf', string.match(sid, '^%d+'), 'rb', before)
  end
end
if ARGV[5] ~= '' or ARGV[6] ~= '' then
  local fields = {'k', 'tokens'}
  local begins = wait ~= ''
  if begins then
    fields[#fields + 1] = 'q'
    fields[#fields + 1] = wait
    wait = ''
  end
  if ARGV[5] ~= '' then
    fields[#fields + 1] = 't'
    fields[#fields + 1] = ARGV[5]
  end
  if ARGV[6] ~= '' then
    fields[#fields + 1] = 'x'
    fields[#fields + 1] = ARGV[6]
  end
  if ARGV[15] ~= '' then
    fields[#fields + 1] = 'l'
    fields[#fields + 1] = ARGV[15]
  end
  local sid = emit(id, ARGV[12], fields)
  if begins then mark_run(sid) end
  redis.call('HINCRBY', K.job .. id, 'nt', tonumber(ARGV[7]))
  charge(h[3], h[4], tonumber(h[5]), 0, tonumber(ARGV[7]), tonumber(ARGV[8]),
    tonumber(ARGV[9]), tonumber(ARGV[2]), tonumber(ARGV[10]))
end
if ARGV[11] ~= '' then
  local fields = {'k', 'done', 'f', ARGV[11]}
  if wait ~= '' then
    fields[#fields + 1] = 'q'
    fields[#fields + 1] = wait
  end
  local sid = emit(id, ARGV[12], fields)
  if wait ~= '' then mark_run(sid) end
  finish(id, h[4], 'done', ARGV[13])
end
return 1
