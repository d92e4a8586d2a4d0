"""How often a request that can stop early (end of sequence, a stop string or token) does
stop, per generated token and by how far into its output it is: measured by the engine
over its recent requests, so that admission can tell when running requests will free
their slots (scheduler.slot_release) and how much of their max_tokens they will use.

A chat limited to 1,500 tokens that stops after 590 on average frees its slot long
before its max_tokens; a model or a workload that rarely stops shows a hazard near 0,
and the max_tokens bounds decide.

The hazard is kept per age (tokens generated so far) in doubling buckets, because real
output lengths are heavy-tailed: most chats stop after a few hundred tokens, and the one
that has already run for 2,000 is likely to run on. One hazard for every age (a
geometric length) expected that chat to stop as soon as a fresh one, and admission let
priority requests wait behind it past their TTFT SLO.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Age buckets: [0, 16), [16, 32), [32, 64), ... doubling; the last is open-ended.
NUM_BUCKETS = 12
FIRST_EDGE_BITS = 4  # the first bucket ends at 2**4 tokens
# Tokens after which an observation weighs half: recent requests, not the first ones.
# Long enough that the rare old ages (the tail) gather a few stops each: about 200 recent
# chats of 300 tokens, some seconds of a GPU's output, a minute or so of a CPU's.
HALF_LIFE_TOKENS = 65_536
# Tokens observed before the hazard is reported at all (unmeasured until then: bounds only).
MIN_TOKENS = 256
# Each bucket's hazard is pulled towards the overall one as if it had seen this many
# stops at that rate: an age seen only a few times says little on its own.
PRIOR_STOPS = 2.0
# A hazard of 1 (every token stops) would make the survival's logarithm infinite.
_MAX_HAZARD = 1.0 - 1e-9


def age_bucket(age: int) -> int:
    """The bucket of the token a request makes after `age` tokens of output."""
    bucket = age.bit_length() - FIRST_EDGE_BITS
    if bucket <= 0:
        return 0
    return bucket if bucket < NUM_BUCKETS else NUM_BUCKETS - 1


def bucket_start(bucket: int) -> int:
    """The first age of `bucket`."""
    return 0 if bucket == 0 else 1 << (bucket + FIRST_EDGE_BITS - 1)


class StopCurve:
    """Per-age stop hazards, and what follows from them for one running request: how
    likely it is to go on past a given age and the tokens it is expected to generate.
    Empty: unmeasured."""

    def __init__(self, hazards: Sequence[float] = ()) -> None:
        self.hazards = tuple(min(max(h, 0.0), _MAX_HAZARD) for h in hazards)
        if self.hazards and (len(self.hazards) != NUM_BUCKETS or min(self.hazards) <= 0):
            raise ValueError(f"a measured curve has {NUM_BUCKETS} hazards, all above 0")
        # Per bucket: log-survival from age 0 to its start, and the tokens expected from
        # its start on (for a request alive there), built from the last bucket back.
        n = len(self.hazards)
        self._log_keep = [math.log1p(-h) for h in self.hazards]
        self._log_survival_at_start = [0.0] * n
        for b in range(1, n):
            width = bucket_start(b) - bucket_start(b - 1)
            self._log_survival_at_start[b] = (
                self._log_survival_at_start[b - 1] + width * self._log_keep[b - 1]
            )
        self._tokens_from_start = [0.0] * n
        if n:
            self._tokens_from_start[-1] = 1.0 / self.hazards[-1]
        for b in range(n - 2, -1, -1):
            width = bucket_start(b + 1) - bucket_start(b)
            keep = math.exp(width * self._log_keep[b])
            self._tokens_from_start[b] = (1.0 - keep) / self.hazards[b] + (
                keep * self._tokens_from_start[b + 1]
            )

    @property
    def is_measured(self) -> bool:
        return bool(self.hazards)

    def survival_tables(self) -> tuple[list[int], list[float], list[float]]:
        """(each bucket's first age, log-survival to it, log(1 - its hazard)): what
        log_survival reads, for callers that evaluate it in a tight loop."""
        starts = [bucket_start(b) for b in range(len(self.hazards))]
        return starts, self._log_survival_at_start, self._log_keep

    def log_survival(self, age: int) -> float:
        """log P(a request goes on past `age` tokens of output) (the curve must be measured)."""
        b = age_bucket(age)
        return self._log_survival_at_start[b] + (age - bucket_start(b)) * self._log_keep[b]

    def tokens_left(self, age: int) -> float:
        """Tokens a request that has made `age` expects to make before it stops, with no
        max_tokens to end it (the curve must be measured)."""
        b = age_bucket(age)
        if b == NUM_BUCKETS - 1:
            return 1.0 / self.hazards[b]
        keep = math.exp((bucket_start(b + 1) - age) * self._log_keep[b])
        return (1.0 - keep) / self.hazards[b] + keep * self._tokens_from_start[b + 1]

    def expected_tokens_left(self, age: int, max_left: int) -> float:
        """The tokens a request that may stop early and has made `age` is expected to
        generate, of the `max_left` its max_tokens allows (unmeasured: all of them)."""
        if max_left <= 0:
            return 0.0
        if not self.hazards:
            return float(max_left)
        end = age + max_left
        # E[min(T, max_left)] = E[T] - P(alive at the bound) x E[T after the bound].
        survival = math.exp(self.log_survival(end) - self.log_survival(age))
        return self.tokens_left(age) - survival * self.tokens_left(end)


class StopHazard:
    """Stops per generated token of requests able to stop early, by age bucket,
    exponentially weighted towards recent tokens."""

    def __init__(self) -> None:
        self._tokens = [0.0] * NUM_BUCKETS
        self._stops = [0.0] * NUM_BUCKETS
        self._seen = 0
        self._curve: StopCurve | None = None

    def record(self, tokens_by_bucket: Sequence[int], stops_by_bucket: Sequence[int]) -> None:
        """One step: per age bucket, the tokens generated by requests able to stop early
        and how many of those tokens ended their request (not at max_tokens: the bound
        counts that)."""
        num_tokens = sum(tokens_by_bucket)
        if num_tokens <= 0:
            return
        keep = 0.5 ** (num_tokens / HALF_LIFE_TOKENS)
        tokens, stops = self._tokens, self._stops
        for b in range(NUM_BUCKETS):
            tokens[b] = tokens[b] * keep + tokens_by_bucket[b]
            stops[b] = stops[b] * keep + stops_by_bucket[b]
        self._seen += num_tokens
        self._curve = None

    @property
    def per_token(self) -> float:
        """The probability of a stop at a given token, over all ages (0: not measured)."""
        total = sum(self._tokens)
        if self._seen < MIN_TOKENS or total <= 0:
            return 0.0
        return sum(self._stops) / total

    @property
    def curve(self) -> StopCurve:
        """The hazard per age bucket, each pulled towards the overall one by PRIOR_STOPS
        (an empty curve while unmeasured, or while nothing has stopped yet)."""
        if self._curve is None:
            overall = self.per_token
            hazards: tuple[float, ...] = ()
            if overall > 0:
                prior_tokens = PRIOR_STOPS / overall
                hazards = tuple(
                    (stops + PRIOR_STOPS) / (tokens + prior_tokens)
                    for tokens, stops in zip(self._tokens, self._stops, strict=True)
                )
            self._curve = StopCurve(hazards)
        return self._curve


def new_step_counts() -> list[int]:
    """Per-bucket counters for one step's record."""
    return [0] * NUM_BUCKETS


def count_ages(counts: list[int], first_age: int, num_tokens: int) -> None:
    """Add to `counts` (per age bucket) the tokens a request made at ages first_age on:
    several steps' worth at once."""
    age, end = first_age, first_age + num_tokens
    while age < end:
        bucket = age_bucket(age)
        edge = bucket_start(bucket + 1) if bucket + 1 < NUM_BUCKETS else end
        upto = min(edge, end)
        counts[bucket] += upto - age
        age = upto
