"""Measured prefill and decode rates of one engine, as workers publish them for admission.

Admission predicts a job's wait as prompt tokens ahead / prefill rate plus a fraction of
decode tokens ahead / decode rate, so the two rates mean:

- prefill: prompt tokens per second of wall time while prompts saturate the engine,
  decodes interleaved in the same steps included (a prompt queued behind others waits
  for those decodes too). Sampled on steps whose tokens are mostly prompt.
- decode: generated tokens per second of the decodes alone. Under load almost every step
  mixes prefill chunks with decodes (an engine held at max_num_seqs admits a new request
  each time one finishes), so sampling only pure-decode steps left this rate at its
  first sample. Each step's measured time is split instead by the online step cost
  model: prompt tokens are charged their marginal cost (the fitted seconds per token),
  the decodes the rest, fixed overhead included. Until the model has a fit, only pure
  decode steps are sampled.

Pure Python, shared by the engine and the simulator.
"""

from __future__ import annotations

import math

from engine.cost_model import StepCostModel

# Weight of the newest step in the rates (exponential average): steps are noisy.
RATE_SMOOTHING = 0.1


class PhaseRates:
    """Prefill and decode tokens per second, smoothed over measured steps (0 = unknown)."""

    def __init__(self, cost_model: StepCostModel | None = None) -> None:
        """`cost_model` is the engine's fitted model (already fed each step), or None to
        sample the decode rate on pure decode steps only."""
        self._cost_model = cost_model
        self.prefill_tokens_per_s = 0.0
        self.decode_tokens_per_s = 0.0

    def record(
        self, num_prefill_tokens: int, num_decode_tokens: int, num_seqs: int, step_s: float
    ) -> None:
        """Account one executed step of this many prompt tokens and decodes."""
        if not math.isfinite(step_s) or step_s <= 0:
            return
        if num_prefill_tokens > num_decode_tokens:
            self.prefill_tokens_per_s = _smooth(
                self.prefill_tokens_per_s, num_prefill_tokens / step_s
            )
        if num_decode_tokens == 0:
            return
        decode_s = step_s
        if num_prefill_tokens:
            prefill_s = self._prefill_share_s(
                num_prefill_tokens, num_decode_tokens, num_seqs, step_s
            )
            if prefill_s is None:
                return
            decode_s -= prefill_s
        if decode_s > 0:
            self.decode_tokens_per_s = _smooth(
                self.decode_tokens_per_s, num_decode_tokens / decode_s
            )

    def _prefill_share_s(
        self, num_prefill: int, num_decode: int, num_seqs: int, step_s: float
    ) -> float | None:
        """The part of a mixed step's measured time the prompt tokens cost, by the fit."""
        model = self._cost_model
        if model is None or not model.is_ready:
            return None
        predicted_s = model.predict(num_prefill + num_decode, num_seqs)
        if predicted_s <= 0:
            return None
        # A fit in which time does not grow with tokens (a noisy machine) makes prompt
        # tokens free: the decodes, which pay the overhead anyway, get the whole step.
        seconds_per_token = max(0.0, model.coefficients[1])
        return min(1.0, seconds_per_token * num_prefill / predicted_s) * step_s


def _smooth(previous: float, sample: float) -> float:
    if previous == 0.0:
        return sample
    return (1 - RATE_SMOOTHING) * previous + RATE_SMOOTHING * sample
