"""A job's JSON, as it crosses the queue between gateways and workers."""

from __future__ import annotations

import json
from dataclasses import fields

from engine.request import SamplingParams
from scheduler.job import NEWER_PARAMS, Job


def _job(params: SamplingParams) -> Job:
    return Job("j", "t", "interactive", 1, 1.0, (1, 2, 3), params, 0.0, resumed_token_ids=(4,))


def test_every_sampling_field_survives_the_round_trip() -> None:
    params = SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=3,
        seed=-5,
        stop=("a", "bc"),
        stop_token_ids=(2,),
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias={9: -1.5},
        logprobs=2,
        prompt_logprobs=1,
        min_p=0.05,
        repetition_penalty=1.3,
        min_tokens=4,
    )
    assert {f.name for f in fields(params)} <= set(json.loads(_job(params).to_json())["params"])
    assert Job.from_json(_job(params).to_json()) == _job(params)


def _read_as_the_release_before(raw: str) -> SamplingParams:
    """What the release before's Job.from_json did with the params: every key it reads
    without a default, and no key its SamplingParams does not know."""
    params = json.loads(raw)["params"]
    known = {f.name for f in fields(SamplingParams)} - NEWER_PARAMS
    assert set(params) <= known, set(params) - known
    stop, stop_token_ids = tuple(params["stop"]), tuple(params["stop_token_ids"])
    return SamplingParams(**{**params, "stop": stop, "stop_token_ids": stop_token_ids})


def test_the_release_before_reads_a_job_that_uses_no_newer_field() -> None:
    plain = SamplingParams(max_tokens=5, temperature=0.7)
    assert _read_as_the_release_before(_job(plain).to_json()) == plain
    with_logprobs = SamplingParams(logprobs=2, stop=("x",))
    assert _read_as_the_release_before(_job(with_logprobs).to_json()) == with_logprobs
    assert "prompt_logprobs" not in json.loads(_job(plain).to_json())["params"]
    assert Job.from_json(_job(plain).to_json()) == _job(plain)


def test_vllms_samplers_are_left_out_at_their_default() -> None:
    # The release before's SamplingParams knows none of them: a job that uses none must
    # not carry them, and one that uses one carries it (and only it).
    plain = json.loads(_job(SamplingParams(max_tokens=5)).to_json())["params"]
    assert not {"min_p", "repetition_penalty", "min_tokens"} & set(plain)
    assert {"min_p", "repetition_penalty", "min_tokens"} <= NEWER_PARAMS
    with_min_p = json.loads(_job(SamplingParams(min_p=0.1)).to_json())["params"]
    assert set(with_min_p) - set(plain) == {"min_p"}


def test_a_job_written_with_every_field_still_reads() -> None:
    # The JSON of the release before: every field, defaults included.
    data = json.loads(_job(SamplingParams()).to_json())
    data["params"] = {f.name: getattr(SamplingParams(), f.name) for f in fields(SamplingParams)}
    data["params"]["prompt_logprobs"] = None
    assert Job.from_json(json.dumps(data)) == _job(SamplingParams())
