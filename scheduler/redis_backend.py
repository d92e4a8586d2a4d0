"""The shared queue backend: Redis, one Lua script per atomic operation.

Many gateways and workers share one Redis. Each operation runs as one script
(scheduler/lua/<op>.lua, loaded with `register_script`), so the policy decision and its
bookkeeping are atomic. Semantics are those of MemoryBackend; a differential test holds
the two to the same dispatch order.

The client must be created with `decode_responses=True` (use `RedisBackend.from_url`).
A Redis that cannot be reached raises BackendUnavailableError, which callers map to 503;
nothing is cached, so service resumes by itself when Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from scheduler import policy
from scheduler.backend import (
    BILL_GRACE_MS,
    GATEWAY_GRACE_MS,
    START_CURSOR,
    WORKER_DETAIL_TYPES,
    BackendUnavailableError,
    DuplicateJobError,
    EventKind,
    FleetCapacity,
    JobProgress,
    JobStatus,
    QueueFullError,
    QueueTotals,
    ResultEvent,
    SloBudget,
    TenantDepth,
    TierDepth,
    UnbilledJob,
    UnknownTierError,
    WorkAhead,
    WorkerReport,
    add_by_rank,
    best_rank_waiting,
    worker_details,
)
from scheduler.job import Job
from scheduler.keys import KeySpace, lua_key_table
from scheduler.memory_backend import wall_clock_ms
from scheduler.policy import PolicyConfig, TierConfig
from scheduler.script_channel import ScriptChannel, run_script
from scheduler.slot_release import merge_releases
from scheduler.stream_reader import StreamReader

# Jobs per script call in enqueue_many and dispatch_many: enough to spread the fixed cost
# of a call, few enough that one call holds Redis (single-threaded) for at most a few ms.
MAX_JOBS_PER_CALL = 50

_SCRIPTS = (
    "enqueue",
    "dispatch",
    "charge",
    "renew",
    "requeue",
    "reclaim",
    "cancel",
    "publish",
    "publish_step",
    "work_ahead",
    "set_tenant_weight",
    "claim_unbilled",
)


_LUA_NAME = re.compile(r"^local (?:function )?(\w+)", re.MULTILINE)
_LUA_KEY_FAMILY = re.compile(r"\bK\.(\w+)")


def load_script_source(name: str, *, with_queue_lib: bool = True) -> str:
    """The full source of scheduler/lua/<name>.lua as sent to Redis (key table + helpers).

    Redis runs a script's whole body on every call, so it gets only the helper blocks of
    _lib.lua it uses (directly or through another helper) and only the key names those
    reference: building unused keys and closures was a measurable part of each call.
    """
    lua = resources.files("scheduler") / "lua"
    source = (lua / f"{name}.lua").read_text(encoding="utf-8")
    lib = _used_helpers((lua / "_lib.lua").read_text(encoding="utf-8"), source)
    if not with_queue_lib:
        lib = ""
    families = _LUA_KEY_FAMILY.findall(lib + source)
    return lua_key_table(families) + lib + source


def _used_helpers(lib: str, source: str) -> str:
    """The blocks of `lib` (separated by blank lines) whose name `source` needs."""
    blocks = [b for b in lib.split("\n\n") if _LUA_NAME.search(b)]
    named = {_LUA_NAME.search(b).group(1): b for b in blocks}  # type: ignore[union-attr]
    wanted: set[str] = set()
    pending = [source]
    while pending:
        text = pending.pop()
        for helper, block in named.items():
            if helper not in wanted and re.search(rf"\b{helper}\b", text):
                wanted.add(helper)
                pending.append(block)
    return "".join(b + "\n\n" for b in blocks if _LUA_NAME.search(b).group(1) in wanted)  # type: ignore[union-attr]


@contextlib.contextmanager
def unavailable_as_error() -> Iterator[None]:
    """Turn "cannot reach Redis" into the queue's own typed error."""
    try:
        yield
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        raise BackendUnavailableError(f"the shared queue (Redis) is unreachable: {exc}") from exc


def _csv(token_ids: Sequence[int]) -> str:
    return ",".join(str(int(t)) for t in token_ids)


def _tokens(csv: str | None) -> tuple[int, ...]:
    return tuple(int(t) for t in csv.split(",")) if csv else ()


# Fields of a `cap:<worker>` hash, in the order fleet_capacity reads them.
_CAPACITY_FIELDS = (
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "unprefilled_tokens_by_rank",
    "decode_tokens_by_rank",
    "num_free_seqs",
    "release_ms",
    "preemptible_by_rank",
    "waiting_by_rank",
    "reported_at_ms",
)


# Further fields of a `cap:<worker>` hash, read only by worker_reports (an operator's
# view); "" stands for a value the worker did not report.
_WORKER_DETAIL_FIELDS = tuple(WORKER_DETAIL_TYPES)


def _optional(value: float | None) -> str:
    return "" if value is None else repr(value)


def _rank_json(by_rank: Mapping[int, int] | None) -> str:
    return json.dumps({str(int(r)): int(n) for r, n in (by_rank or {}).items()})


def _rank_map(raw: str | None) -> dict[int, int]:
    # A report from a worker that predates the backlog fields has none: no backlog.
    return {int(r): int(n) for r, n in json.loads(raw).items()} if raw else {}


class RedisBackend:
    """The queue in Redis, shared by every process; see QueueBackend."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        keys: KeySpace | None = None,
        config: PolicyConfig | None = None,
        clock_ms: Callable[[], int] = wall_clock_ms,
        finished_ttl_ms: int = 3_600_000,
        result_ttl_ms: int = 3_600_000,
        max_reclaim: int = 256,
        channel: ScriptChannel | None = None,
        gateway_grace_ms: int = GATEWAY_GRACE_MS,
        bill_grace_ms: int = BILL_GRACE_MS,
    ) -> None:
        """Script calls go over `channel` when given (its owner closes it), else through
        redis-py. With a channel, result streams are followed by one reader for the whole
        process (stream_reader.py) instead of a blocking read per stream."""
        if not client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("RedisBackend needs a client created with decode_responses=True")
        self._redis = client
        self._channel = channel
        self._reader = None if channel is None else StreamReader(channel, is_last=_is_last_entry)
        self._keys = keys or KeySpace()
        self._config = config or PolicyConfig()
        self._clock_ms = clock_ms
        self._finished_ttl_ms = finished_ttl_ms
        self._result_ttl_ms = result_ttl_ms
        self._max_reclaim = max_reclaim
        self._gateway_grace_ms = gateway_grace_ms
        self._bill_grace_ms = bill_grace_ms
        # The policy knobs as the dispatch script reads them, formatted once.
        c = self._config
        self._policy_args = (
            repr(float(c.input_token_weight)),
            repr(float(c.output_token_weight)),
            c.share_bucket_ms,
            c.share_buckets,
            c.deadline_margin_ms,
            c.max_expired_per_dispatch,
        )
        self._scripts = {
            name: client.register_script(load_script_source(name)) for name in _SCRIPTS
        }

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisBackend:
        return cls(aioredis.Redis.from_url(url, decode_responses=True), **kwargs)

    @property
    def keys(self) -> KeySpace:
        return self._keys

    async def _run(self, script: str, *args: object) -> Any:
        with unavailable_as_error():
            return await run_script(
                self._scripts[script], self._channel, [self._keys.prefix, *args]
            )

    # -- tiers -------------------------------------------------------------------------

    async def configure_tiers(self, tiers: Sequence[TierConfig]) -> None:
        policy.validate_tiers(tiers)
        k = self._keys
        with unavailable_as_error():
            # A tier no longer configured and with nothing queued is forgotten, as in
            # MemoryBackend._configure (its keys would otherwise stay forever). Every
            # tier that ever dispatched has a `floor` field, by which one removed while
            # its jobs were queued or running is found again: the charges of those still
            # running make its counters anew, which the next call deletes, and the field
            # goes once a call finds nothing of the tier left.
            configured = {t.name for t in tiers}
            depth = await self._redis.hgetall(k.depth)
            known = {*await self._redis.hkeys(k.tiers), *await self._redis.hkeys(k.floor)}
            gone = sorted(n for n in known - configured if int(depth.get(n, 0)) == 0)
            state = [
                (k.counters(n), k.share(n), k.queued_prefill(n), k.queued_decode(n)) for n in gone
            ]
            async with self._redis.pipeline(transaction=False) as pipe:
                for names in state:
                    pipe.exists(*names)
                left = await pipe.execute()
            async with self._redis.pipeline(transaction=True) as pipe:
                for name, names, num_left in zip(gone, state, left, strict=True):
                    if num_left:
                        pipe.delete(*names)
                    else:
                        pipe.hdel(k.floor, name)
                pipe.delete(self._keys.tiers, self._keys.tier_policy)
                if tiers:
                    pipe.hset(
                        self._keys.tiers, mapping={t.name: json.dumps(asdict(t)) for t in tiers}
                    )
                    pipe.hset(self._keys.tier_policy, mapping=_tier_policy_fields(tiers))
                await pipe.execute()

    async def get_tiers(self) -> list[TierConfig]:
        with unavailable_as_error():
            raw = await self._redis.hgetall(self._keys.tiers)
        return policy.tier_order([TierConfig(**json.loads(v)) for v in raw.values()])

    # -- queue -------------------------------------------------------------------------

    async def enqueue(
        self, job: Job, *, slo: SloBudget | None = None, gateway_id: str | None = None
    ) -> float | None:
        budget = "" if slo is None else _budget_arg(slo)
        outcome = await self._run(
            "enqueue", self._clock_ms(), budget, gateway_id or "", *_enqueue_fields(job)
        )
        verdict, _, predicted = outcome.partition(":")
        if verdict == "ok":
            return float(predicted) if predicted else None
        refusal = (
            slo.refusal(job.tier, float(predicted), job.num_prompt_tokens)
            if slo and verdict == "slo"
            else None
        )
        if refusal is not None:
            raise refusal
        if verdict == "unknown_tier":
            raise UnknownTierError(job.tier)
        if verdict == "duplicate":
            raise DuplicateJobError(job.job_id)
        if verdict == "queue_full":
            tiers = {t.name: t for t in await self.get_tiers()}
            cap = tiers[job.tier].max_queued_jobs if job.tier in tiers else 0
            raise QueueFullError(job.tier, cap or 0)
        raise AssertionError(f"enqueue.lua answered {outcome!r}")

    async def enqueue_many(
        self, jobs: Sequence[Job], *, gateway_id: str | None = None
    ) -> list[str]:
        """Enqueue in one round trip, in order; returns each job's outcome ('ok',
        'unknown_tier', 'duplicate' or 'queue_full') instead of raising.

        Each job's outcome is that of enqueueing it alone. Jobs travel MAX_JOBS_PER_CALL
        to a script call, so one call never holds Redis for long.
        """
        now_ms = self._clock_ms()
        calls = []
        for i in range(0, len(jobs), MAX_JOBS_PER_CALL):
            args: list[object] = [self._keys.prefix, now_ms, "", gateway_id or ""]  # no SLO
            for job in jobs[i : i + MAX_JOBS_PER_CALL]:
                args.extend(_enqueue_fields(job))
            calls.append(args)
        replies = await self._run_all("enqueue", calls)
        return [outcome for reply in replies for outcome in reply.split(" ")]

    async def _run_all(self, script: str, calls: list[list[object]]) -> list[Any]:
        """The replies of several calls of one script, run in order in one round trip:
        issued together over the script channel (which writes them at once), else as a
        redis-py pipeline."""
        with unavailable_as_error():
            if self._channel is not None:
                return await asyncio.gather(
                    *(run_script(self._scripts[script], self._channel, args) for args in calls)
                )
            async with self._redis.pipeline(transaction=False) as pipe:
                for args in calls:
                    await self._scripts[script](keys=[], args=args, client=pipe)
                return await pipe.execute()

    async def dispatch(self, worker_id: str, lease_ms: int) -> Job | None:
        leased = await self._run("dispatch", *self._dispatch_args(worker_id, lease_ms, 1))
        return _leased_job(leased[0]) if leased else None

    async def dispatch_many(self, worker_id: str, lease_ms: int, num_jobs: int) -> list[Job]:
        """Script calls of at most MAX_JOBS_PER_CALL jobs each: one call for any lease of
        a worker with less room than that. More go in one round trip over the script
        channel; without one, in turn, the next only after one that leased all it asked
        (a redis-py pipeline of scripts asks SCRIPT EXISTS first, a round trip itself)."""
        if self._channel is not None and num_jobs > MAX_JOBS_PER_CALL:
            sizes = [
                min(MAX_JOBS_PER_CALL, num_jobs - i) for i in range(0, num_jobs, MAX_JOBS_PER_CALL)
            ]
            calls = [
                [self._keys.prefix, *self._dispatch_args(worker_id, lease_ms, n)] for n in sizes
            ]
            replies = await self._run_all("dispatch", calls)
            return [_leased_job(leased) for reply in replies for leased in reply]
        jobs: list[Job] = []
        while len(jobs) < num_jobs:
            asked = min(MAX_JOBS_PER_CALL, num_jobs - len(jobs))
            leased = await self._run("dispatch", *self._dispatch_args(worker_id, lease_ms, asked))
            jobs.extend(_leased_job(one) for one in leased)
            if len(leased) < asked:
                break
        return jobs

    def _dispatch_args(self, worker_id: str, lease_ms: int, num_jobs: int) -> list[object]:
        """dispatch.lua's arguments after the prefix."""
        return [
            self._clock_ms(),
            worker_id,
            lease_ms,
            *self._policy_args,
            self._finished_ttl_ms,
            self._result_ttl_ms,
            num_jobs,
            self._gateway_grace_ms,
        ]

    async def charge(self, job_id: str, *, input_tokens: int = 0, output_tokens: int = 0) -> bool:
        c = self._config
        return bool(
            await self._run(
                "charge",
                self._clock_ms(),
                job_id,
                int(input_tokens),
                int(output_tokens),
                repr(float(c.input_token_weight)),
                repr(float(c.output_token_weight)),
                c.share_bucket_ms,
            )
        )

    async def set_tenant_weight(self, tenant_id: str, weight: float) -> bool:
        policy.validate_weight(weight)
        return bool(await self._run("set_tenant_weight", tenant_id, repr(float(weight))))

    async def tenant_weight(self, tenant_id: str) -> float | None:
        with unavailable_as_error():
            raw = await self._redis.hget(self._keys.weights, tenant_id)
        return None if raw is None else float(raw)

    async def renew(self, worker_id: str, job_id: str, lease_ms: int) -> bool:
        return bool(
            await self._run(
                "renew",
                self._clock_ms(),
                worker_id,
                job_id,
                lease_ms,
                self._gateway_grace_ms,
                self._result_ttl_ms,
                self._finished_ttl_ms,
            )
        )

    async def requeue(self, job_id: str, *, worker_id: str | None = None) -> bool:
        return bool(await self._run("requeue", self._clock_ms(), job_id, worker_id or ""))

    async def reclaim_expired_leases(self, now_ms: int | None = None) -> list[str]:
        now_ms = self._clock_ms() if now_ms is None else now_ms
        return list(
            await self._run(
                "reclaim",
                now_ms,
                self._max_reclaim,
                self._gateway_grace_ms,
                self._result_ttl_ms,
                self._finished_ttl_ms,
            )
        )

    async def publish_gateway(self, gateway_id: str, ttl_ms: int) -> None:
        # A key that expires by Redis's own clock: a gateway's clock, however far off the
        # workers', never decides whether it looks alive.
        with unavailable_as_error():
            await self._redis.set(self._keys.gateway(gateway_id), "up", px=max(1, int(ttl_ms)))

    async def settle(self, gateway_id: str, job_ids: Sequence[str]) -> None:
        if job_ids:
            with unavailable_as_error():
                await self._redis.srem(self._keys.unbilled(gateway_id), *job_ids)

    async def claim_unbilled(self, gateway_id: str, limit: int = 100) -> list[UnbilledJob]:
        flat = await self._run(
            "claim_unbilled", self._clock_ms(), gateway_id, self._bill_grace_ms, int(limit)
        )
        claimed = [flat[i : i + 5] for i in range(0, len(flat), 5)]
        if not claimed:
            return []
        # What each served is what its result stream holds, as its client would have read
        # it. Claimed, a job is this process's to bill: should Redis stop between the
        # claim and this read, it goes unbilled.
        with unavailable_as_error():
            async with self._redis.pipeline(transaction=False) as pipe:
                for job_id, *_ in claimed:
                    pipe.xrange(self._keys.results(job_id))
                streams = await pipe.execute()
        return [
            _unbilled(job_id, tenant, tier, JobStatus(status), int(prompt), entries)
            for (job_id, tenant, tier, status, prompt), entries in zip(
                claimed, streams, strict=True
            )
        ]

    async def claimed_elsewhere(self, job_ids: Sequence[str]) -> set[str]:
        with unavailable_as_error():
            async with self._redis.pipeline(transaction=False) as pipe:
                for job_id in job_ids:
                    pipe.hexists(self._keys.job(job_id), "bl")
                marks = await pipe.execute()
        return {job_id for job_id, marked in zip(job_ids, marks, strict=True) if marked}

    async def cancel(self, job_id: str) -> bool:
        return bool(await self._run("cancel", self._clock_ms(), job_id, self._finished_ttl_ms))

    async def job_status(self, job_id: str) -> JobStatus | None:
        with unavailable_as_error():
            status = await self._redis.hget(self._keys.job(job_id), "st")
        return None if status is None else JobStatus(status)

    async def job_progress(self, job_ids: Sequence[str]) -> list[JobProgress]:
        """Each job's tokens as the publishing scripts counted them (its hash's `nt`;
        a stream entry may hold several steps' tokens), without reading the stream, and
        where its current run began (`rf`, `rb`: publish_step.lua)."""
        k = self._keys
        with unavailable_as_error():
            async with self._redis.pipeline(transaction=False) as pipe:
                for job_id in job_ids:
                    pipe.hmget(k.job(job_id), "st", "dec", "gw", "nt", "rf", "rb")
                    pipe.xlen(k.results(job_id))
                    pipe.xrange(k.results(job_id), count=1)
                    pipe.xrevrange(k.results(job_id), count=1)
                replies = await pipe.execute()
            gateways = sorted({r[2] for r in replies[::4] if r[0] is not None and r[2]})
            presences = await self._redis.mget([k.gateway(g) for g in gateways]) if gateways else []
        gone = {g for g, presence in zip(gateways, presences, strict=True) if presence != "up"}
        out = []
        for i, job_id in enumerate(job_ids):
            (
                (status, max_tokens, gateway, num_tokens, run_ms, run_base),
                num_entries,
                first,
                last,
            ) = replies[4 * i : 4 * i + 4]
            if status is None:
                continue
            # A worker of the release before keeps no count: its entries, less the done
            # or error event (a cancel writes none), hold at least a token each. During
            # a rolling upgrade one job can be streamed by both (an old worker's, resumed
            # by a new one): `nt` then misses the old worker's tokens, and the larger of
            # the two is the nearer (Retry-After came out 15-18x the wait).
            ended = status not in (JobStatus.QUEUED, JobStatus.LEASED)
            num_tokens = max(int(num_tokens or 0), int(num_entries) - ended)
            first_ms = int(first[0][0].split("-")[0]) if first else None
            # A job resumed by a worker of the release before marks no run: its pace
            # is counted from its first token, as that release counted it.
            resumed = run_ms is not None and run_base is not None
            out.append(
                JobProgress(
                    job_id,
                    JobStatus(status),
                    max_tokens=int(max_tokens or 0),
                    num_tokens=num_tokens,
                    first_token_ms=first_ms,
                    last_token_ms=int(last[0][0].split("-")[0]) if last else None,
                    run_first_token_ms=int(run_ms) if resumed else first_ms,
                    run_num_tokens=num_tokens - int(run_base) if resumed else num_tokens,
                    is_orphaned=gateway in gone,
                )
            )
        return out

    # -- stats and admission inputs ----------------------------------------------------

    async def depth(self) -> dict[str, TierDepth]:
        k = self._keys
        with unavailable_as_error():
            depth = await self._redis.hgetall(k.depth)
            out = {}
            for tier, num_jobs in depth.items():
                tenants = await self._redis.zrange(k.active(tier), 0, -1)
                async with self._redis.pipeline(transaction=False) as pipe:
                    for tenant in tenants:
                        pipe.zcard(k.tenant_queue(tier, tenant))
                        pipe.hget(k.queued_prefill(tier), tenant)
                        pipe.hget(k.queued_decode(tier), tenant)
                    values = await pipe.execute()
                out[tier] = TierDepth(
                    int(num_jobs),
                    {
                        tenant: TenantDepth(
                            int(values[3 * i]),
                            int(values[3 * i + 1] or 0),
                            int(values[3 * i + 2] or 0),
                        )
                        for i, tenant in enumerate(tenants)
                    },
                )
        return out

    async def totals(self) -> QueueTotals:
        with unavailable_as_error():
            raw = await self._redis.hgetall(self._keys.totals)
        # Only the counts this version knows (a newer worker may count more).
        known = {f.name for f in dataclasses.fields(QueueTotals)}
        return QueueTotals(**{name: int(value) for name, value in raw.items() if name in known})

    async def counters(self, tier: str) -> dict[str, float]:
        with unavailable_as_error():
            raw = await self._redis.hgetall(self._keys.counters(tier))
        return {tenant: float(value) for tenant, value in raw.items()}

    async def work_ahead(
        self, tier: str, tenant_id: str, weight: float, num_prompt_tokens: int = 0
    ) -> WorkAhead:
        prefill, decode, num_jobs = await self._run(
            "work_ahead", tier, tenant_id, repr(float(weight)), int(num_prompt_tokens)
        )
        return WorkAhead(float(prefill), float(decode), int(num_jobs))

    async def publish_capacity(
        self,
        worker_id: str,
        *,
        prefill_tokens_per_s: float,
        decode_tokens_per_s: float,
        ttl_ms: int,
        unprefilled_tokens_by_rank: Mapping[int, int] | None = None,
        decode_tokens_by_rank: Mapping[int, int] | None = None,
        num_free_seqs: int = 0,
        release_ms: Sequence[float] | None = None,
        preemptible_by_rank: Mapping[int, int] | None = None,
        waiting_by_rank: Mapping[int, int] | None = None,
        **details: float | None,
    ) -> None:
        k = self._keys
        now_ms = self._clock_ms()
        shown = worker_details(**details)
        with unavailable_as_error():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(
                    k.capacity(worker_id),
                    mapping={
                        "prefill_tokens_per_s": repr(float(prefill_tokens_per_s)),
                        "decode_tokens_per_s": repr(float(decode_tokens_per_s)),
                        # Whole per-rank maps as JSON: read back only by fleet_capacity.
                        "unprefilled_tokens_by_rank": _rank_json(unprefilled_tokens_by_rank),
                        "decode_tokens_by_rank": _rank_json(decode_tokens_by_rank),
                        "num_free_seqs": max(0, int(num_free_seqs)),
                        "release_ms": _releases_json(release_ms),
                        "preemptible_by_rank": _rank_json(preemptible_by_rank),
                        "waiting_by_rank": _rank_json(waiting_by_rank),
                        "reported_at_ms": now_ms,
                        **{name: _optional(value) for name, value in shown.items()},
                    },
                )
                # The jobs seated since the last report are in this one's work (see
                # keys.py, `seated:<worker>`); `rs` numbers the reports.
                pipe.delete(k.seated(worker_id))
                pipe.hincrby(k.capacity(worker_id), "rs", 1)
                pipe.pexpire(k.capacity(worker_id), ttl_ms)
                pipe.zadd(k.workers, {worker_id: now_ms + ttl_ms})
                await pipe.execute()

    async def fleet_capacity(self) -> FleetCapacity:
        k = self._keys
        now_ms = self._clock_ms()
        with unavailable_as_error():
            await self._redis.zremrangebyscore(k.workers, "-inf", now_ms)
            workers = await self._redis.zrange(k.workers, 0, -1)
            async with self._redis.pipeline(transaction=False) as pipe:
                for worker_id in workers:
                    pipe.hmget(k.capacity(worker_id), *_CAPACITY_FIELDS)
                rows = [r for r in await pipe.execute() if r[0] is not None]
        reports = [_CapacityRow.parse(row, now_ms) for row in rows]
        unprefilled: dict[int, int] = {}
        decode: dict[int, int] = {}
        waiting: dict[int, int] = {}
        for report in reports:
            add_by_rank(unprefilled, report.unprefilled_tokens_by_rank)
            add_by_rank(decode, report.decode_tokens_by_rank)
            add_by_rank(waiting, report.waiting_by_rank)
        releases = None
        # Releases only if every worker reported its own (an older one does not).
        if all(report.release_ms is not None for report in reports):
            releases = merge_releases(report.aged_releases() for report in reports)
        return FleetCapacity(
            len(reports),
            sum(report.prefill_tokens_per_s for report in reports),
            sum(report.decode_tokens_per_s for report in reports),
            unprefilled,
            decode,
            # An older worker's report has no free slots: its decodes always count.
            sum(report.num_free_seqs for report in reports),
            releases,
            tuple((r.preemptible_by_rank, best_rank_waiting(r.waiting_by_rank)) for r in reports),
            waiting,
        )

    async def worker_reports(self) -> list[WorkerReport]:
        k = self._keys
        now_ms = self._clock_ms()
        with unavailable_as_error():
            # Live as fleet_capacity counts them: a report lapses at its score.
            workers = sorted(await self._redis.zrangebyscore(k.workers, f"({now_ms}", "+inf"))
            async with self._redis.pipeline(transaction=False) as pipe:
                for worker_id in workers:
                    pipe.hmget(k.capacity(worker_id), *_CAPACITY_FIELDS, *_WORKER_DETAIL_FIELDS)
                rows = await pipe.execute()
        reports = []
        num_fields = len(_CAPACITY_FIELDS)
        for worker_id, row in zip(workers, rows, strict=True):
            if row[0] is None:  # the hash expired between the two reads
                continue
            report = _CapacityRow.parse(row[:num_fields], now_ms)
            # A field a worker did not report (or an older worker) reads back empty.
            said = {
                name: value or None
                for name, value in zip(WORKER_DETAIL_TYPES, row[num_fields:], strict=True)
            }
            reports.append(
                WorkerReport(
                    worker_id,
                    report.age_ms,
                    report.prefill_tokens_per_s,
                    report.decode_tokens_per_s,
                    unprefilled_tokens_by_rank=report.unprefilled_tokens_by_rank,
                    decode_tokens_by_rank=report.decode_tokens_by_rank,
                    num_free_seqs=report.num_free_seqs,
                    release_ms=report.release_ms or (),
                    num_preemptible_seqs=sum(report.preemptible_by_rank.values()),
                    **worker_details(**said),
                )
            )
        return reports

    # -- results -----------------------------------------------------------------------

    async def _publish(
        self,
        job_id: str,
        worker_id: str | None,
        kind: EventKind,
        *,
        token_ids: Sequence[int] = (),
        text: str = "",
        finish_reason: str = "",
        code: str = "",
        message: str = "",
    ) -> bool:
        sid = await self._run(
            "publish",
            self._clock_ms(),
            job_id,
            worker_id or "",
            kind.value,
            _csv(token_ids),
            text,
            finish_reason,
            code,
            message,
            self._result_ttl_ms,
            self._finished_ttl_ms,
        )
        return bool(sid)

    async def publish_tokens(
        self, job_id: str, worker_id: str, token_ids: Sequence[int], text: str = ""
    ) -> bool:
        return await self._publish(
            job_id, worker_id, EventKind.TOKENS, token_ids=token_ids, text=text
        )

    async def complete(
        self, job_id: str, *, worker_id: str | None = None, finish_reason: str = "stop"
    ) -> bool:
        return await self._publish(job_id, worker_id, EventKind.DONE, finish_reason=finish_reason)

    async def fail(
        self, job_id: str, *, code: str, message: str, worker_id: str | None = None
    ) -> bool:
        return await self._publish(job_id, worker_id, EventKind.ERROR, code=code, message=message)

    async def publish_step(
        self,
        job_id: str,
        worker_id: str,
        token_ids: Sequence[int],
        text: str = "",
        *,
        finish_reason: str = "",
        queue_wait_ms: float | None = None,
        logprobs: str = "",
    ) -> bool:
        """QueueBackend.publish_step in one round trip (publish_step.lua)."""
        c = self._config
        published = await self._run(
            "publish_step",
            self._clock_ms(),
            job_id,
            worker_id,
            _csv(token_ids),
            text,
            len(token_ids),
            repr(float(c.input_token_weight)),
            repr(float(c.output_token_weight)),
            c.share_bucket_ms,
            finish_reason,
            self._result_ttl_ms,
            self._finished_ttl_ms,
            _optional(queue_wait_ms),
            logprobs,
        )
        return bool(published)

    async def results(
        self, job_id: str, after: str = START_CURSOR, *, poll_ms: int = 1000
    ) -> AsyncIterator[ResultEvent]:
        key = self._keys.results(job_id)
        reader = self._reader
        if reader is not None and reader.accepts(key):
            entries = reader.follow(key, after)
            try:
                while True:
                    with unavailable_as_error():
                        entry = await anext(entries, None)
                    if entry is None:
                        return
                    yield _event(*entry)
            finally:
                await entries.aclose()
        # No shared reader, or one that cannot take this stream: a read of its own.
        cursor = after
        while True:
            with unavailable_as_error():
                reply = await self._redis.xread({key: cursor}, count=256, block=poll_ms)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    cursor = entry_id
                    event = _event(entry_id, fields)
                    yield event
                    if event.is_terminal:
                        return

    async def aclose(self) -> None:
        if self._reader is not None:
            await self._reader.aclose()
        await self._redis.aclose()


def _tier_policy_fields(tiers: Sequence[TierConfig]) -> dict[str, str | int]:
    """The tier table as the scripts read it (scheduler/keys.py, `tier_policy`)."""
    fields: dict[str, str | int] = {}
    for t in tiers:
        fields[f"rank:{t.name}"] = t.rank
        fields[f"min_share:{t.name}"] = repr(float(t.min_share))
        if t.max_queued_jobs is not None:
            fields[f"max_queued:{t.name}"] = t.max_queued_jobs
    return fields


@dataclass(frozen=True)
class _CapacityRow:
    """One `cap:<worker>` hash as read back (_CAPACITY_FIELDS, in order)."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    unprefilled_tokens_by_rank: dict[int, int]
    decode_tokens_by_rank: dict[int, int]
    num_free_seqs: int
    release_ms: tuple[float, ...] | None  # None: not reported (an older worker)
    preemptible_by_rank: dict[int, int]
    waiting_by_rank: dict[int, int]
    age_ms: int  # since the report, by the queue's clock (0: unknown, an older worker)

    @classmethod
    def parse(cls, row: Sequence[str | None], now_ms: int) -> _CapacityRow:
        prefill, decode, unprefilled, held, free, releases, preemptible, waiting, at_ms = row
        return cls(
            float(prefill or 0.0),
            float(decode or 0.0),
            _rank_map(unprefilled),
            _rank_map(held),
            int(free or 0),
            _releases(releases),
            _rank_map(preemptible),
            _rank_map(waiting),
            max(0, now_ms - int(at_ms)) if at_ms else 0,
        )

    def aged_releases(self) -> list[float]:
        """The releases as near as they are now: the report has aged since."""
        return [max(0.0, ms - self.age_ms) for ms in self.release_ms or ()]


def _releases_json(release_ms: Sequence[float] | None) -> str:
    """A report's releases as JSON: null when the worker has none to report."""
    return json.dumps(None if release_ms is None else [float(ms) for ms in release_ms])


def _releases(stored: str | None) -> tuple[float, ...] | None:
    """_releases_json read back; None too from an older worker, which has no field."""
    found = None if stored is None else json.loads(stored)
    return None if found is None else tuple(float(ms) for ms in found)


def _budget_arg(slo: SloBudget) -> str:
    """enqueue.lua's SLO budget argument: the fields, space-separated, exactly."""
    return " ".join(
        repr(float(x))
        for x in (
            slo.ttft_slo_ms,
            slo.prefill_tokens_per_s,
            slo.decode_tokens_per_s,
            slo.held_prefill_tokens,
            slo.held_decode_tokens,
            slo.decode_ahead_fraction,
            slo.num_free_seqs,
            slo.num_preemptible_seqs,
            slo.num_waiting_seqs,
            # Whether the releases follow (an empty list is still a fleet's answer).
            0 if slo.release_ms is None else 1,
            *(slo.release_ms or ()),
        )
    )


def _enqueue_fields(job: Job) -> tuple[str, str, str]:
    """One job's arguments to enqueue.lua: id, JSON, and the queue's fields in one string."""
    deadline = policy.deadline_ms(job)
    expire = policy.expire_at_ms(job)
    fields = (
        f"{job.tier}\t{float(job.weight)!r}\t{job.num_prompt_tokens}\t{job.params.max_tokens}"
        f"\t{'' if deadline is None else deadline}\t{'' if expire is None else expire}"
        f"\t{'' if job.bill_prompt_tokens is None else job.bill_prompt_tokens}"
        f"\t{job.tenant_id}"
    )
    return job.job_id, job.to_json(), fields


def _leased_job(reply: str) -> Job:
    """One job of dispatch.lua's reply: "<rank>|<resumed token csv>|<job JSON>"."""
    rank_text, resumed_csv, raw = reply.split("|", 2)
    job = Job.from_json(raw)
    rank, resumed = int(rank_text), _tokens(resumed_csv)
    if job.rank != rank or job.resumed_token_ids != resumed:
        job = replace(job, rank=rank, resumed_token_ids=resumed)
    return job


def _is_last_entry(fields: dict[str, str]) -> bool:
    return fields["k"] != EventKind.TOKENS


def _event(entry_id: str, fields: dict[str, str]) -> ResultEvent:
    return ResultEvent(
        EventKind(fields["k"]),
        cursor=entry_id,
        token_ids=_tokens(fields.get("t")),
        text=fields.get("x", ""),
        finish_reason=fields.get("f", ""),
        code=fields.get("c", ""),
        message=fields.get("m", ""),
        queue_wait_ms=float(fields["q"]) if "q" in fields else None,
        logprobs=fields.get("l", ""),
    )


def _unbilled(
    job_id: str,
    tenant_id: str,
    tier: str,
    status: JobStatus,
    prompt_tokens: int,
    entries: list[tuple[str, dict[str, str]]],
) -> UnbilledJob:
    """A claimed job as its result stream shows it served (entry ids are Redis's ms)."""
    events = [(int(entry_id.split("-")[0]), _event(entry_id, f)) for entry_id, f in entries]
    first_ms = next((ms for ms, e in events if e.token_ids), None)
    waited = next(((ms, e.queue_wait_ms) for ms, e in events if e.queue_wait_ms is not None), None)
    return UnbilledJob(
        job_id=job_id,
        tenant_id=tenant_id,
        tier=tier,
        status=status,
        prompt_tokens=prompt_tokens,
        output_tokens=sum(len(e.token_ids) for _, e in events),
        queue_wait_ms=None if waited is None else waited[1],
        arrival_ms=None if waited is None else waited[0] - round(waited[1]),
        first_token_ms=first_ms,
        ended_ms=events[-1][0] if events else None,
    )
