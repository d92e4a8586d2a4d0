"""A worker's unexpected exception does not reach the client.

The dispatcher fails a job whose engine raised with `repr(exc)` as the message (for the
worker's own log); the gateway used to send that text on as the 500's message, and into
a batch's error file: library internals, file paths, shapes of the model's tensors.
"""

from __future__ import annotations

import json
import logging

import pytest

from gateway.errors import error_response
from scheduler.results import JobFailedError, JobInvalidError

LEAKY = "RuntimeError('CUDA error at /opt/tiergate/engine/model_runner.py:512: shape [7, 4096]')"


def _body(exc: BaseException) -> dict:
    response = error_response(exc)
    return {"status": response.status_code, **json.loads(bytes(response.body))["error"]}


def test_an_engine_failure_is_a_500_without_its_text(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.errors"):
        body = _body(JobFailedError("engine_error", LEAKY))
    assert body["status"] == 500
    assert body["code"] == "engine_error"
    assert body["type"] == "server_error"
    assert "model_runner" not in body["message"]
    assert "CUDA" not in body["message"]
    assert LEAKY in caplog.text  # the operator still has it


def test_an_invalid_job_keeps_its_message() -> None:
    # The engine refusing the parameters is the client's to read (a 400 saying why).
    body = _body(JobInvalidError("invalid_request", "max_tokens is larger than allowed"))
    assert body["status"] == 400
    assert body["message"] == "max_tokens is larger than allowed"
