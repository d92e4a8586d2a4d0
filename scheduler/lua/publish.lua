-- publish.lua: append one event to a job's result stream if the worker still holds the
-- job; a done or error event also finishes the job, atomically. Its events carry no
-- queue wait, so none begins a run of the job (publish_step.lua, 'rf'): a worker
-- streams its steps with publish_step, and comes here only to fail a job.
-- KEYS: none; every key derives from the prefix in ARGV[1] (scheduler/keys.py).
-- ARGV: 1 prefix, 2 now_ms, 3 job_id, 4 worker_id or '' (any), 5 kind (tokens, done,
--       error), 6 token ids csv, 7 text, 8 finish reason, 9 error code, 10 error message,
--       11 result_ttl_ms, 12 finished_ttl_ms
-- Returns: the stream entry id, or false when the worker no longer holds the job.
local id, kind = ARGV[3], ARGV[5]
local h = redis.call('HMGET', K.job .. id, 'st', 'wk', 'tenant')
if h[1] ~= 'leased' then return false end
if ARGV[4] ~= '' and h[2] ~= ARGV[4] then return false end
local fields = {'k', kind}
local names = {'t', 'x', 'f', 'c', 'm'}
for i, name in ipairs(names) do
  if ARGV[5 + i] ~= '' then
    fields[#fields + 1] = name
    fields[#fields + 1] = ARGV[5 + i]
  end
end
local sid = emit(id, ARGV[11], fields)
if kind == 'tokens' and ARGV[6] ~= '' then  -- the tokens streamed (publish_step.lua)
  local _, num_commas = string.gsub(ARGV[6], ',', '')
  redis.call('HINCRBY', K.job .. id, 'nt', num_commas + 1)
end
if kind == 'done' then
  finish(id, h[3], 'done', ARGV[12])
elseif kind == 'error' then
  finish(id, h[3], 'failed', ARGV[12])
end
return sid
