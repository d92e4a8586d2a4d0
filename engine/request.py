"""Request state shared by the step scheduler, the block manager and the runner.

No torch here: the policy parts of the engine must import (and be simulated) anywhere.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError

# OpenAI's ranges: penalties in [-2, 2], a logit bias in [-100, 100] (+-100 in effect
# forces or bans a token).
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_REPETITION_PENALTY = 2.0  # vLLM's bound
# vLLM takes any positive penalty; a tiny one divides positive logits into float32's
# overflow (inf, then NaN probabilities: garbage tokens). A hundredfold is far past any
# use: 0.5 already makes a model loop.
MIN_REPETITION_PENALTY = 0.01
MAX_TOP_LOGPROBS = 20  # OpenAI's cap on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (its own distribution: before
    temperature, penalties, bias and top-k/top-p, as OpenAI and vLLM report it), and the
    `top` most likely tokens' (id, log-probability), most likely first.

    `num_text_chars` is how much output text the step that made it released: where the
    next token starts in the text (a token holding part of a character, or a special
    token, releases none; a stop string cuts it).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    num_text_chars: int = 0


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output; validated on construction."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Subtracted from a token's logit: presence once it has appeared in the output,
    # frequency once per appearance (OpenAI's definition; output tokens only).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # (token id, bias added to its logit) pairs, sorted by id; a mapping is accepted.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's extensions. min_p: after temperature, top-k and top-p, a token less likely
    # than min_p x the most likely one is not sampled. repetition_penalty: every token
    # of the prompt or the output so far has its logit divided by it where positive and
    # multiplied by it where not (HF's and vLLM's definition; 1 is off). min_tokens:
    # until this many tokens are out, eos, stop_token_ids and stop strings end nothing.
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    # None: no log-probabilities; n: each sampled token's, with the n most likely.
    logprobs: int | None = None
    # None: none for the prompt; n: each prompt token's after the first (the model's
    # prediction of it from the tokens before), with the n most likely there.
    prompt_logprobs: int | None = None

    @property
    def can_stop_early(self) -> bool:
        """Whether anything but max_tokens (or the context's end) can end the request:
        end of sequence, a stop string or token. Not so with a load generator's
        `ignore_eos` alone."""
        return not self.ignore_eos or bool(self.stop) or bool(self.stop_token_ids)

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequestError("max_tokens must be an integer", param="max_tokens")
        if self.max_tokens <= 0:
            raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
        if not _is_finite_number(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                "temperature must be a finite number >= 0", param="temperature"
            )
        if not _is_finite_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p must be in (0, 1]", param="top_p")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError("top_k must be an integer >= 0", param="top_k")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise InvalidRequestError("seed must be an integer", param="seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must hold non-empty strings", param="stop")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be token ids", param="stop_token_ids")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite_number(value) or abs(value) > MAX_PENALTY:
                raise InvalidRequestError(
                    f"{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}", param=name
                )
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if not _is_finite_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p must be in [0, 1]", param="min_p")
        if (
            not _is_finite_number(self.repetition_penalty)
            or not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY
        ):
            raise InvalidRequestError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}]",
                param="repetition_penalty",
            )
        if (
            isinstance(self.min_tokens, bool)
            or not isinstance(self.min_tokens, int)
            or not 0 <= self.min_tokens <= self.max_tokens
        ):
            raise InvalidRequestError(
                "min_tokens must be an integer from 0 to max_tokens", param="min_tokens"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= MAX_TOP_LOGPROBS
            ):
                raise InvalidRequestError(
                    f"{name} must be an integer from 0 to {MAX_TOP_LOGPROBS}", param=name
                )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads the request's output so far (its token counts)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """`value` (a mapping, or pairs as JSON brings them back) as sorted (id, bias) pairs."""
    pairs = value.items() if isinstance(value, Mapping) else value
    malformed = InvalidRequestError("logit_bias must map token ids to biases", param="logit_bias")
    try:
        pairs = [tuple(pair) for pair in pairs]  # type: ignore[union-attr]
    except TypeError:
        raise malformed from None
    out = {}
    for pair in pairs:
        if len(pair) != 2:
            raise malformed
        token, bias = pair
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidRequestError("logit_bias keys must be token ids", param="logit_bias")
        if not _is_finite_number(bias) or abs(bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias values must be between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}",
                param="logit_bias",
            )
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _is_finite_number(value: object) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer beyond float's range
        return False


@dataclass(frozen=True)
class Priority:
    """What the step scheduler knows about who a request belongs to.

    rank 0 is most important. tenant is opaque to the engine (fair share between tenants
    is the queue's job). arrival_s is on the engine clock (monotonic seconds).
    """

    rank: int = 0
    tenant: str = ""
    arrival_s: float = 0.0
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    preemptible: bool = True


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, recomputes its KV when resumed
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # eos, stop token id or stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # the client went away or the caller aborted


@dataclass(eq=False)
class Request:
    """One sequence's mutable state inside the engine.

    The KV cache holds `num_computed_tokens` tokens of `all_token_ids`; the step
    scheduler advances it, the block manager owns `block_ids`.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: Priority = field(default_factory=Priority)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    block_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    # The runner's count of output tokens per vocabulary id (engine.sampling's
    # OutputCounts), made for a request with penalties and kept across steps.
    output_counts: Any = field(default=None, repr=False)
    # The runner's mask of the vocabulary ids in the prompt (engine.sampling's
    # prompt_mask), made once for a request with a repetition penalty. The prompt never
    # changes: resumed tokens and a recompute after preemption are output tokens.
    prompt_mask: Any = field(default=None, repr=False)
    # For a request that asks for logprobs: the runner leaves the one of the token it
    # just sampled here, and the engine appends it to output_logprobs (which then holds
    # one per output token made by this engine: a resumed request's earlier tokens have
    # none here).
    new_logprob: TokenLogprob | None = field(default=None, repr=False)
    output_logprobs: list[TokenLogprob] = field(default_factory=list, repr=False)
    # For a request that asks for prompt_logprobs: the runner appends those of prompt
    # tokens 1, 2, ... as their prefill chunks run (a recompute adds none twice); they
    # go out with the first output.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list, repr=False)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prefill still has prompt log-probabilities to compute: the request
        asks for them and not every prompt token after the first has its own yet."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_range(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without building all of it (a step reads a block's
        or a chunk's worth of a long sequence, not the whole sequence)."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """True while tokens before the last one still lack KV (prompt or recompute)."""
        return self.num_computed_tokens < self.num_tokens - 1
