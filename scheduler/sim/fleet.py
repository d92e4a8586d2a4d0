"""The discrete-event loop: arrivals, admission, the shared queue, N engines, one clock.

Events are arrivals (drawn lazily from the workload), step ends (one heap entry per busy
engine) and periodic samples of who is backlogged. Between events nothing happens, so
the clock jumps. An engine that ends a step pulls the queued jobs its step scheduler's
`newcomer_room()` has room for, then more while it `can_accept()` (as a worker's
dispatcher does), then plans its next step; an idle engine is woken by an arrival.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.request import Request, SamplingParams
from scheduler.backend import QueueFullError
from scheduler.job import Job
from scheduler.policy import TierConfig
from scheduler.sim.admission import INVALID_REQUEST, QUEUE_FULL, QUEUE_TIMEOUT
from scheduler.sim.baselines import FcfsQueue, FleetQueue, PriorityQueue, VtcQueue
from scheduler.sim.cost_model import DEFAULT_MAX_MODEL_LEN, RooflineParams
from scheduler.sim.engine import EngineMode, SimEngine
from scheduler.sim.metrics import (
    Collector,
    RequestRecord,
    RunStats,
    ServiceTrace,
    fairness_stats,
)
from scheduler.sim.rate_limits import SimRateLimits
from scheduler.sim.tiered import TieredQueue
from scheduler.sim.workload import SimRequest, TierSpec, WorkloadSpec, iter_requests

POLICIES = ("fcfs", "priority", "vtc", "tiered")
# What the queue's fair share counts (PolicyConfig's token weights), for the trace.
INPUT_TOKEN_WEIGHT = 1.0
OUTPUT_TOKEN_WEIGHT = 2.0
# What a worker reports before it has measured anything (the dispatcher's defaults).
DEFAULT_PREFILL_TOKENS_PER_S = 2_000.0
DEFAULT_DECODE_TOKENS_PER_S = 200.0


class SimulationError(ValueError):
    """A simulation that cannot run as asked (unknown policy, no engines...)."""


@dataclass(frozen=True)
class PolicySpec:
    """A queue policy plus how it uses the engine and whether the gateway admits."""

    name: str
    mode: EngineMode
    uses_admission: bool


def policy_spec(name: str) -> PolicySpec:
    if name == "fcfs":
        return PolicySpec(name, EngineMode(False, False, slo_budget=False), False)
    if name == "priority":
        # vLLM's priority mode: rank order everywhere, preemption only for KV.
        return PolicySpec(name, EngineMode(True, False, slo_budget=False), False)
    if name == "vtc":
        return PolicySpec(name, EngineMode(False, False, slo_budget=False), False)
    if name == "tiered":
        return PolicySpec(name, EngineMode(True, True, slo_budget=True), True)
    raise SimulationError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")


def tier_configs(tiers: Sequence[TierSpec]) -> list[TierConfig]:
    return [
        TierConfig(
            t.name,
            t.rank,
            min_share=t.min_share,
            ttft_slo_ms=t.ttft_slo_ms,
            max_queued_jobs=t.max_queued_jobs,
        )
        for t in tiers
    ]


def make_queue(name: str, tiers: Sequence[TierSpec], clock: list[float]) -> FleetQueue:
    if name == "fcfs":
        return FcfsQueue()
    if name == "priority":
        return PriorityQueue()
    if name == "vtc":
        return VtcQueue()
    if name == "tiered":
        return TieredQueue(tier_configs(tiers), clock)
    raise SimulationError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")


@dataclass(frozen=True)
class FleetSpec:
    params: RooflineParams
    num_engines: int = 1
    max_model_len: int = DEFAULT_MAX_MODEL_LEN

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise SimulationError("a fleet needs at least one engine")


@dataclass(frozen=True)
class SimOptions:
    """drain_s: how long engines keep running after the last arrival. The fairness
    window defaults to the middle of the arrival period (after a warm-up)."""

    drain_s: float = 120.0
    sample_interval_s: float = 1.0
    fairness_window_s: tuple[float, float] | None = None
    keep_records: bool = False
    # Output tokens of the charges a worker batches before telling the queue (the real
    # worker charges as it publishes; batching bounds the cost of simulating that).
    charge_interval_s: float = 0.0
    # Jump over stretches of pure decode steps instead of scheduling each one (see
    # SimEngine.plan_decode_run). Engine behaviour is unchanged; tokens are charged to
    # the queue at the end of a stretch, and when several engines could take a job the
    # first to reach a step boundary does, as step by step.
    fast_forward: bool = False
    # The tenants' rate limits (rpm, tpm, concurrency) at the gateway, for every policy:
    # limits are gateway admission, in front of whichever queue policy runs.
    rate_limits: bool = True


@dataclass
class SimResult:
    policy: str
    stats: RunStats
    collector: Collector
    trace: ServiceTrace
    engines: list[SimEngine] = field(repr=False, default_factory=list)


@dataclass(eq=False)
class _DecodeRun:
    start_s: float
    offsets: list[float]
    num_steps: int
    # Whether the engine would pull a job: its state is frozen for the run (nothing is
    # waiting, blocks are taken when the run is applied), so it is asked once.
    accepts: bool | None = None

    @property
    def is_single_step(self) -> bool:
        """A run of one step stands for one ordinary step, which is never cut (the
        engine pulls at its end anyway); cutting it would change which engine's run a
        queued job cuts."""
        return len(self.offsets) == 1


@dataclass(eq=False)
class _InFlight:
    """A request inside an engine. Its generated tokens are counted from the engine
    request's output_token_ids when they are needed (a charge, a sample, its end), not
    per step: a loaded fleet generates a token per running request every few ms."""

    record: RequestRecord
    job: Job
    request: Request
    num_charged: int = 0  # output tokens charged to the queue
    num_served: int = 0  # output tokens counted in the fleet's served totals


_PROMPTS: dict[int, tuple[int, ...]] = {}


def _job(req: SimRequest) -> Job:
    prompt = _PROMPTS.get(req.num_prompt_tokens)
    if prompt is None:
        prompt = _PROMPTS[req.num_prompt_tokens] = (1,) * req.num_prompt_tokens
    return Job(
        job_id=req.request_id,
        tenant_id=req.tenant_id,
        tier=req.tier,
        rank=req.rank,
        weight=req.weight,
        prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=req.asked_tokens, ignore_eos=req.max_tokens is None),
        arrival_s=req.arrival_s,
        ttft_slo_ms=req.ttft_slo_ms,
        tpot_slo_ms=req.tpot_slo_ms,
        max_queue_ms=req.max_queue_ms,
        deadline_s=req.deadline_s,
        preemptible=req.preemptible,
    )


class _Fleet:
    """The state of one simulation and one method per kind of event."""

    def __init__(
        self, workload: WorkloadSpec, policy: str, fleet: FleetSpec, options: SimOptions
    ) -> None:
        self.workload = workload
        self.options = options
        self.spec = policy_spec(policy)
        self.clock = [0.0]  # one shared cell: engines and the queue read it
        self.queue = make_queue(policy, workload.tiers, self.clock)
        self.engines = [
            SimEngine(
                f"engine-{i}",
                fleet.params,
                self.spec.mode,
                self.clock,
                max_model_len=fleet.max_model_len,
                # Charging step by step needs each step's tokens per request.
                report_outputs=options.charge_interval_s <= 0,
            )
            for i in range(fleet.num_engines)
        ]
        self.collector = Collector(keep_records=options.keep_records)
        limits = SimRateLimits(workload, self.clock) if options.rate_limits else None
        self.limits = limits if limits is not None and limits.is_active else None
        self.trace = ServiceTrace()
        self.served: dict[str, float] = {}  # fair-share tokens served per tenant
        self.queued: dict[str, RequestRecord] = {}
        self.inflight: dict[str, _InFlight] = {}
        # (end time, version, engine index); an entry whose version is not the engine's
        # current one was superseded (a decode run cut short) and is skipped.
        self.steps: list[tuple[float, int, int]] = []
        self.versions = [0] * len(self.engines)
        self.runs: dict[int, _DecodeRun] = {}  # engines inside a fast-forwarded decode run
        self.cut: set[int] = set()  # runs already cut short to take a queued job
        self.idle = list(range(len(self.engines) - 1, -1, -1))  # a stack; engine 0 first
        self.window_tokens = 0  # generated while requests still arrive (throughput)
        # Capacity reports outlive a few sample intervals, as a worker's outlive heartbeats.
        self.capacity_ttl_ms = int(3 * options.sample_interval_s * 1000)

    # -- the loop ------------------------------------------------------------------------

    def run(
        self, arrivals: Iterator[SimRequest], on_progress: Callable[[float], None] | None
    ) -> None:
        options = self.options
        end_s = self.workload.duration_s + options.drain_s
        next_sample_s = 0.0
        next_flush_s = options.charge_interval_s if options.charge_interval_s > 0 else math.inf
        upcoming = next(arrivals, None)
        steps = self.steps
        while True:
            t_arrival = upcoming.arrival_s if upcoming is not None else math.inf
            t_step = steps[0][0] if steps else math.inf
            now_s = min(t_arrival, t_step, next_sample_s, next_flush_s)
            if now_s > end_s or (upcoming is None and not steps and not len(self.queue)):
                return
            self.clock[0] = now_s
            if now_s == next_sample_s:
                self.sample(now_s)
                next_sample_s += options.sample_interval_s
                if on_progress is not None:
                    on_progress(now_s)
            elif now_s == next_flush_s:
                self.flush_charges(now_s)
                next_flush_s += options.charge_interval_s
            elif now_s == t_step:
                _, version, index = heapq.heappop(steps)
                if version == self.versions[index]:
                    self.end_step(index, now_s)
            elif upcoming is not None:
                self.arrive(upcoming, now_s)
                upcoming = next(arrivals, None)

    # -- events --------------------------------------------------------------------------

    def sample(self, now_s: float) -> None:
        if isinstance(self.queue, TieredQueue):
            for engine in self.engines:
                num_seqs, num_tokens = engine.newcomer_room()
                self.queue.publish_capacity(
                    engine.engine_id,
                    engine.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S,
                    engine.decode_tokens_per_s or DEFAULT_DECODE_TOKENS_PER_S,
                    self.capacity_ttl_ms,
                    engine.scheduler.backlog(engine.stop_curve),
                    num_seqs if num_tokens > 0 else 0,
                    engine.scheduler.num_running,
                    engine.stop_curve,
                )
        self.take_drops(now_s)
        served = self.served
        for item in self.inflight.values():
            num_new = len(item.request.output_token_ids) - item.num_served
            if num_new:
                item.num_served += num_new
                tenant = item.job.tenant_id
                served[tenant] += OUTPUT_TOKEN_WEIGHT * num_new
        self.trace.sample(now_s, served, self.queue.backlogged_tenants())

    def arrive(self, req: SimRequest, now_s: float) -> None:
        """Admission (the gateway), enqueue, then wake an idle engine or cut a run."""
        self.collector.offered(req)
        record = RequestRecord(req)
        limits = self.limits
        if limits is not None:
            code = limits.reserve(req)
            if code is not None:
                self.collector.refused(record, code)
                return
        job = _job(req)
        queue = self.queue
        code = None
        if self.spec.uses_admission and isinstance(queue, TieredQueue):
            code = queue.admit(job)
        if code is None:
            try:
                queue.push(job, now_s)
            except QueueFullError:
                code = QUEUE_FULL
        if code is not None:
            self.collector.refused(record, code)
            if limits is not None:
                limits.release(req.request_id, 0)
            return
        self.queued[req.request_id] = record
        # An idle engine that takes nothing from the queue and has nothing to run goes back
        # on the idle stack: set it aside until the loop ends, or it would be popped again
        # and again for ever. Each turn then shrinks the queue or the idle stack.
        passed: list[int] = []
        while self.idle and len(queue):
            index = self.idle.pop()
            num_queued = len(queue)
            self.pull(self.engines[index], now_s)
            self.start(index, now_s)
            if len(queue) == num_queued and self.idle and self.idle[-1] == index:
                passed.append(self.idle.pop())
        self.idle.extend(reversed(passed))
        if self.runs and len(queue) > len(self.cut):
            self.cut_run(now_s)

    def pull(self, engine: SimEngine, now_s: float) -> None:
        """What a worker's dispatcher does: lease a step's worth of newcomers at once
        (the room the engine's last step left, as AsyncEngine.can_accept counts it), then
        more while the engine still has room."""
        queue = self.queue
        num_seqs, num_tokens = engine.newcomer_room()
        while len(queue) and ((num_seqs > 0 and num_tokens > 0) or engine.can_accept()):
            job = queue.pop(now_s, engine.engine_id)
            if job is None:
                break
            record = self.queued.pop(job.job_id)
            record.dispatch_s = now_s
            req = record.request
            num_seqs -= 1
            num_tokens -= req.num_prompt_tokens
            try:
                request = engine.add(
                    job.job_id,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_output_tokens=req.num_output_tokens,
                    max_tokens=req.max_tokens,
                    rank=job.rank,
                    tenant=req.tenant_id,
                    arrival_s=req.arrival_s,
                    ttft_slo_ms=req.ttft_slo_ms,
                    tpot_slo_ms=req.tpot_slo_ms,
                    preemptible=req.preemptible,
                )
            except InvalidRequestError:
                # Longer than the model or the KV cache: the engine refuses it outright.
                queue.complete(job, now_s)
                self.collector.dropped(record, INVALID_REQUEST)
                if self.limits is not None:
                    self.limits.release(job.job_id, 0)
                continue
            self.inflight[job.job_id] = _InFlight(record, job, request)
            self.served[req.tenant_id] = (
                self.served.get(req.tenant_id, 0.0) + INPUT_TOKEN_WEIGHT * req.num_prompt_tokens
            )
        self.take_drops(now_s)

    def take_drops(self, now_s: float) -> None:
        for job_id in self.queue.take_dropped(now_s):
            record = self.queued.pop(job_id, None)
            if record is not None:
                self.collector.dropped(record, QUEUE_TIMEOUT)
                if self.limits is not None:
                    self.limits.release(job_id, 0)

    def start(self, index: int, now_s: float) -> None:
        """Plan the engine's next step (or decode run), or mark it idle."""
        engine = self.engines[index]
        self.versions[index] += 1
        if self.options.fast_forward:
            offsets = engine.plan_decode_run()
            if offsets is not None:
                self.runs[index] = _DecodeRun(now_s, offsets, len(offsets))
                heapq.heappush(self.steps, (now_s + offsets[-1], self.versions[index], index))
                return
        duration_s = engine.start_step()
        if duration_s is None:
            self.idle.append(index)
        else:
            heapq.heappush(self.steps, (now_s + duration_s, self.versions[index], index))

    def cut_run(self, now_s: float) -> None:
        """A job is queued and no engine is idle: the decode run that reaches a step
        boundary first, on an engine with room, ends there so the engine pulls it."""
        best: tuple[float, int, int] | None = None
        for index, run in self.runs.items():
            if run.is_single_step:
                continue
            if run.accepts is None:
                run.accepts = self.engines[index].can_accept()
            if not run.accepts:
                continue
            done = bisect.bisect_right(run.offsets, now_s - run.start_s, 0, run.num_steps)
            if done >= run.num_steps:
                continue
            end_s = run.start_s + run.offsets[done]
            if best is None or end_s < best[0]:
                best = (end_s, index, done + 1)
        if best is None:
            return
        end_s, index, num_steps = best
        run = self.runs[index]
        if num_steps < run.num_steps:
            run.num_steps = num_steps
            self.versions[index] += 1
            heapq.heappush(self.steps, (end_s, self.versions[index], index))
        self.cut.add(index)

    def end_step(self, index: int, now_s: float) -> None:
        """The step (or run) ran: record tokens and finishes, charge, pull, go on."""
        engine = self.engines[index]
        run = self.runs.pop(index, None)
        self.cut.discard(index)
        if run is not None:
            outcome = engine.apply_decode_run(run.offsets, run.num_steps)
        else:
            outcome = engine.end_step()
        inflight, collector, queue = self.inflight, self.collector, self.queue
        for request in outcome.first_tokens:
            inflight[request.request_id].record.first_token_s = now_s
        if self.options.charge_interval_s <= 0:
            # Charged as generated; otherwise flush_charges and the finishes below do it.
            for request, count in outcome.output_tokens:
                item = inflight[request.request_id]
                queue.charge(item.job, count, now_s)
                item.num_charged += count
        for request in outcome.preempted:
            inflight[request.request_id].record.num_preemptions += 1
        collector.num_preemptions += len(outcome.preempted)
        collector.num_recomputed_tokens += outcome.num_recomputed_tokens
        num_tokens = outcome.num_output_tokens
        collector.num_output_tokens += num_tokens
        if now_s <= self.workload.duration_s:
            self.window_tokens += num_tokens
        served = self.served
        for request in outcome.finished:
            item = inflight.pop(request.request_id)
            num_output = len(request.output_token_ids)
            if num_output > item.num_charged:
                queue.charge(item.job, num_output - item.num_charged, now_s)
            tenant = item.job.tenant_id
            served[tenant] += OUTPUT_TOKEN_WEIGHT * (num_output - item.num_served)
            item.record.finish_s = now_s
            queue.complete(item.job, now_s)
            collector.finished(item.record)
            if self.limits is not None:
                req = item.record.request
                self.limits.release(req.request_id, req.num_prompt_tokens + req.num_output_tokens)
        self.pull(engine, now_s)
        self.start(index, now_s)

    def flush_charges(self, now_s: float) -> None:
        queue = self.queue
        for item in self.inflight.values():
            num_output = len(item.request.output_token_ids)
            if num_output > item.num_charged:
                queue.charge(item.job, num_output - item.num_charged, now_s)
                item.num_charged = num_output

    def stats(self, wall_s: float) -> RunStats:
        workload, collector = self.workload, self.collector
        duration_s = workload.duration_s
        window = self.options.fairness_window_s or (0.2 * duration_s, duration_s)
        tenant_tier = {t.tenant_id: t.tier for t in workload.tenants}
        tenant_weight = {t.tenant_id: t.weight for t in workload.tenants}
        return RunStats(
            duration_s=duration_s,
            tiers={t: collector.tier_stats(t, duration_s) for t in collector.tiers()},
            output_tokens_per_s=self.window_tokens / duration_s,
            num_preemptions=collector.num_preemptions,
            num_recomputed_tokens=collector.num_recomputed_tokens,
            fairness=fairness_stats(self.trace, tenant_tier, tenant_weight, window),
            num_steps=sum(e.num_steps for e in self.engines),
            wall_s=wall_s,
        )


def simulate(
    workload: WorkloadSpec,
    policy: str,
    fleet: FleetSpec,
    options: SimOptions | None = None,
    *,
    requests: Iterable[SimRequest] | None = None,
    on_progress: Callable[[float], None] | None = None,
) -> SimResult:
    """Run one policy on one workload; `requests` overrides the generated arrivals."""
    wall_start = time.perf_counter()
    state = _Fleet(workload, policy, fleet, options or SimOptions())
    arrivals = iter(requests) if requests is not None else iter_requests(workload)
    state.run(arrivals, on_progress)
    stats = state.stats(time.perf_counter() - wall_start)
    return SimResult(policy, stats, state.collector, state.trace, state.engines)
