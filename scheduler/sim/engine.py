"""One simulated engine: the real step scheduler and block manager, a cost-model runner.

The runner does what the model runner does to the scheduler's state (append one token
per chunk that produces one, finish requests where they end) and nothing else; instead of
running the model it returns the step's duration from the roofline. The step scheduler's
online cost model is fed the simulated step times, as the real engine feeds it measured
ones, so the TPOT-keeping prefill budget behaves as in production.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.cost_model import StepCostModel
from engine.phase_rates import PhaseRates
from engine.request import FinishReason, Priority, Request, SamplingParams
from engine.step_scheduler import SchedulerConfig, StepPlan, StepScheduler
from engine.stop_hazard import StopCurve, StopHazard, age_bucket, count_ages, new_step_counts
from scheduler.sim.cost_model import DEFAULT_MAX_MODEL_LEN, RooflineParams

# Prompts are token id 1 repeated (all prompts alike would only matter to the prefix
# cache, which the simulator turns off: sharing is a property of real text).
_PROMPTS: dict[int, tuple[int, ...]] = {}


def _prompt(num_tokens: int) -> list[int]:
    tokens = _PROMPTS.get(num_tokens)
    if tokens is None:
        tokens = _PROMPTS[num_tokens] = (1,) * num_tokens
    return list(tokens)


@dataclass(eq=False)
class SimRun(Request):
    """A simulated request: where it ends is drawn in advance (its output length)."""

    # The output token it ends at: its max_tokens, or its drawn end of sequence before.
    ends_at: int = 0
    # Whether it can end before its max_tokens: its engine learns the stop hazard from
    # such requests, as the real engine does from those that are not ignore_eos.
    may_stop: bool = False


@dataclass(frozen=True)
class EngineMode:
    """How a policy uses the engine: `use_ranks` False makes every request rank 0 (FCFS
    and VTC know no tiers); `rank_preemption` False preempts only under KV pressure.

    The step scheduler only ever preempts for rank a running request marked preemptible,
    while KV-pressure preemption ignores the mark; so marking every request
    non-preemptible is exactly "preempt only on KV pressure", with no engine switch.
    """

    use_ranks: bool = True
    rank_preemption: bool = True
    # The step scheduler's online cost model shrinks prefill to keep the tightest TPOT
    # SLO; the baselines run without it, as vLLM does.
    slo_budget: bool = True


@dataclass
class StepOutcome:
    """What one step did, for the fleet's bookkeeping."""

    first_tokens: list[Request]
    finished: list[Request]
    # (request, tokens it produced); filled only for an engine built with
    # report_outputs=True (the fleet needs it only to charge the queue step by step).
    # The tokens are in each request's output_token_ids either way.
    output_tokens: list[tuple[Request, int]]
    preempted: list[Request]
    num_recomputed_tokens: int
    num_output_tokens: int = 0


def scheduler_config(params: RooflineParams, max_model_len: int) -> SchedulerConfig:
    """The step scheduler limits a preset describes (max_model_len capped by the cache)."""
    return params.scheduler_config(max_model_len)


class SimEngine:
    """A step scheduler on a virtual clock; `start_step` plans, `end_step` applies it."""

    def __init__(
        self,
        engine_id: str,
        params: RooflineParams,
        mode: EngineMode,
        clock: list[float],
        *,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        report_outputs: bool = True,
    ) -> None:
        self.engine_id = engine_id
        self.report_outputs = report_outputs
        self.params = params
        self.mode = mode
        self._clock = clock  # the fleet's clock, one shared cell
        self.block_manager = BlockManager(
            params.num_kv_blocks, params.block_size, enable_prefix_caching=False
        )
        self.cost_model = StepCostModel() if mode.slo_budget else None
        self.scheduler = StepScheduler(
            scheduler_config(params, max_model_len),
            self.block_manager,
            cost_model=self.cost_model,
            clock=lambda: clock[0],
        )
        self._plan: StepPlan | None = None
        # (fewest tokens any running request has left, KV tokens a decode of all of them
        # reads), gathered by the pass that last touched every running request (end_step,
        # apply_decode_run) when all of them then decode; None when unknown. Saves
        # plan_decode_run its own pass; anything that changes the scheduler clears it.
        self._decode_summary: tuple[int, int] | None = None
        # The tightest TPOT SLO of any request this engine was given: the step scheduler
        # can pause decodes only when a step would break the tightest running one.
        self._min_tpot_slo_ms = math.inf
        self.is_stepping = False
        self.num_steps = 0
        self.busy_s = 0.0
        # Highest computed position per request: tokens below it run again after a
        # preemption and count as recomputed. A request never preempted that has made
        # its first token is decoding, its high water is num_tokens - 1: it has no entry
        # (bookkeeping per decode and request was a fair share of the simulator's time).
        # An entry is made for it at its first chunk after a preemption.
        self._high_water: dict[str, int] = {}
        # Measured rates, as the real engine measures them; the fleet publishes them to
        # the queue, where admission reads the fleet's capacity.
        self.rates = PhaseRates(self.cost_model)
        # Stops of requests that may stop early, by age, as the real engine measures them.
        self.stop_hazard = StopHazard()

    @property
    def stop_curve(self) -> StopCurve:
        return self.stop_hazard.curve

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.rates.prefill_tokens_per_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.rates.decode_tokens_per_s

    def can_accept(self, rank: int | None = None) -> bool:
        return self.scheduler.can_accept(rank if self.mode.use_ranks else None)

    def newcomer_room(self) -> tuple[int, int]:
        return self.scheduler.newcomer_room()

    @property
    def num_requests(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_waiting

    def add(
        self,
        request_id: str,
        *,
        num_prompt_tokens: int,
        num_output_tokens: int,
        max_tokens: int | None = None,
        rank: int,
        tenant: str,
        arrival_s: float,
        ttft_slo_ms: float | None,
        tpot_slo_ms: float | None,
        preemptible: bool,
    ) -> Request:
        priority = Priority(
            rank=rank if self.mode.use_ranks else 0,
            tenant=tenant,
            arrival_s=arrival_s,
            ttft_slo_ms=ttft_slo_ms,
            tpot_slo_ms=tpot_slo_ms,
            preemptible=preemptible and self.mode.use_ranks and self.mode.rank_preemption,
        )
        # With max_tokens, it asks that many and ends at num_output_tokens (an end of
        # sequence, unless that is its max_tokens); without, it asks exactly those.
        asked = num_output_tokens if max_tokens is None else max_tokens
        request = SimRun(
            request_id,
            _prompt(num_prompt_tokens),
            SamplingParams(max_tokens=asked, ignore_eos=max_tokens is None),
            priority,
            ends_at=min(num_output_tokens, asked),
            may_stop=max_tokens is not None,
        )
        self._decode_summary = None
        self.scheduler.add(request)
        if tpot_slo_ms is not None and tpot_slo_ms < self._min_tpot_slo_ms:
            self._min_tpot_slo_ms = tpot_slo_ms
        return request

    def start_step(self) -> float | None:
        """Plan a step; its duration in seconds, or None when there is nothing to run."""
        self._decode_summary = None
        plan = self.scheduler.schedule()
        if plan.is_empty:
            self._plan = None
            return None
        num_kv = 0
        pairs = 0.0
        num_decode = 0
        # One pass over the step's chunks (one per running request): kept flat.
        for chunk in plan.chunks:
            start = chunk.start
            num_tokens = chunk.num_tokens
            end = start + num_tokens
            num_kv += end
            pairs += num_tokens * (start + (num_tokens + 1) / 2)
            if num_tokens == 1 and end == chunk.request_num_tokens:
                num_decode += 1  # chunk.is_decode
        duration_s = self.params.step_time_s(
            plan.num_batched_tokens, num_kv, pairs, len(plan.chunks)
        )
        if self.cost_model is not None:
            self.cost_model.observe(plan.num_batched_tokens, len(plan.chunks), duration_s)
        self.rates.record(
            plan.num_batched_tokens - num_decode, num_decode, len(plan.chunks), duration_s
        )
        self._plan = plan
        self.is_stepping = True
        self.num_steps += 1
        self.busy_s += duration_s
        return duration_s

    def end_step(self) -> StepOutcome:
        """Apply the planned step: append tokens, finish requests at their max_tokens."""
        plan = self._plan
        self.is_stepping = False
        self._plan = None
        outcome = StepOutcome([], [], [], [], 0)
        if plan is None:
            return outcome
        outcome.preempted = plan.preempted
        high_water = self._high_water
        outputs = outcome.output_tokens if self.report_outputs else None
        num_recomputed = 0
        num_produced = 0
        stop_counts = None  # per age bucket: tokens of requests that may stop, stops
        num_decoding = 0  # requests that made a token and go on: decode next step
        fewest_left = -1
        num_kv = 0
        # Runs once per simulated step over every scheduled request: kept flat.
        for chunk in plan.chunks:
            request = chunk.request
            start = chunk.start
            end = start + chunk.num_tokens
            produces_token = end == chunk.request_num_tokens
            tokens = request.output_token_ids
            if request.num_preemptions or not produces_token or not tokens:
                # Not the plain decode of a request never preempted (see _high_water).
                request_id = request.request_id
                seen = high_water.get(request_id)
                if seen is None:
                    seen = chunk.request_num_tokens - 1 if tokens else 0
                if start < seen:
                    num_recomputed += min(end, seen) - start
                high_water[request_id] = end if end > seen else seen
            if not produces_token:
                continue
            tokens.append(1)
            num_produced += 1
            if outputs is not None:
                outputs.append((request, 1))
            if len(tokens) == 1:
                outcome.first_tokens.append(request)
                if not request.num_preemptions:
                    del high_water[request.request_id]  # decoding: num_tokens - 1 from now
            num_made = len(tokens)
            left = request.ends_at - num_made
            if request.may_stop:
                if stop_counts is None:
                    stop_counts = (new_step_counts(), new_step_counts())
                bucket = age_bucket(num_made - 1)
                stop_counts[0][bucket] += 1
                if left <= 0 and num_made < request.params.max_tokens:
                    stop_counts[1][bucket] += 1
            if left <= 0:
                self.scheduler.finish(request, _finish_reason(request, num_made))
                high_water.pop(request.request_id, None)
                outcome.finished.append(request)
                continue
            num_decoding += 1
            if fewest_left < 0 or left < fewest_left:
                fewest_left = left
            num_kv += end + 1
        if stop_counts is not None:
            self.stop_hazard.record(*stop_counts)
        outcome.num_recomputed_tokens = num_recomputed
        outcome.num_output_tokens = num_produced
        if num_decoding and num_decoding == self.scheduler.num_running:
            self._decode_summary = (fewest_left, num_kv)
        return outcome

    # ------------------------------------------------------------- fast-forward
    #
    # While every running request is decoding and nothing waits, each `schedule()` would
    # return the same plan (one decode per request) until a request finishes or the KV
    # cache runs out; only the context lengths grow. `plan_decode_run` predicts those
    # steps' durations without running the scheduler; `apply_decode_run(j)` then puts
    # the engine in exactly the state j real decode steps would leave (same blocks
    # allocated, same computed tokens, same appended tokens, same cost-model samples).
    # The fleet cuts a run short when a job arrives that this engine would have pulled.

    def plan_decode_run(self, *, min_steps: int = 1) -> list[float] | None:
        """Cumulative end offsets (s) of the steps of a pure-decode run, or None when
        the next step is not a plain decode of every running request."""
        scheduler = self.scheduler
        if scheduler.num_waiting or not scheduler.num_running:
            return None
        running = scheduler.running
        shape = self._decode_summary or self._decode_shape(running)
        if shape is None:
            return None
        num_steps, kv = shape
        if num_steps < min_steps:
            return None
        if self._may_pause_decodes(len(running)):
            return None
        num_steps = self._steps_that_fit(running, num_steps)
        if num_steps < min_steps:
            return None
        # params.step_time_s(n, kv, kv, n) for each step, its arithmetic in the same order.
        params = self.params
        n = len(running)
        overhead = params.overhead_s + params.overhead_per_seq_s * n
        weight_bytes = params.weight_bytes
        kv_bytes = params.kv_bytes_per_token
        memory_rate = params.memory_efficiency * params.memory_bandwidth_bytes_per_s
        token_flops = 2.0 * params.num_params * n
        pair_flops = params.attention_flops_per_token_pair
        compute_rate = params.compute_efficiency * params.peak_flops_per_s
        offsets = []
        elapsed = 0.0
        for _ in range(num_steps):
            memory_s = (weight_bytes + kv_bytes * kv) / memory_rate
            compute_s = (token_flops + pair_flops * kv) / compute_rate
            elapsed += overhead + (memory_s if memory_s >= compute_s else compute_s)
            offsets.append(elapsed)
            kv += n
        return offsets

    def _may_pause_decodes(self, num_running: int) -> bool:
        """Whether the next step's scheduler would pause some decodes to keep a TPOT SLO
        (then it is no plain decode of everyone). The exact answer is asked only when the
        cost model's prediction for this batch comes near the tightest SLO any request
        of this engine had; the scheduler pauses nothing below that.

        The answer holds for the run's first step; the run's own steps then refine the
        cost model, which could move the limit within a run (a prediction that far below
        the SLO, as on the H200 preset, does not move that much in a run's few steps).
        """
        model = self.cost_model
        if model is None or not model.is_ready or math.isinf(self._min_tpot_slo_ms):
            return False
        config = self.scheduler.config
        floor_s = self._min_tpot_slo_ms / 1000.0 * config.tpot_slo_share
        if model.predict(num_running + config.min_prefill_tokens, num_running + 1) <= floor_s:
            return False
        limit = self.scheduler.decode_limit()
        return limit is not None and limit < num_running

    @staticmethod
    def _decode_shape(running: Sequence[Request]) -> tuple[int, int] | None:
        """(fewest tokens left, KV tokens read) of a decode of every running request, or
        None when one of them would not decode (see _decode_summary)."""
        fewest_left = -1
        kv = 0
        for request in running:
            computed = request.num_computed_tokens
            num_output = len(request.output_token_ids)
            if computed != len(request.prompt_token_ids) + num_output - 1:
                return None  # prefilling or recomputing
            if not num_output:
                # A prompt chunked to its last token: that one-token step makes the
                # first token, whose time a run would not report.
                return None
            left = request.ends_at - num_output
            if fewest_left < 0 or left < fewest_left:
                fewest_left = left
            kv += computed + 1
        return fewest_left, kv

    def _steps_that_fit(self, running: Sequence[Request], num_steps: int) -> int:
        """Largest j <= num_steps whose decode blocks all fit in the free pool (more would
        preempt under KV pressure, which only the real scheduler may decide)."""
        bm = self.block_manager
        free = bm.num_free_blocks
        size = bm.block_size
        # A request holds blocks for at least its computed tokens, so j more tokens take
        # at most ceil(j / size) new blocks each: with that many free, all j fit.
        if len(running) * -(-num_steps // size) <= free:
            return num_steps

        def needed(j: int) -> int:
            # Σ max(0, num_blocks_for(computed + j) - blocks held)
            total = 0
            for r in running:
                more = -(-(r.num_computed_tokens + j) // size) - len(r.block_ids)
                if more > 0:
                    total += more
            return total

        if needed(num_steps) <= free:
            return num_steps
        lo, hi = 0, num_steps
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if needed(mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def apply_decode_run(self, offsets: Sequence[float], num_steps: int) -> StepOutcome:
        """Apply the first `num_steps` steps of a planned decode run."""
        scheduler = self.scheduler
        running = scheduler.running
        outcome = StepOutcome([], [], [], [], 0)
        model = self.cost_model
        record = self.rates.record
        n = len(running)
        previous = 0.0
        for i in range(num_steps):
            offset = offsets[i]
            if model is not None:
                model.observe(n, n, offset - previous)
            record(0, n, n, offset - previous)
            previous = offset
        self.num_steps += num_steps
        self.busy_s += offsets[num_steps - 1]
        high_water = self._high_water
        outputs = outcome.output_tokens if self.report_outputs else None
        tokens = [1] * num_steps
        bm = self.block_manager
        size = bm.block_size
        fewest_left = -1
        num_kv = 0
        stop_counts = None  # per age bucket: tokens of requests that may stop, stops
        for request in running:
            end = request.num_computed_tokens + num_steps
            # allocate_slots would find the blocks it holds enough; skip the call.
            if -(-end // size) > len(request.block_ids) and not bm.allocate_slots(
                request, num_steps
            ):
                raise RuntimeError("a planned decode run no longer fits the KV cache")
            request.num_computed_tokens = end
            output_ids = request.output_token_ids
            output_ids.extend(tokens)
            if outputs is not None:
                outputs.append((request, num_steps))
            num_made = len(output_ids)
            left = request.ends_at - num_made
            if request.may_stop:
                if stop_counts is None:
                    stop_counts = (new_step_counts(), new_step_counts())
                count_ages(stop_counts[0], num_made - num_steps, num_steps)
                if left <= 0 and num_made < request.params.max_tokens:
                    stop_counts[1][age_bucket(num_made - 1)] += 1
            if left <= 0:
                scheduler.finish(request, _finish_reason(request, num_made))
                high_water.pop(request.request_id, None)
                outcome.finished.append(request)
                continue
            if request.num_preemptions:
                high_water[request.request_id] = end  # see _high_water
            if fewest_left < 0 or left < fewest_left:
                fewest_left = left
            num_kv += end + 1
        if stop_counts is not None:
            self.stop_hazard.record(*stop_counts)
        outcome.num_output_tokens = n * num_steps
        # Every running request decoded and goes on decoding (see _decode_summary).
        self._decode_summary = (fewest_left, num_kv) if fewest_left > 0 else None
        return outcome


def _finish_reason(request: SimRun, num_made: int) -> FinishReason:
    """An end before max_tokens is the end of sequence (stop); at it, the length."""
    return FinishReason.STOP if num_made < request.params.max_tokens else FinishReason.LENGTH
