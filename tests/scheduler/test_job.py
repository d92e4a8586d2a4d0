"""A job's JSON, as it crosses the queue between gateways and workers."""

from __future__ import annotations

import json
from dataclasses import fields

from engine.request import SamplingParams
from scheduler.job import Job


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
    )
    assert {f.name for f in fields(params)} <= set(json.loads(_job(params).to_json())["params"])
    assert Job.from_json(_job(params).to_json()) == _job(params)


def test_fields_at_their_default_are_left_out() -> None:
    # A worker of the release before (without a newer field) reads every job that does
    # not use it: only what differs from the defaults travels.
    used = SamplingParams(max_tokens=5, logprobs=0)
    assert json.loads(_job(used).to_json())["params"] == {"max_tokens": 5, "logprobs": 0}
    assert json.loads(_job(SamplingParams()).to_json())["params"] == {}
    assert Job.from_json(_job(used).to_json()) == _job(used)


def test_a_job_written_with_every_field_still_reads() -> None:
    # The JSON of the release before: every field, defaults included.
    data = json.loads(_job(SamplingParams()).to_json())
    data["params"] = {f.name: getattr(SamplingParams(), f.name) for f in fields(SamplingParams)}
    data["params"]["prompt_logprobs"] = None
    assert Job.from_json(json.dumps(data)) == _job(SamplingParams())
