"""Sampling: greedy, temperature, top-k/top-p/min-p support, per-request seeds, bias,
penalties and min_tokens."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling import OutputCounts, prompt_mask, sample, token_logprobs


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random", device="cpu", max_num_seqs=16)


def _logits(num_rows: int = 4, vocab_size: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed))


def test_temperature_zero_is_argmax() -> None:
    logits = _logits()
    params = [SamplingParams(temperature=0.0)] * 4
    assert sample(logits, params, [0] * 4) == logits.argmax(-1).tolist()


def test_greedy_rows_stay_greedy_in_a_mixed_batch() -> None:
    logits = _logits()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5)] * 2
    tokens = sample(logits, params, [0] * 4, torch.Generator().manual_seed(0))
    assert tokens[0] == logits[0].argmax().item()
    assert tokens[2] == logits[2].argmax().item()


def test_tiny_temperatures_are_greedy_in_a_mixed_batch() -> None:
    logits = _logits() * 30  # the scale of a real model's logits
    tiny = [SamplingParams(temperature=1e-39), SamplingParams(temperature=1e-30, seed=3)]
    params = [*tiny, SamplingParams(temperature=1e-39, top_p=0.9), SamplingParams()]
    tokens = sample(logits, params, [0] * 4, torch.Generator().manual_seed(0))
    assert tokens[:3] == logits[:3].argmax(-1).tolist()


def test_top_k_restricts_the_support() -> None:
    logits = _logits(1, 64).repeat(400, 1)
    params = [SamplingParams(temperature=5.0, top_k=3)] * 400
    tokens = set(sample(logits, params, [0] * 400, torch.Generator().manual_seed(1)))
    allowed = set(logits[0].topk(3).indices.tolist())
    assert tokens <= allowed
    assert len(tokens) > 1  # a high temperature does sample among them


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(400, 1)
    params = [SamplingParams(top_p=0.75)] * 400
    tokens = set(sample(logits, params, [0] * 400, torch.Generator().manual_seed(2)))
    assert tokens == {0, 1}  # 0.5 + 0.3 reaches 0.75; 2 and 3 never appear


def test_seeded_sampling_does_not_depend_on_batch_company() -> None:
    logits = _logits(3, 128)
    alone = sample(logits[1:2], [SamplingParams(seed=7)], [5])
    crowd = [SamplingParams(), SamplingParams(seed=7), SamplingParams(temperature=0.5)]
    together = sample(logits, crowd, [0, 5, 9], torch.Generator().manual_seed(3))
    assert together[1] == alone[0]
    # The seed and the position key the draw: another position may pick another token.
    draws = {sample(logits[1:2], [SamplingParams(seed=7)], [p])[0] for p in range(40)}
    assert len(draws) > 1


def test_seeded_generation_reproduces_through_the_engine(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=1234)
    alone = llm.generate([[10, 11, 12]], seeded)[0].token_ids
    others = SamplingParams(max_tokens=12, temperature=1.0)
    batch = llm.generate([[20, 21], [10, 11, 12], [30] * 9], [others, seeded, others])
    assert batch[1].token_ids == alone
    different_seed = SamplingParams(max_tokens=12, temperature=1.0, seed=4321)
    assert llm.generate([[10, 11, 12]], different_seed)[0].token_ids != alone


def test_greedy_through_the_engine_is_deterministic(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    first = llm.generate([[40, 41, 42]], greedy)[0].token_ids
    second = llm.generate([[5] * 30, [40, 41, 42]], greedy)[1].token_ids
    assert first == second


@pytest.mark.parametrize("temperature", [1e-30, 1e-39])
def test_tiny_temperature_through_the_engine_is_greedy(llm: LLM, temperature: float) -> None:
    """Below float32's smallest normal number, logits / temperature overflowed to inf:
    every step sampled token 0."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    tiny = SamplingParams(max_tokens=8, temperature=temperature)
    expected = llm.generate([[40, 41, 42]], greedy)[0].token_ids
    assert llm.generate([[40, 41, 42]], tiny)[0].token_ids == expected


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = _logits(4, 64) * 10
    forced = SamplingParams(temperature=1.0, logit_bias={7: 100})
    banned_top = int(logits[1].argmax())
    banned = SamplingParams(temperature=0.0, logit_bias={banned_top: -100})
    params = [forced, banned, SamplingParams(temperature=0.0), forced]
    tokens = sample(logits, params, [0] * 4, torch.Generator().manual_seed(0))
    assert tokens[0] == tokens[3] == 7
    assert tokens[1] == int(logits[1].sort(descending=True).indices[1])  # the runner-up
    assert tokens[2] == int(logits[2].argmax())  # a row without bias is untouched


def _counts(outputs: list[list[int]], vocab_size: int) -> list[torch.Tensor]:
    return [OutputCounts(vocab_size, "cpu").update(ids) for ids in outputs]


def test_output_counts_follow_a_growing_output() -> None:
    counter = OutputCounts(5, "cpu")
    assert counter.update([]).tolist() == [0, 0, 0, 0, 0]
    assert counter.update([1, 1]).tolist() == [0, 2, 0, 0, 0]
    assert counter.update([1, 1, 4]).tolist() == [0, 2, 0, 0, 1]
    assert counter.update([1, 1, 4]).tolist() == [0, 2, 0, 0, 1]  # nothing new
    assert counter.update([3]).tolist() == [0, 0, 0, 1, 0]  # not an extension: afresh


def test_penalties_follow_openais_formula() -> None:
    # logit[j] -= count[j] * frequency + (count[j] > 0) * presence, output tokens only.
    logits = torch.tensor([[5.0, 4.0, 3.5, 0.0]])
    outputs = [[0, 0, 0, 1]]  # token 0 three times, token 1 once
    light = SamplingParams(temperature=0.0, frequency_penalty=0.4)  # 3.8, 3.6, 3.5, 0
    assert sample(logits, [light], [4], output_counts=_counts(outputs, logits.shape[-1])) == [0]
    more = SamplingParams(temperature=0.0, frequency_penalty=0.6)  # 3.2, 3.4, 3.5, 0
    assert sample(logits, [more], [4], output_counts=_counts(outputs, logits.shape[-1])) == [2]
    # 3.4, 3.4, 3.5, 0: presence counts once whatever the count
    heavier = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.1)
    assert sample(logits, [heavier], [4], output_counts=_counts(outputs, logits.shape[-1])) == [2]
    rewarded = SamplingParams(temperature=0.0, presence_penalty=-2.0)  # 7, 6, 6.5, 0
    assert sample(
        torch.tensor([[5.0, 4.0, 6.5, 0.0]]),
        [rewarded],
        [4],
        output_counts=_counts(outputs, logits.shape[-1]),
    ) == [0]
    # The caller's logits are left as they were.
    assert logits.tolist() == [[5.0, 4.0, 3.5, 0.0]]


def test_penalties_apply_per_row() -> None:
    logits = torch.tensor([[3.0, 2.0], [3.0, 2.0], [3.0, 2.0]])
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=2.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, presence_penalty=2.0),
    ]
    outputs = [[0], [0, 0, 0], []]
    assert sample(logits, params, [1, 3, 0], output_counts=_counts(outputs, logits.shape[-1])) == [
        1,
        0,
        0,
    ]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {5: 10**400}}, "logit_bias"),
        ({"presence_penalty": 10**400}, "presence_penalty"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {True: 1}}, "logit_bias"),
        ({"logit_bias": [[1, 2, 3]]}, "logit_bias"),
        ({"logit_bias": 5}, "logit_bias"),
        # Dividing a positive logit by it overflows float32: inf, then NaN probabilities.
        ({"repetition_penalty": 1e-45}, "repetition_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ],
)
def test_bad_penalties_and_biases_are_typed_errors(kwargs: dict, param: str) -> None:
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_logit_bias_survives_the_jobs_json() -> None:
    from scheduler.job import Job

    params = SamplingParams(max_tokens=3, logit_bias={9: -1.5, 2: 100}, frequency_penalty=0.5)
    job = Job("j", "t", "interactive", 1, 1.0, (1, 2), params, 0.0)
    assert Job.from_json(job.to_json()).params == params
    assert params.logit_bias == ((2, 100.0), (9, -1.5))


def test_logit_bias_and_penalties_steer_the_engine(llm: LLM) -> None:
    forced = llm.generate(["hello"], SamplingParams(max_tokens=6, logit_bias={42: 100}))[0]
    assert forced.token_ids == [42] * 6
    with pytest.raises(Exception, match="outside the vocabulary"):
        llm.generate(["hello"], SamplingParams(max_tokens=2, logit_bias={10**6: 1}))
    # The tiny model's top logits lie a few tenths apart: rewarding the tokens already
    # out (a negative penalty) makes greedy decoding repeat them more, and a positive
    # one on top of a bias that makes a token win keeps it from winning every step.
    plain = llm.generate(["hello"], SamplingParams(max_tokens=24, temperature=0))[0].token_ids
    rewarded = llm.generate(
        ["hello"], SamplingParams(max_tokens=24, temperature=0, presence_penalty=-2.0)
    )[0].token_ids
    assert len(set(rewarded)) < len(set(plain))
    nudged = SamplingParams(max_tokens=12, temperature=0, logit_bias={42: 8.0})
    assert llm.generate(["hello"], nudged)[0].token_ids == [42] * 12
    penalized = replace(nudged, frequency_penalty=2.0)
    assert llm.generate(["hello"], penalized)[0].token_ids.count(42) < 12


def test_token_logprobs_are_the_models_own() -> None:
    logits = _logits(3, 32)
    tokens = [5, 9, 1]
    out = token_logprobs(logits, tokens, [2, None, 0])
    expected = logits.log_softmax(-1)
    assert out[1] is None
    assert out[0].token_id == 5
    assert out[0].logprob == pytest.approx(expected[0, 5].item())
    top_ids = expected[0].topk(2).indices.tolist()
    assert [t for t, _ in out[0].top] == top_ids
    assert [v for _, v in out[0].top] == pytest.approx(expected[0, top_ids].tolist())
    assert (out[2].token_id, out[2].top) == (1, ())
    assert out[2].logprob == pytest.approx(expected[2, 1].item())
    assert token_logprobs(logits, tokens, [None] * 3) == [None] * 3


def test_logprobs_ignore_temperature_and_bias(llm: LLM) -> None:
    # What the model thinks of each token, not what the sampling knobs made of it.
    greedy = llm.generate(["hello"], SamplingParams(max_tokens=5, temperature=0, logprobs=3))[0]
    assert len(greedy.logprobs) == 5
    assert [lp.token_id for lp in greedy.logprobs] == greedy.token_ids
    for lp in greedy.logprobs:
        assert lp.top[0][0] == lp.token_id
        assert lp.top[0][1] == lp.logprob <= 0.0
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    hot = SamplingParams(max_tokens=5, temperature=2.0, seed=3, logprobs=1, logit_bias={42: 100})
    forced = llm.generate(["hello"], hot)[0]
    assert forced.token_ids == [42] * 5
    assert all(lp.logprob < lp.top[0][1] for lp in forced.logprobs)  # 42 is not the top
    assert llm.generate(["hello"], SamplingParams(max_tokens=2))[0].logprobs == []


@pytest.mark.parametrize("stop", [(), ("e",)])
def test_each_tokens_text_chars_add_up_to_the_text(llm: LLM, stop: tuple[str, ...]) -> None:
    # Special tokens and pieces of a character release no text, a stop string cuts it:
    # the counts are where each token starts in the text (a completion's text_offset).
    params = SamplingParams(max_tokens=80, temperature=0, logprobs=0, stop=stop)
    out = llm.generate(["Hello world"], params)[0]
    assert len(out.logprobs) == len(out.token_ids)
    assert sum(lp.num_text_chars for lp in out.logprobs) == len(out.text)


# ---------------------------------------------------------------- min_p


def test_min_p_cuts_tokens_below_a_share_of_the_top_one_after_temperature() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(400, 1)
    # At temperature 1: 0.3 >= 0.5 x 0.5 stays, 0.15 does not.
    cut = [SamplingParams(min_p=0.5)] * 400
    assert set(sample(logits, cut, [0] * 400, torch.Generator().manual_seed(0))) == {0, 1}
    # At temperature 2 the shares are the square roots (1, 0.77, 0.55, 0.32): after
    # temperature, token 2 clears the same min_p.
    hot = [SamplingParams(min_p=0.5, temperature=2.0)] * 400
    assert set(sample(logits, hot, [0] * 400, torch.Generator().manual_seed(0))) == {0, 1, 2}
    # With top-k the shares are of what top-k keeps (renormalised alike): the same cut.
    both = [SamplingParams(min_p=0.5, top_k=3)] * 400
    assert set(sample(logits, both, [0] * 400, torch.Generator().manual_seed(0))) == {0, 1}
    uncut = [SamplingParams()] * 400
    assert set(sample(logits, uncut, [0] * 400, torch.Generator().manual_seed(0))) == {0, 1, 2, 3}


def test_min_p_applies_per_row_and_leaves_greedy_rows_alone() -> None:
    probs = torch.tensor([0.05, 0.5, 0.3, 0.15])
    logits = probs.log().repeat(600, 1)
    params = [SamplingParams(min_p=0.9), SamplingParams(), SamplingParams(min_p=0.9, top_k=1)]
    tokens = sample(logits, params * 200, [0] * 600, torch.Generator().manual_seed(4))
    assert set(tokens[0::3]) == {1}
    assert set(tokens[1::3]) == {0, 1, 2, 3}  # a row without min_p in the same batch
    assert set(tokens[2::3]) == {1}


def _share_of_top(logprob, temperature: float) -> float:
    """The sampled token's probability over the most likely token's, after temperature
    (logprobs are the model's own, so the ratio is exp of their gap / temperature)."""
    return math.exp((logprob.logprob - logprob.top[0][1]) / temperature)


def test_min_p_through_the_engine_samples_only_near_the_top(llm: LLM) -> None:
    hot = SamplingParams(max_tokens=60, temperature=1.5, seed=5, logprobs=1)
    shares = [_share_of_top(lp, 1.5) for lp in llm.generate(["hello"], hot)[0].logprobs]
    assert min(shares) < 0.1  # without min_p this run does sample far from the top
    cut = llm.generate(["hello"], replace(hot, min_p=0.3))[0]
    assert len(cut.logprobs) == 60
    assert all(_share_of_top(lp, 1.5) >= 0.3 * (1 - 1e-4) for lp in cut.logprobs)


def test_min_p_of_one_is_greedy(llm: LLM) -> None:
    greedy = llm.generate(["hello"], SamplingParams(max_tokens=24, temperature=0.0))[0]
    hot = SamplingParams(max_tokens=24, temperature=2.0, seed=11)
    assert llm.generate(["hello"], hot)[0].token_ids != greedy.token_ids
    assert llm.generate(["hello"], replace(hot, min_p=1.0))[0].token_ids == greedy.token_ids


# ---------------------------------------------------------------- repetition_penalty


def test_repetition_penalty_matches_the_hand_computed_logits() -> None:
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0, -3.0, 2.0, 0.5, -0.5]])
    prompt, output = [0, 3, 3], [1, 4, 1, 0]
    history = {
        "output_counts": _counts([output], 8),
        "prompt_masks": [prompt_mask(prompt, 8, "cpu")],
    }
    # Seen (prompt or output): 0, 1, 3, 4, each scaled once however often it appears.
    by_hand = {
        2.0: [1.5, 0.5, 0.0, -2.0, -6.0, 2.0, 0.5, -0.5],
        0.5: [6.0, 2.0, 0.0, -0.5, -1.5, 2.0, 0.5, -0.5],  # below 1 it rewards them
    }
    for penalty, expected in by_hand.items():
        greedy = SamplingParams(temperature=0.0, repetition_penalty=penalty)
        assert sample(logits, [greedy], [4], **history) == [max(range(8), key=expected.__getitem__)]
        # Seeded draws share their noise: over many positions they pick the same tokens
        # from the penalised logits as from the hand-computed ones only if the two
        # distributions agree.
        seeded = SamplingParams(seed=3, repetition_penalty=penalty)
        positions = list(range(200))
        got = [sample(logits, [seeded], [n], **history)[0] for n in positions]
        plain = SamplingParams(seed=3)
        want = [sample(torch.tensor([expected]), [plain], [n])[0] for n in positions]
        assert got == want
        assert len(set(got)) > 3
    assert logits.tolist() == [[3.0, 1.0, 0.0, -1.0, -3.0, 2.0, 0.5, -0.5]]  # untouched


def test_repetition_penalty_comes_after_the_bias_and_before_the_other_penalties() -> None:
    # vLLM's order: bias, then the repetition penalty scales, then frequency and
    # presence subtract. Token 0: (2 + 2) / 2 - 3 x 0.5 - 0.25 = 0.25; token 1 (prompt
    # only): -1 x 2 = -2; token 2 (unseen, biased): 0.5 + 0.5 = 1.0; token 3: 0.75.
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.75]])
    params = SamplingParams(
        seed=9,
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logit_bias={0: 2.0, 2: 0.5},
    )
    history = {
        "output_counts": _counts([[0, 0, 0]], 4),
        "prompt_masks": [prompt_mask([1], 4, "cpu")],
    }
    got = [sample(logits, [params], [n], **history)[0] for n in range(200)]
    by_hand = torch.tensor([[0.25, -2.0, 1.0, 0.75]])
    assert got == [sample(by_hand, [SamplingParams(seed=9)], [n])[0] for n in range(200)]
    greedy = replace(params, temperature=0.0)
    assert sample(logits, [greedy], [3], **history) == [2]


def test_repetition_penalty_applies_per_row() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0]] * 4)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=2.0),  # 0 in the prompt: 1.5
        SamplingParams(temperature=0.0, presence_penalty=0.5),  # no repetition penalty
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),  # 0 in the output: 1.5
    ]
    counts = [*_counts([[], [0]], 3), None, *_counts([[0, 0]], 3)]
    masks = [prompt_mask([0], 3, "cpu"), None, None, prompt_mask([2], 3, "cpu")]
    tokens = sample(logits, params, [0, 1, 0, 2], output_counts=counts, prompt_masks=masks)
    assert tokens == [1, 0, 0, 1]


def _num_repeats(prompt: list[int], output: list[int]) -> int:
    """How many output tokens were already in the prompt or earlier in the output."""
    seen, num = set(prompt), 0
    for token in output:
        num += token in seen
        seen.add(token)
    return num


def test_a_strong_repetition_penalty_keeps_greedy_from_repeating(llm: LLM) -> None:
    prompt = [*range(100, 160), *[7] * 20]
    greedy = SamplingParams(max_tokens=60, temperature=0.0)
    plain = llm.generate([prompt], greedy)[0].token_ids
    assert len(set(prompt) & set(plain)) >= 3  # prompt tokens come back unpenalised...
    assert _num_repeats(prompt, plain) >= 10  # ...and output tokens too
    penalised = llm.generate([prompt], replace(greedy, repetition_penalty=2.0))[0].token_ids
    assert len(penalised) == 60
    assert _num_repeats(prompt, penalised) == 0
    # It also steers a sampled run, and stays seeded: the same seed, the same tokens.
    hot = replace(greedy, temperature=1.0, seed=2, repetition_penalty=2.0)
    first = llm.generate([prompt], hot)[0].token_ids
    assert llm.generate([[5, 6], prompt], hot)[1].token_ids == first
    assert _num_repeats(prompt, first) < _num_repeats(prompt, plain)


def test_prompt_masks_mark_the_prompts_ids() -> None:
    assert prompt_mask([3, 1, 3], 5, "cpu").tolist() == [False, True, False, True, False]


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_bans_stop_tokens_until_enough_are_out() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 2.0]] * 4)
    eos = {1}
    short = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(2,))
    params = [short, short, replace(short, ignore_eos=True), SamplingParams(temperature=0.0)]
    # Row 0 has 2 tokens out: eos (1) and its stop token (2) are banned; row 1 has 3:
    # nothing is. ignore_eos leaves eos alone; a row without min_tokens is untouched.
    tokens = sample(logits, params, [2, 3, 0, 0], eos_token_ids=eos)
    assert tokens == [3, 1, 1, 1]
    # Banned outright (-inf), whatever the bias or temperature.
    forced = SamplingParams(min_tokens=1, logit_bias={1: 100.0}, temperature=1.5)
    drawn = sample(logits[:1].repeat(200, 1), [forced] * 200, [0] * 200, eos_token_ids=eos)
    assert 1 not in drawn
    assert sample(logits[:1], [forced], [1], eos_token_ids=eos) == [1]


def test_the_smallest_repetition_penalty_keeps_logits_finite() -> None:
    # Scaled a hundredfold, 90 -> 9000 still wins; an overflow to inf/NaN would make the
    # draw fall on id 0 (argmax of NaN), whatever the logits said.
    from engine.request import MIN_REPETITION_PENALTY

    logits = torch.tensor([[-5.0, 30.0, 90.0, 0.5]] * 2)
    penalty = MIN_REPETITION_PENALTY
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=penalty),
        SamplingParams(temperature=1.0, seed=3, repetition_penalty=penalty),
    ]
    counts = [torch.tensor([0, 1, 0, 0])] * 2  # token 1 in the output
    masks = [torch.tensor([False, False, True, False])] * 2  # token 2 in the prompt
    assert sample(logits, params, [1, 1], None, counts, masks) == [2, 2]
