"""The synchronous engine: requests in, one step at a time, incremental outputs out.

`step()` reads as schedule -> run -> postprocess. The step scheduler and block manager
(pure Python) decide what runs; the model runner runs it; postprocessing appends the
sampled tokens, detokenizes, checks stop conditions and retires finished requests.
Not thread-safe: AsyncEngine drives it from one thread.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.cost_model import StepCostModel
from engine.errors import ContextLengthExceededError, InvalidRequestError, ModelLoadError
from engine.model_runner import ModelRunner, kv_cache_budget_bytes, num_kv_blocks
from engine.models import load_model
from engine.phase_rates import PhaseRates
from engine.request import FinishReason, Priority, Request, SamplingParams, TokenLogprob
from engine.step_scheduler import SchedulerConfig, StepPlan, StepScheduler
from engine.stop_hazard import StopCurve, StopHazard, age_bucket, new_step_counts
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class RequestOutput:
    """A request's state after a step: this step's delta, plus the cumulative ids and
    text so far (`token_ids`, `text`).

    The cumulative fields are built when read, from the request's own append-only lists
    and this output's lengths: copied into every output, they cost O(length) per
    request per step, O(length²) over a long generation, for values that streaming
    callers never read.
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_output_tokens: int
    # The request's output ids and text deltas, appended to after this output was made.
    output_ids_so_far: list[int] = field(repr=False, compare=False)
    text_pieces_so_far: list[str] = field(repr=False, compare=False)
    num_text_pieces: int = field(repr=False)
    # This step's token's log-probability, for a request that asks for logprobs.
    new_logprobs: tuple[TokenLogprob, ...] = ()
    logprobs_so_far: list[TokenLogprob] = field(default_factory=list, repr=False, compare=False)
    num_logprobs: int = field(default=0, repr=False)
    # The prompt tokens' log-probabilities (from the second token on), in the request's
    # first output only, for a request that asks for them.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Every output token so far."""
        return self.output_ids_so_far[: self.num_output_tokens]

    @property
    def text(self) -> str:
        """The text sent so far (the joined text deltas)."""
        return "".join(self.text_pieces_so_far[: self.num_text_pieces])

    @property
    def logprobs(self) -> list[TokenLogprob]:
        """The log-probabilities of the output tokens so far (made by this engine)."""
        return self.logprobs_so_far[: self.num_logprobs]


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float  # fraction of blocks in use
    num_preemptions: int
    num_recomputed_tokens: int
    prefill_tokens_per_s: float  # measured, smoothed; mixed steps split by the cost model
    decode_tokens_per_s: float
    step_token_budget: int
    num_steps: int
    # Held work per request rank (see StepScheduler.backlog): workers publish it so that
    # admission sees the backlog that left the queue.
    unprefilled_tokens_by_rank: dict[int, int] = field(default_factory=dict)
    decode_tokens_by_rank: dict[int, int] = field(default_factory=dict)
    # When the slots free, and who need not wait for one (RankBacklog): workers publish
    # them for SLO admission (scheduler.slot_release).
    running_left: tuple[tuple[int, int, bool], ...] = ()
    preemptible_by_rank: dict[int, int] = field(default_factory=dict)
    waiting_by_rank: dict[int, int] = field(default_factory=dict)
    stop_hazard: float = 0.0  # per token, of requests able to stop early (0: unmeasured)
    # The same by age (tokens made so far): what running_left's requests are expected to do.
    stop_curve: StopCurve = field(default_factory=StopCurve)


@dataclass
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer
    text_pieces: list[str] = field(default_factory=list)  # the non-empty deltas sent
    # The request asks for its prompt's log-probabilities and they are not sent yet.
    owes_prompt_logprobs: bool = False
    # SamplingParams.can_stop_early, read once: every step asks it of every token.
    can_stop_early: bool = True

    def output(
        self,
        new_token_ids: list[int],
        text_delta: str,
        finish_reason: FinishReason | None,
        new_logprobs: tuple[TokenLogprob, ...] = (),
    ) -> RequestOutput:
        request = self.request
        if text_delta:
            self.text_pieces.append(text_delta)
        request.output_logprobs.extend(new_logprobs)
        prompt_logprobs = None
        if self.owes_prompt_logprobs and new_token_ids:
            # With the first token made, the whole prompt has been computed.
            self.owes_prompt_logprobs = False
            prompt_logprobs = tuple(request.prompt_logprobs)
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            new_token_ids=new_token_ids,
            text_delta=text_delta,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=len(request.output_token_ids),
            output_ids_so_far=request.output_token_ids,
            text_pieces_so_far=self.text_pieces,
            num_text_pieces=len(self.text_pieces),
            new_logprobs=new_logprobs,
            logprobs_so_far=request.output_logprobs,
            num_logprobs=len(request.output_logprobs),
            prompt_logprobs=prompt_logprobs,
        )


class LLMEngine:
    """Loads the model and runs continuous batches over a paged KV cache."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        loaded = load_model(config.model, config.device, config.dtype)
        self.tokenizer = Tokenizer(config.model)
        self.model_name = config.model
        arch = loaded.arch
        self.vocab_size = arch.vocab_size
        max_model_len = min(
            config.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings
        )
        if arch.sliding_window is not None:
            # Sliding-window attention is not implemented: stay inside one window.
            max_model_len = min(max_model_len, arch.sliding_window)
        if not config.enable_chunked_prefill:
            max_model_len = min(max_model_len, config.max_num_batched_tokens)
        bytes_per_token = arch.kv_bytes_per_token(loaded.dtype.itemsize)
        budget = kv_cache_budget_bytes(
            loaded.device,
            config.kv_cache_bytes,
            config.gpu_memory_utilization,
            needed_bytes=config.max_num_seqs * max_model_len * bytes_per_token,
        )
        num_blocks = num_kv_blocks(arch, config.block_size, loaded.dtype, budget)
        self.runner = ModelRunner(
            loaded,
            block_size=config.block_size,
            num_blocks=num_blocks,
            seed=config.seed,
            eos_token_ids=self.tokenizer.eos_token_ids,
        )
        self.max_model_len = min(max_model_len, num_blocks * config.block_size)
        try:
            scheduler_config = SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_prefill_chunk_tokens=config.max_prefill_chunk_tokens
                or config.max_num_batched_tokens,
                enable_chunked_prefill=config.enable_chunked_prefill,
                max_model_len=self.max_model_len,
            )
        except ValueError as exc:
            raise InvalidRequestError(f"bad engine configuration: {exc}") from exc
        if num_blocks <= scheduler_config.watermark_blocks:
            # The scheduler takes a request only while more blocks than the watermark are
            # free: such an engine would start and then never take any work.
            raise ModelLoadError(
                f"the KV cache budget holds {num_blocks} blocks; at least "
                f"{scheduler_config.watermark_blocks + 1} are needed (raise kv_cache_bytes)"
            )
        self.block_manager = BlockManager(
            num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.cost_model = StepCostModel()
        self.scheduler = StepScheduler(
            scheduler_config, self.block_manager, cost_model=self.cost_model
        )
        self._tracked: dict[str, _Tracked] = {}
        self._rates = PhaseRates(self.cost_model)
        self._stop_hazard = StopHazard()

    # ----------------------------------------------------------------- requests
    def validate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        resumed_token_ids: Sequence[int] = (),
    ) -> None:
        """Raise the typed error `add_request` would raise; reads only immutable state,
        so another thread may call it."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be SamplingParams", param="params")
        if len(prompt_token_ids) == 0:
            raise InvalidRequestError("the prompt must hold at least one token", param="prompt")
        if len(resumed_token_ids) >= params.max_tokens:
            raise InvalidRequestError(
                "the resumed tokens already reach max_tokens", param="max_tokens"
            )
        for token in itertools.chain(prompt_token_ids, resumed_token_ids):
            if isinstance(token, bool) or not isinstance(token, int):
                raise InvalidRequestError("token ids must be integers", param="prompt")
            if not 0 <= token < self.vocab_size:
                raise InvalidRequestError(
                    f"token id {token} is outside the vocabulary [0, {self.vocab_size})",
                    param="prompt",
                )
        for token, _ in params.logit_bias:
            if token >= self.vocab_size:
                raise InvalidRequestError(
                    f"logit_bias token id {token} is outside the vocabulary [0, {self.vocab_size})",
                    param="logit_bias",
                )
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                num_prompt_tokens=len(prompt_token_ids),
                max_tokens=params.max_tokens,
                max_model_len=self.max_model_len,
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        priority: Priority | None = None,
        *,
        resumed_token_ids: Sequence[int] = (),
    ) -> None:
        """Queue a request; raises a typed error (and changes nothing) if it cannot run.

        `resumed_token_ids` are output tokens an earlier run already sent (a job whose
        lease moved here): generation continues after them, they count toward
        max_tokens and appear in `token_ids`, but not in `text` or any delta.
        """
        self.validate(prompt_token_ids, params, resumed_token_ids)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            priority=priority or Priority(arrival_s=time.monotonic()),
            output_token_ids=list(resumed_token_ids),
        )
        self.scheduler.add(request)
        detokenizer = self.tokenizer.detokenizer(prompt_token_ids, params.stop)
        # Replay the resumed tokens as the earlier run added them (one per step), so the
        # text it still held back (a character split across tokens, a possible stop
        # string's start) is sent from here, not lost at the hand-over.
        for num_output, token in enumerate(resumed_token_ids, 1):
            detokenizer.add([token], is_last=False, check_stop=num_output >= params.min_tokens)
        self._tracked[request_id] = _Tracked(
            request,
            detokenizer,
            owes_prompt_logprobs=params.prompt_logprobs is not None,
            can_stop_early=params.can_stop_early,
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Drop a request wherever it is and free its blocks. Returns its final output
        (finish_reason "abort"), or None if the id is unknown or already finished."""
        tracked = self._tracked.pop(request_id, None)
        if self.scheduler.abort(request_id) is None or tracked is None:
            return None
        return tracked.output([], "", FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def can_accept(self, rank: int | None = None) -> bool:
        return self.scheduler.can_accept(rank)

    def newcomer_room(self) -> tuple[int, int]:
        return self.scheduler.newcomer_room()

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that made a token."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        started_s = time.perf_counter()
        tokens = self.runner.execute(plan.chunks)
        elapsed_s = time.perf_counter() - started_s
        outputs = self._postprocess(plan, tokens)
        self._record(plan, elapsed_s)
        return outputs

    def _postprocess(self, plan: StepPlan, tokens: list[int | None]) -> list[RequestOutput]:
        outputs = []
        now_s = time.monotonic()
        eos_ids = self.tokenizer.eos_token_ids
        # Per age bucket: tokens of requests able to stop early, and stops among them.
        step_tokens, step_stops = new_step_counts(), new_step_counts()
        for chunk, token in zip(plan.chunks, tokens, strict=True):
            tracked = self._tracked.get(chunk.request.request_id)
            if token is None or tracked is None:
                continue
            request = tracked.request
            params = request.params
            request.output_token_ids.append(token)
            if request.first_token_s is None:
                request.first_token_s = now_s
            reason = None
            # Before min_tokens only the length ends a request: its stop tokens are kept
            # from being sampled, and a stop string in its text is ordinary text.
            can_stop = request.num_output_tokens >= params.min_tokens
            is_stop_token = can_stop and token in params.stop_token_ids
            if is_stop_token or (can_stop and not params.ignore_eos and token in eos_ids):
                reason = FinishReason.STOP
            elif (
                request.num_output_tokens >= params.max_tokens
                or request.num_tokens >= self.max_model_len
            ):
                reason = FinishReason.LENGTH
            # A stop token ends the text before it, as a stop string does (and vLLM's
            # stop_token_ids): only the text held back is released.
            delta = tracked.detokenizer.add(
                [] if is_stop_token else [token], is_last=reason is not None, check_stop=can_stop
            )
            if delta.stopped:
                reason = FinishReason.STOP
            if tracked.can_stop_early:
                bucket = age_bucket(request.num_output_tokens - 1)
                step_tokens[bucket] += 1
                if reason is FinishReason.STOP:
                    step_stops[bucket] += 1
            if reason is not None:
                self.scheduler.finish(request, reason)
                del self._tracked[request.request_id]
            logprob, request.new_logprob = request.new_logprob, None
            new_logprobs = ()
            if logprob is not None:
                new_logprobs = (replace(logprob, num_text_chars=len(delta.text)),)
            outputs.append(tracked.output([token], delta.text, reason, new_logprobs))
        self._stop_hazard.record(step_tokens, step_stops)
        return outputs

    def _record(self, plan: StepPlan, elapsed_s: float) -> None:
        num_seqs = len(plan.chunks)
        self.cost_model.observe(plan.num_batched_tokens, num_seqs, elapsed_s)
        num_decode = sum(1 for c in plan.chunks if c.is_decode)
        # Mixed steps are split between the phases by the fit just updated.
        self._rates.record(plan.num_batched_tokens - num_decode, num_decode, num_seqs, elapsed_s)

    def stats(self) -> EngineStats:
        scheduler_stats = self.scheduler.stats
        backlog = self.scheduler.backlog(self._stop_hazard.curve)
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_free_blocks=self.block_manager.num_free_blocks,
            num_total_blocks=self.block_manager.num_blocks,
            kv_cache_usage=self.block_manager.usage(),
            num_preemptions=scheduler_stats.num_preemptions,
            num_recomputed_tokens=scheduler_stats.num_recomputed_tokens,
            prefill_tokens_per_s=self._rates.prefill_tokens_per_s,
            decode_tokens_per_s=self._rates.decode_tokens_per_s,
            step_token_budget=self.scheduler.config.max_num_batched_tokens,
            num_steps=scheduler_stats.num_steps,
            unprefilled_tokens_by_rank=backlog.unprefilled_tokens_by_rank,
            decode_tokens_by_rank=backlog.decode_tokens_by_rank,
            running_left=backlog.running_left,
            preemptible_by_rank=backlog.preemptible_by_rank,
            waiting_by_rank=backlog.waiting_by_rank,
            stop_hazard=self._stop_hazard.per_token,
            stop_curve=self._stop_hazard.curve,
        )
