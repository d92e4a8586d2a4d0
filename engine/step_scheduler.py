"""Which tokens of which requests run in the next engine step (continuous batching).

Each `schedule()`:

1. decodes: one token for every running request that has caught up, best rank first;
2. chunked prefill: the next chunk of every running request still prefilling, within the
   step's token budget and the per-request chunk cap;
3. admission: waiting requests in order (rank, preempted victims before newcomers,
   arrival) while the budget, `max_num_seqs` and the free-block watermark allow.

Preemption is by recompute: the victim's blocks are freed (its full ones stay in the
prefix cache, so resuming is often cheap), it goes back to the waiting queue ahead of
newcomers of its rank and later recomputes its KV. It happens when a better-rank waiting
request does not fit and running preemptible work of a worse rank can make room (the
victims cheapest to recompute go first), and under KV pressure, when a running request
cannot get a block (worst rank first, whatever its tier).

With a fitted cost model, the prefill part of the budget shrinks so that the predicted
step time keeps the tightest TPOT SLO of the requests decoding; decodes are never cut.

Pure Python; the engine runs the plan and reports back through `finish`/`abort`.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from engine.block_manager import BlockManager
from engine.cost_model import StepCostModel
from engine.errors import ContextLengthExceededError, InvalidRequestError
from engine.request import FinishReason, Request, RequestStatus
from engine.stop_hazard import StopCurve


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine's step scheduler."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget
    max_prefill_chunk_tokens: int = 512  # cap of one request's prefill chunk per step
    enable_chunked_prefill: bool = True
    # Free blocks kept back when admitting new work, so that running requests can grow a
    # while before anyone must be preempted.
    watermark_blocks: int = 2
    max_model_len: int = 2048
    # Floor of the prefill budget when the cost model shrinks it: new work always moves.
    min_prefill_tokens: int = 16
    # Share of the tightest TPOT SLO a step's predicted model time may take. The rest
    # covers what a token costs outside the step (sampling, detokenizing, streaming it)
    # and the fit's error: at 1.0 a CPU run next to a batch missed 8 % of TPOTs.
    tpot_slo_share: float = 0.8

    def __post_init__(self) -> None:
        if not 0.0 < self.tpot_slo_share <= 1.0:
            raise ValueError(f"tpot_slo_share must be in (0, 1], got {self.tpot_slo_share!r}")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_prefill_chunk_tokens",
            "max_model_len",
            "min_prefill_tokens",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.watermark_blocks < 0:
            raise ValueError("watermark_blocks must be >= 0")
        # Every running request must be able to decode in the same step.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        # Without chunking a whole prompt (or a recompute) must fit one step.
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len without chunked prefill"
            )


@dataclass(frozen=True)
class ScheduledChunk:
    """Run tokens `request.all_token_ids[start:start + num_tokens]` this step."""

    request: Request
    start: int  # request.num_computed_tokens before this step
    num_tokens: int
    # request.num_tokens when scheduled: the engine appends a token after the step, and
    # `produces_token` must keep its answer.
    request_num_tokens: int = field(default=-1, repr=False)

    def __post_init__(self) -> None:
        if self.request_num_tokens < 0:
            object.__setattr__(self, "request_num_tokens", self.request.num_tokens)

    @property
    def produces_token(self) -> bool:
        """The chunk ends at the request's last token, so its logits give the next one."""
        return self.start + self.num_tokens == self.request_num_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.produces_token


@dataclass(frozen=True)
class StepPlan:
    chunks: list[ScheduledChunk]  # decodes first, then prefill chunks
    preempted: list[Request]  # preempted during this schedule() call
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class SchedulerStats:
    """Counters since the scheduler was built, for the engine to export."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_preempted_tokens: int = 0  # computed tokens whose KV preemptions dropped
    num_recomputed_tokens: int = 0  # of those, tokens computed again (not cache hits)
    num_rejected: int = 0  # requests refused by add()


@dataclass(frozen=True)
class RankBacklog:
    """Work the scheduler holds, per request rank (0 is best), for admission upstream.

    A dispatcher pulls jobs whenever a sequence slot is free, so under overload the
    backlog sits here (prompts waiting for prefill budget), out of the queue's sight;
    workers publish this so that predicted TTFTs count it.
    """

    # Tokens still to compute before a request's next token: prompts of waiting and
    # partly prefilled requests, and the recompute of preempted ones.
    unprefilled_tokens_by_rank: dict[int, int] = field(default_factory=dict)
    # Tokens the held requests may still generate: max_tokens left, as queued jobs count,
    # or for a request that may stop early what it is expected to (StepScheduler.backlog).
    decode_tokens_by_rank: dict[int, int] = field(default_factory=dict)
    # Per running request, (tokens its max_tokens still allows, tokens it has made,
    # whether it can stop before its max_tokens): when the slots free, for a newcomer
    # that finds none (scheduler.slot_release, with the engine's measured stop curve).
    # Empty while a slot (and blocks) is free: a newcomer then waits for no release, only
    # for the prefill ahead of it, even with requests waiting here for prefill budget.
    running_left: tuple[tuple[int, int, bool], ...] = ()
    # Running preemptible requests per rank: a newcomer of a rank better than theirs and
    # than the best waiting here displaces one of those at once (displacing_rank_bound;
    # admission derives that rank from waiting_by_rank, scheduler.backend).
    preemptible_by_rank: dict[int, int] = field(default_factory=dict)
    # Requests holding no slot yet (waiting, preempted) per rank: ahead of a newcomer of
    # their rank or worse in the line for one.
    waiting_by_rank: dict[int, int] = field(default_factory=dict)


@dataclass
class _Step:
    chunks: dict[str, ScheduledChunk] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    num_tokens: int = 0
    prefill_budget: int = 0  # tokens left for prefill chunks (continued and new)
    under_kv_pressure: bool = False
    # Running requests still prefilling when decodes were planned, in running order:
    # the only ones the prefill pass can give a chunk (nothing joins the running list
    # before admission).
    prefilling: list[Request] = field(default_factory=list)
    # The tightest TPOT SLO of the running requests as the decode pass found it (None:
    # none), with whether it was looked up; valid while nobody has been preempted.
    tightest_tpot_slo_ms: float | None = None
    has_tightest_tpot_slo: bool = False


class StepScheduler:
    """Continuous-batching policy over a `BlockManager`; see the module docstring.

    Contract with the engine: call `schedule()` only after the previous plan has run;
    after running it, append the sampled token of every chunk with `produces_token`,
    then `finish()` the requests that stopped.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        *,
        cost_model: StepCostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.cost_model = cost_model
        self._clock = clock
        self._requests: dict[str, Request] = {}
        self._order: dict[str, int] = {}  # arrival order, the last tie-breaker
        self._next_order = 0
        self._waiting: list[Request] = []  # sorted by _waiting_key
        self._running: list[Request] = []  # sorted by _running_key
        self._lost_tokens: dict[str, int] = {}  # computed tokens dropped by a preemption
        self._stats = SchedulerStats()
        self._num_steps = 0  # SchedulerStats.num_steps, counted apart: once per schedule()

    # ----------------------------------------------------------------- queries

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> Sequence[Request]:
        """Waiting requests in the order they will be admitted."""
        return tuple(self._waiting)

    @property
    def running(self) -> Sequence[Request]:
        """Running requests, best rank first."""
        return tuple(self._running)

    @property
    def stats(self) -> SchedulerStats:
        return replace(self._stats, num_steps=self._num_steps)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def backlog(self, stop_curve: StopCurve | None = None) -> RankBacklog:
        """Unprefilled and still-to-generate tokens of every held request, by rank. With
        the engine's measured `stop_curve`, a request that may stop early counts the
        tokens it is expected to generate from where it is, not all its max_tokens
        allows: chats limited to 1,500 tokens and stopping after 200 counted as 1,500
        each, and refused interactive requests for seconds of decoding that never came."""
        curve = stop_curve if stop_curve is not None and stop_curve.is_measured else None
        unprefilled: dict[int, int] = {}
        decode: dict[int, int] = {}
        for request in self._requests.values():
            rank = request.priority.rank
            if request.status is not RequestStatus.RUNNING or request.is_prefilling:
                num = request.num_tokens - request.num_computed_tokens
                unprefilled[rank] = unprefilled.get(rank, 0) + num
            left = request.params.max_tokens - request.num_output_tokens
            if curve is not None and request.params.can_stop_early:
                left = round(curve.expected_tokens_left(request.num_output_tokens, left))
            decode[rank] = decode.get(rank, 0) + left
        waiting: dict[int, int] = {}
        for request in self._waiting:
            waiting[request.priority.rank] = waiting.get(request.priority.rank, 0) + 1
        preemptible: dict[int, int] = {}
        for request in self._running:
            if request.priority.preemptible:
                rank = request.priority.rank
                preemptible[rank] = preemptible.get(rank, 0) + 1
        running_left = ()
        if not self._has_room():
            running_left = tuple(
                (
                    r.params.max_tokens - r.num_output_tokens,
                    r.num_output_tokens,
                    r.params.can_stop_early,
                )
                for r in self._running
            )
        return RankBacklog(
            unprefilled,
            decode,
            running_left,
            preemptible,
            waiting,
        )

    def decode_limit(self) -> int | None:
        """How many decodes the next step may hold (the TPOT-keeping limit that pauses
        throughput decodes), or None when nothing limits them. Read-only."""
        return self._max_decode_seqs(_Step())

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def can_accept(self, rank: int | None = None) -> bool:
        """Whether the engine has room for one more request (a dispatcher pulls only then).

        Room means no newcomer is already waiting, a sequence slot is free and free
        blocks exceed the watermark. With `rank`, a request of that rank is also welcome
        when it would displace running preemptible work of a worse rank and nothing of
        its rank or better is waiting.
        """
        has_room = self._has_room()
        if has_room and not any(r.status is RequestStatus.WAITING for r in self._waiting):
            return True
        return rank is not None and rank < self.displacing_rank_bound()

    def _has_room(self) -> bool:
        """A sequence slot is free and free blocks exceed the watermark."""
        return (
            len(self._running) < self.config.max_num_seqs
            and self.block_manager.num_free_blocks > self.config.watermark_blocks
        )

    def displacing_rank_bound(self) -> float:
        """The ranks below this one may displace running work now (can_accept(rank) is
        true for them whether or not there is room): running preemptible work of a worse
        rank exists and nothing of their rank or better waits. One number for every rank,
        so a caller may answer for a rank the engine has never seen."""
        worst_preemptible = max(
            (r.priority.rank for r in self._running if r.priority.preemptible), default=-math.inf
        )
        best_waiting = min((r.priority.rank for r in self._waiting), default=math.inf)
        return min(worst_preemptible, best_waiting)

    def newcomer_room(self) -> tuple[int, int]:
        """(requests, prompt tokens) the next step could start on if they arrived now: what
        a dispatcher may hand over between two steps. (0, 0) unless can_accept().

        Bounded by the free sequence slots, the step's token budget left after the running
        requests' decodes, and the free blocks above the watermark. Newcomers beyond what
        the step then admits wait inside the engine, and can_accept() says no until they
        are in: at most one step's worth of work leaves the fair-share queue early.
        """
        if not self.can_accept():
            return 0, 0
        config = self.config
        num_running = len(self._running)
        num_free_blocks = self.block_manager.num_free_blocks - config.watermark_blocks
        num_tokens = min(
            config.max_num_batched_tokens - num_running,
            num_free_blocks * self.block_manager.block_size,
        )
        return config.max_num_seqs - num_running, max(num_tokens, 0)

    # ----------------------------------------------------------------- mutators

    def add(self, request: Request) -> None:
        """Queue a request, or raise a typed error (and change nothing) if it can never run."""
        try:
            self._validate(request)
        except InvalidRequestError:
            self._stats = replace(self._stats, num_rejected=self._stats.num_rejected + 1)
            raise
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self._order[request.request_id] = self._next_order
        self._next_order += 1
        bisect.insort(self._waiting, request, key=self._waiting_key)

    def _validate(self, request: Request) -> None:
        # Lengths only, O(1): the token ids themselves are checked once at the edge
        # (LLMEngine.validate checks type and vocabulary range); scanning every prompt
        # token again on each add cost the simulated fleet ~15% of its time.
        if request.request_id in self._requests:
            raise InvalidRequestError(
                f"request id {request.request_id!r} is already in use", param="request_id"
            )
        if request.status is not RequestStatus.WAITING or request.block_ids:
            raise InvalidRequestError("only a new request can be added", param="request_id")
        if not request.prompt_token_ids:
            raise InvalidRequestError("the prompt must hold at least one token", param="prompt")
        max_tokens = request.params.max_tokens
        if request.num_output_tokens >= max_tokens:
            raise InvalidRequestError(
                "the request already holds max_tokens output tokens", param="max_tokens"
            )
        num_total = request.num_prompt_tokens + max_tokens
        if num_total > self.config.max_model_len:
            raise ContextLengthExceededError(
                num_prompt_tokens=request.num_prompt_tokens,
                max_tokens=max_tokens,
                max_model_len=self.config.max_model_len,
            )
        # The last sampled token is never fed back, so its KV is never needed.
        bm = self.block_manager
        if bm.num_blocks_for(num_total - 1) > bm.num_blocks:
            raise InvalidRequestError(
                f"the request needs {num_total} tokens of KV cache, more than the "
                f"{bm.num_blocks * bm.block_size} this engine holds",
                param="max_tokens",
            )

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Retire a request; the KV it computed stays in the prefix cache."""
        if self._requests.get(request.request_id) is not request:
            return
        # The engine calls this after the step ran, so the computed KV is real.
        self.block_manager.cache_full_blocks(request)
        self._retire(request, reason)

    def abort(self, request_id: str) -> Request | None:
        """Retire a request wherever it is; returns it, or None if it is unknown."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        # Not published: an abort may land between schedule() and the step that would
        # have written this KV.
        self._retire(request, FinishReason.ABORT)
        return request

    def _retire(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        self.block_manager.free(request)
        del self._requests[request.request_id]
        del self._order[request.request_id]
        self._lost_tokens.pop(request.request_id, None)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    # ----------------------------------------------------------------- schedule

    def schedule(self) -> StepPlan:
        """Plan the next step: allocate blocks, advance `num_computed_tokens`, preempt."""
        bm = self.block_manager
        # The previous plan has run: its KV is written and may be shared from now on.
        if bm.enable_prefix_caching:
            for request in self._running:
                bm.cache_full_blocks(request)
        step = _Step()
        self._schedule_decodes(step)
        step.prefill_budget = self._prefill_budget(step)
        self._schedule_prefills(step)
        # A step that had to preempt for blocks admits nothing: the victims would only
        # come straight back and thrash.
        if not step.under_kv_pressure:
            self._admit(step)
        self._num_steps += 1
        return StepPlan(
            chunks=list(step.chunks.values()),
            preempted=step.preempted,
            num_batched_tokens=step.num_tokens,
        )

    def _schedule_decodes(self, step: _Step) -> None:
        max_seqs = self._max_decode_seqs(step)
        bm = self.block_manager
        size = bm.block_size
        running = RequestStatus.RUNNING
        chunks = step.chunks
        # Runs for every running request at every step: kept flat (is_prefilling,
        # num_tokens and allocate_slots' own first check are spelt out).
        for request in list(self._running):
            if request.status is not running:
                continue
            computed = request.num_computed_tokens
            num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
            if computed < num_tokens - 1:
                step.prefilling.append(request)
                continue
            if computed >= num_tokens:
                continue  # its sampled token was not appended; nothing to run
            if max_seqs is not None and len(chunks) >= max_seqs and _is_yielding(request):
                continue  # paused for this step; it keeps its blocks and its place
            block_ids = request.block_ids
            if not (block_ids and len(block_ids) * size > computed):
                # The last block is full (or there is none): a new one is needed.
                while not bm.allocate_slots(request, 1):
                    if self._preempt_for_kv(request, step) is request:
                        break
                else:
                    self._add_chunk(step, request, 1)
                continue
            chunks[request.request_id] = ScheduledChunk(request, computed, 1, num_tokens)
            request.num_computed_tokens = computed + 1
            step.num_tokens += 1

    def _schedule_prefills(self, step: _Step) -> None:
        for request in step.prefilling:
            if step.prefill_budget <= 0:
                return
            if (
                request.status is not RequestStatus.RUNNING
                or request.request_id in step.chunks
                or not request.is_prefilling
            ):
                continue
            num_tokens = min(request.num_tokens - request.num_computed_tokens, step.prefill_budget)
            if self.config.enable_chunked_prefill:
                num_tokens = min(num_tokens, self.config.max_prefill_chunk_tokens)
            while (fit := self.block_manager.max_new_tokens(request)) == 0:
                if self._preempt_for_kv(request, step) is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            num_tokens = min(num_tokens, fit)
            if not self.config.enable_chunked_prefill and num_tokens < (
                request.num_tokens - request.num_computed_tokens
            ):
                continue
            if not self.block_manager.allocate_slots(request, num_tokens):
                raise RuntimeError("block manager refused slots it reported free")
            self._add_chunk(step, request, num_tokens)
            step.prefill_budget -= num_tokens

    def _max_decode_seqs(self, step: _Step) -> int | None:
        """How many decodes a step may hold and still keep the tightest TPOT SLO of the
        requests decoding, or None when nothing limits it.

        Decodes of requests with a TPOT SLO are never cut; throughput work (preemptible,
        no TPOT SLO) decodes in what is left, at least one per step so it never stalls.
        Without this a batch of running throughput work makes every step slower than a
        running interactive request's TPOT SLO, whatever the prefill budget does.
        """
        model = self.cost_model
        if model is None or not model.is_ready:
            return None
        tightest_ms, num_kept = self._tpot_limits()
        step.tightest_tpot_slo_ms = tightest_ms
        step.has_tightest_tpot_slo = True
        if tightest_ms is None:
            return None
        slo_s = tightest_ms / 1000.0 * self.config.tpot_slo_share
        floor = self.config.min_prefill_tokens  # new work keeps moving too
        num_seqs = len(self._running)
        while num_seqs > 1 and model.predict(num_seqs + floor, num_seqs + 1) > slo_s:
            num_seqs -= 1
        return max(num_seqs, num_kept + 1)

    def _tpot_limits(self) -> tuple[float | None, int]:
        """The smallest TPOT SLO of the running requests that have begun decoding (None
        if none has one), and how many running requests keep their decode slot (are not
        `_is_yielding`). One pass: it runs at every step."""
        tightest = None
        num_kept = 0
        for r in self._running:
            priority = r.priority
            slo_ms = priority.tpot_slo_ms
            if slo_ms is None:
                if not priority.preemptible:
                    num_kept += 1
                continue
            num_kept += 1
            if r.output_token_ids and (tightest is None or slo_ms < tightest):
                tightest = slo_ms
        return tightest, num_kept

    def _prefill_budget(self, step: _Step) -> int:
        budget = self.config.max_num_batched_tokens - step.num_tokens
        model = self.cost_model
        if model is None or not model.is_ready:
            return budget
        if step.has_tightest_tpot_slo and not step.preempted:
            tightest_ms = step.tightest_tpot_slo_ms
        else:
            tightest_ms, _ = self._tpot_limits()
        if tightest_ms is None:
            return budget
        num_seqs = len(step.chunks) + 1
        slo_s = tightest_ms / 1000.0 * self.config.tpot_slo_share
        max_tokens = model.max_batched_tokens(slo_s, num_seqs)
        if max_tokens is None:
            return budget
        floor = min(budget, self.config.min_prefill_tokens)
        return max(floor, min(budget, max_tokens - step.num_tokens))

    def _admit(self, step: _Step) -> None:
        for request in list(self._waiting):
            # Victims of this step wait for the next one, and so does everyone behind them.
            if request in step.preempted or not self._try_admit(request, step):
                return

    def _try_admit(self, request: Request, step: _Step) -> bool:
        bm = self.block_manager
        config = self.config
        hits = bm.find_cached_blocks(request)
        num_remaining = request.num_tokens - len(hits) * bm.block_size
        # Prefill chunks of worse ranks scheduled earlier in this step give way if needed.
        budget = step.prefill_budget + sum(
            c.num_tokens
            for c in step.chunks.values()
            if not c.is_decode and c.request.priority.rank > request.priority.rank
        )
        if config.enable_chunked_prefill:
            num_tokens = min(num_remaining, config.max_prefill_chunk_tokens, budget)
        elif num_remaining <= budget:
            num_tokens = num_remaining
        else:
            return False
        if num_tokens <= 0:
            return False
        # Admission wants room for the whole first chunk above the watermark: squeezing a
        # smaller one into the last free blocks would only push running work out later.
        if not self._fits(request, num_tokens, hits, ()):
            victims = self._choose_victims(request, num_tokens, hits, step)
            if victims is None:
                return False
            for victim in victims:
                self._preempt(victim, step)
        self._defer_worse_prefills(request, num_tokens, step)
        num_tokens = min(num_tokens, step.prefill_budget)
        if num_tokens <= 0 or (not config.enable_chunked_prefill and num_tokens < num_remaining):
            return False
        if not bm.allocate_slots(request, num_tokens, hits, reserve_blocks=self._reserve(())):
            return False
        lost = self._lost_tokens.pop(request.request_id, 0)
        if lost:
            recomputed = max(0, lost - request.num_computed_tokens)
            self._stats = replace(
                self._stats, num_recomputed_tokens=self._stats.num_recomputed_tokens + recomputed
            )
        self._waiting.remove(request)
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_s is None:
            request.first_scheduled_s = self._clock()
        bisect.insort(self._running, request, key=self._running_key)
        self._add_chunk(step, request, num_tokens)
        step.prefill_budget -= num_tokens
        return True

    def _defer_worse_prefills(self, request: Request, num_tokens: int, step: _Step) -> None:
        """Take prefill budget for `request` back from this step's prefill chunks of worse
        ranks, latest first. Deferring loses no KV: those requests continue next step."""
        if step.prefill_budget >= num_tokens:
            return
        rank = request.priority.rank
        for chunk in reversed(list(step.chunks.values())):
            if step.prefill_budget >= num_tokens:
                return
            other = chunk.request
            if chunk.is_decode or other.priority.rank <= rank:
                continue
            num_deferred = min(chunk.num_tokens, num_tokens - step.prefill_budget)
            if num_deferred == chunk.num_tokens:
                del step.chunks[other.request_id]
            else:
                step.chunks[other.request_id] = replace(
                    chunk, num_tokens=chunk.num_tokens - num_deferred
                )
            # Blocks already allocated for the deferred tokens stay with the request.
            other.num_computed_tokens -= num_deferred
            step.num_tokens -= num_deferred
            step.prefill_budget += num_deferred

    def _reserve(self, released: Sequence[Request]) -> int:
        # An idle engine ignores the watermark, or a request needing every block would
        # wait forever.
        return self.config.watermark_blocks if len(self._running) > len(released) else 0

    def _fits(
        self, request: Request, num_tokens: int, hits: list[int], released: Sequence[Request]
    ) -> bool:
        if len(self._running) - len(released) >= self.config.max_num_seqs:
            return False
        bm = self.block_manager
        needed = bm.num_blocks_to_allocate(request, num_tokens, hits, released=released)
        return needed <= bm.num_free_blocks_after_release(released) - self._reserve(released)

    def _choose_victims(
        self, request: Request, num_tokens: int, hits: list[int], step: _Step
    ) -> list[Request] | None:
        """Running preemptible requests of a worse rank whose preemption makes room,
        cheapest to recompute first; None when even all of them would not."""

        def recompute_cost(r: Request) -> tuple[int, int, int]:
            chunk = step.chunks.get(r.request_id)
            computed = chunk.start if chunk is not None else r.num_computed_tokens
            return (computed, -r.priority.rank, -self._order[r.request_id])

        rank = request.priority.rank
        candidates = [r for r in self._running if r.priority.preemptible and r.priority.rank > rank]
        candidates.sort(key=recompute_cost)
        victims: list[Request] = []
        for candidate in candidates:
            victims.append(candidate)
            if self._fits(request, num_tokens, hits, victims):
                return victims
        return None

    def _preempt_for_kv(self, request: Request, step: _Step) -> Request:
        """Free blocks for `request` by preempting the worst-ranked running request that
        ranks no better than it (possibly itself); returns the victim."""
        # `request` is running too, so the worst is never better than it.
        victim = max(self._running, key=self._running_key)
        step.under_kv_pressure = True
        self._preempt(victim, step)
        return victim

    def _preempt(self, request: Request, step: _Step) -> None:
        chunk = step.chunks.pop(request.request_id, None)
        if chunk is not None:
            # Scheduled earlier in this step: undo it, its KV was never written.
            request.num_computed_tokens = chunk.start
            step.num_tokens -= chunk.num_tokens
            if not chunk.is_decode:
                step.prefill_budget += chunk.num_tokens
        bm = self.block_manager
        bm.cache_full_blocks(request)
        bm.free(request)
        lost = request.num_computed_tokens
        self._lost_tokens[request.request_id] = self._lost_tokens.get(request.request_id, 0) + lost
        self._stats = replace(
            self._stats,
            num_preemptions=self._stats.num_preemptions + 1,
            num_preempted_tokens=self._stats.num_preempted_tokens + lost,
        )
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self._running.remove(request)
        bisect.insort(self._waiting, request, key=self._waiting_key)
        step.preempted.append(request)

    def _add_chunk(self, step: _Step, request: Request, num_tokens: int) -> None:
        start = request.num_computed_tokens
        step.chunks[request.request_id] = ScheduledChunk(
            request, start, num_tokens, request.num_tokens
        )
        request.num_computed_tokens = start + num_tokens
        step.num_tokens += num_tokens

    def _running_key(self, request: Request) -> tuple[int, float, int]:
        return (request.priority.rank, request.priority.arrival_s, self._order[request.request_id])

    def _waiting_key(self, request: Request) -> tuple[int, int, float, int]:
        # Preempted victims keep their place ahead of newcomers of their rank.
        newcomer = 0 if request.status is RequestStatus.PREEMPTED else 1
        return (
            request.priority.rank,
            newcomer,
            request.priority.arrival_s,
            self._order[request.request_id],
        )


def _is_yielding(request: Request) -> bool:
    """Throughput work: it gives its decode slot up when a TPOT SLO needs the time."""
    return request.priority.preemptible and request.priority.tpot_slo_ms is None
