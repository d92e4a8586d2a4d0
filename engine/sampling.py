"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds,
logit bias, presence/frequency/repetition penalties and min_tokens.

Sampling uses the exponential-race form of the categorical draw (argmax of p / E with
E ~ Exp(1)), so a seeded row only needs its own noise: the noise of a request with a
seed comes from a generator keyed by (seed, output position), which makes its output
independent of the batch it shares and of preemption.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from engine.request import SamplingParams, TokenLogprob

_NOISE_FLOOR = 1e-10  # keeps the exponential noise away from zero (division below)
# Temperatures below this sample greedily (vLLM uses the same cut-off). Dividing float32
# logits by a temperature under ~1e-38 overflows to inf and the softmax to NaN; and well
# before that the distribution is already one-hot: at 1e-5 a logit gap of 1e-3 is a
# factor e^100 in probability.
_MIN_TEMPERATURE = 1e-5


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_positions: Sequence[int],
    generator: torch.Generator | None = None,
    output_counts: Sequence[torch.Tensor | None] | None = None,
    prompt_masks: Sequence[torch.Tensor | None] | None = None,
    eos_token_ids: Collection[int] = (),
) -> list[int]:
    """One token id per row of `logits` `[N, vocab]` (float32).

    output_positions[i] is how many tokens row i's request has generated so far; it keys
    the noise of seeded requests and tells whether min_tokens still bans its stop
    tokens (`eos_token_ids`, unless it ignores eos, and its stop_token_ids). `generator`
    draws the noise of unseeded ones. output_counts[i] counts those tokens per
    vocabulary id (`OutputCounts`); it is read only for a row with penalties.
    prompt_masks[i] marks the ids in row i's prompt (`prompt_mask`); it is read only for
    a row with a repetition penalty.
    """
    if logits.shape[0] == 0:
        return []
    logits = _adjust_logits(
        logits, params, output_positions, output_counts, prompt_masks, eos_token_ids
    )
    is_greedy = [_is_greedy(p) for p in params]
    if all(is_greedy):
        return logits.argmax(dim=-1).tolist()
    device = logits.device
    temperatures = torch.tensor(
        [1.0 if greedy else p.temperature for p, greedy in zip(params, is_greedy, strict=True)],
        dtype=torch.float32,
        device=device,
    )
    logits = logits / temperatures[:, None]
    if any(p.top_k > 0 for p in params) or any(p.top_p < 1.0 for p in params):
        logits = _apply_top_k_top_p(logits, params)
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0.0 for p in params):
        probs = _apply_min_p(probs, params)
    noise = _exponential_noise(probs, params, output_positions, generator)
    sampled = (probs / noise).argmax(dim=-1)
    greedy_rows = [i for i, greedy in enumerate(is_greedy) if greedy]
    if greedy_rows:
        rows = torch.tensor(greedy_rows, device=device)
        sampled[rows] = logits[rows].argmax(dim=-1)
    return sampled.tolist()


def _adjust_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_positions: Sequence[int],
    output_counts: Sequence[torch.Tensor | None] | None,
    prompt_masks: Sequence[torch.Tensor | None] | None,
    eos_token_ids: Collection[int],
) -> torch.Tensor:
    """Logit bias, penalties and min_tokens' bans, before temperature (they steer greedy
    rows too), in vLLM's order: bias, repetition penalty (it scales, so it comes after
    the bias), then the additive presence and frequency penalties, then the bans (-inf
    whatever came before). Returns `logits` itself when no row asks for any."""
    # One pass over the rows: this runs every step for every batch, adjusted or not.
    biased, penalized, banned = [], [], []
    for i, p in enumerate(params):
        if p.logit_bias:
            biased.append(i)
        if p.has_penalties:
            penalized.append(i)
        if p.min_tokens > output_positions[i] and (p.stop_token_ids or not p.ignore_eos):
            banned.append(i)
    if not biased and not penalized and not banned:
        return logits
    logits = logits.clone()
    device = logits.device
    if biased:
        rows = [i for i in biased for _ in params[i].logit_bias]
        cols = [token for i in biased for token, _ in params[i].logit_bias]
        bias = [b for i in biased for _, b in params[i].logit_bias]
        logits.index_put_(
            (torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
            torch.tensor(bias, dtype=logits.dtype, device=device),
            accumulate=True,
        )
    if penalized:
        if output_counts is None or any(output_counts[i] is None for i in penalized):
            raise ValueError("penalties need each row's output token counts")
        counts = torch.stack([output_counts[i] for i in penalized]).to(logits.dtype)
        repeated = [n for n, i in enumerate(penalized) if params[i].repetition_penalty != 1.0]
        if repeated:
            _apply_repetition_penalty(logits, params, penalized, repeated, counts, prompt_masks)
        frequency = torch.tensor(
            [params[i].frequency_penalty for i in penalized], dtype=logits.dtype, device=device
        )
        presence = torch.tensor(
            [params[i].presence_penalty for i in penalized], dtype=logits.dtype, device=device
        )
        rows = torch.tensor(penalized, device=device)
        logits[rows] -= counts * frequency[:, None] + (counts > 0) * presence[:, None]
    if banned:
        vocab_size = logits.shape[-1]
        rows, cols = [], []  # of the -inf entries
        for i in banned:
            p = params[i]
            stop_ids = (
                set(p.stop_token_ids) if p.ignore_eos else {*p.stop_token_ids, *eos_token_ids}
            )
            # An id past the model's vocabulary is never sampled: nothing to ban.
            ids = [token for token in stop_ids if token < vocab_size]
            rows += [i] * len(ids)
            cols += ids
        if rows:
            index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
            logits[index] = float("-inf")
    return logits


def _apply_repetition_penalty(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    penalized: list[int],
    repeated: list[int],
    counts: torch.Tensor,
    prompt_masks: Sequence[torch.Tensor | None] | None,
) -> None:
    """Scale, in place, the logits of the tokens in the prompt or the output of the rows
    `penalized[n]` for n in `repeated` (`counts` are the penalized rows' output counts).
    Presence is a set: a token in both, or many times, is scaled once."""
    rows = [penalized[n] for n in repeated]
    if prompt_masks is None or any(prompt_masks[i] is None for i in rows):
        raise ValueError("a repetition penalty needs each row's prompt mask")
    device = logits.device
    seen = torch.stack([prompt_masks[i] for i in rows])
    if len(repeated) < len(penalized):
        seen |= counts[torch.tensor(repeated, device=device)] > 0
    else:
        seen |= counts > 0
    penalty = torch.tensor(
        [params[i].repetition_penalty for i in rows], dtype=logits.dtype, device=device
    )[:, None]
    index = torch.tensor(rows, device=device)
    row_logits = logits[index]
    scaled = torch.where(row_logits > 0, row_logits / penalty, row_logits * penalty)
    logits[index] = torch.where(seen, scaled, row_logits)


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], num_top: Sequence[int | None]
) -> list[TokenLogprob | None]:
    """Per row of `logits` (the model's, unadjusted): the log-probability of the token
    sampled for it and its `num_top[i]` most likely tokens, or None where num_top[i] is
    None. One log-softmax and one top-k over the rows that ask."""
    rows = [i for i, n in enumerate(num_top) if n is not None]
    if not rows:
        return [None] * len(tokens)
    device = logits.device
    logprobs = logits[torch.tensor(rows, device=device)].float().log_softmax(dim=-1)
    chosen_ids = torch.tensor([tokens[i] for i in rows], device=device)
    chosen = logprobs.gather(1, chosen_ids[:, None])[:, 0].tolist()
    k = max(num_top[i] or 0 for i in rows)
    if k:
        top_values, top_ids = (t.tolist() for t in logprobs.topk(k, dim=-1))
    out: list[TokenLogprob | None] = [None] * len(tokens)
    for n, i in enumerate(rows):
        wanted = num_top[i] or 0
        top = tuple(zip(top_ids[n][:wanted], top_values[n][:wanted], strict=True)) if k else ()
        out[i] = TokenLogprob(tokens[i], chosen[n], top)
    return out


class OutputCounts:
    """One request's output tokens counted per vocabulary id, brought up to date with
    only the tokens added since the last step: a penalized request reads its counts every
    step, and recounting a long output each time would cost its whole length."""

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.num_counted = 0

    def update(self, output_token_ids: Sequence[int]) -> torch.Tensor:
        """The counts of `output_token_ids`, which extend the tokens counted before."""
        if len(output_token_ids) < self.num_counted:  # not an extension: count afresh
            self.counts.zero_()
            self.num_counted = 0
        new = output_token_ids[self.num_counted :]
        if new:
            ids = torch.tensor(new, dtype=torch.long, device=self.counts.device)
            self.counts.index_add_(0, ids, torch.ones(len(new), device=self.counts.device))
            self.num_counted = len(output_token_ids)
        return self.counts


def prompt_mask(
    prompt_token_ids: Sequence[int], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """A `[vocab]` bool mask of the ids in the prompt, for a repetition penalty."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask[torch.tensor(prompt_token_ids, dtype=torch.long, device=device)] = True
    return mask


def _is_greedy(p: SamplingParams) -> bool:
    return p.is_greedy or p.temperature < _MIN_TEMPERATURE


def _apply_top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    vocab_size = logits.shape[-1]
    device = logits.device
    top_k = torch.tensor(
        [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], device=device
    )
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab_size, device=device)[None, :]
    is_cut = ranks >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(is_cut, float("-inf"))
    # Keep the smallest prefix whose mass reaches top_p: a token is cut when the mass
    # before it already reaches top_p (the top token always survives).
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # The top token is never cut, even by a top_p that float32 rounds to 0 (below ~1e-45).
    is_cut = (mass_before >= top_p[:, None]) & (ranks > 0)
    sorted_logits = sorted_logits.masked_fill(is_cut, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _apply_min_p(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`probs` with the tokens less likely than min_p x the row's most likely one set to
    0 (vLLM's min-p). The draw needs no renormalising: argmax(p / E) ignores scale."""
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=probs.device)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return probs.masked_fill(probs < threshold, 0.0)


def _exponential_noise(
    probs: torch.Tensor,
    params: Sequence[SamplingParams],
    output_positions: Sequence[int],
    generator: torch.Generator | None,
) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for row, (p, position) in enumerate(zip(params, output_positions, strict=True)):
        if p.seed is None or _is_greedy(p):
            continue
        # Drawn on the CPU so a seed gives the same tokens on every device.
        seeded = torch.Generator(device="cpu").manual_seed(_mix(p.seed, position))
        row_noise = torch.empty(probs.shape[-1], dtype=torch.float32).exponential_(generator=seeded)
        noise[row] = row_noise.to(probs.device)
    return noise.clamp_min_(_NOISE_FLOOR)


def _mix(seed: int, position: int) -> int:
    # A 64-bit mix of (seed, position) so neighbouring seeds do not share streams.
    value = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    value ^= value >> 31
    return value & (2**63 - 1)
