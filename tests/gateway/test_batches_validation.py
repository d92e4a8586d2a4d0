"""Input-file validation and the create-batch body, without a server: every failure."""

from __future__ import annotations

import json

import pytest

from gateway.batches.validation import (
    MAX_INPUT_BYTES,
    MAX_INPUT_LINES,
    ValidationLimits,
    parse_create_request,
    validate_input,
)
from gateway.errors import InvalidRequestError

CHAT = "/v1/chat/completions"


def _line(custom_id: str, **fields) -> bytes:
    line = {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": {"model": "m"}}
    return json.dumps({**line, **fields}).encode()


def test_limits_are_openais() -> None:
    assert MAX_INPUT_LINES == 50_000
    assert MAX_INPUT_BYTES == 200 * 1024 * 1024


def test_good_file_keeps_order_and_bodies() -> None:
    content = b"\n".join([_line("a"), b"", _line("b", body={"model": "m", "n": 1})]) + b"\n"
    lines, errors = validate_input(content, CHAT, ValidationLimits())
    assert errors == []
    assert [(x.line_index, x.custom_id) for x in lines] == [(0, "a"), (1, "b")]
    assert json.loads(lines[1].body_json) == {"model": "m", "n": 1}


def test_too_many_bytes_fails_before_parsing() -> None:
    content = _line("a") + b"\n" + _line("b")
    lines, errors = validate_input(content, CHAT, ValidationLimits(max_bytes=len(content) - 1))
    assert lines == []
    assert [(e.code, e.line) for e in errors] == [("file_too_large", None)]


def test_too_many_lines() -> None:
    content = b"\n".join(_line(str(i)) for i in range(4))
    lines, errors = validate_input(content, CHAT, ValidationLimits(max_lines=3))
    assert lines == []
    assert errors[0].code == "too_many_requests"
    assert validate_input(content, CHAT, ValidationLimits(max_lines=4))[1] == []


def test_every_bad_line_is_reported_with_its_number() -> None:
    content = b"\n".join(
        [
            _line("a"),
            b"{oops",
            _line("b", url="/v1/completions"),
            _line("a"),
            b'"just a string"',
            _line("c", body=[1]),
            b"\xff\xfe",
            b'{"custom_id": "d", "method": "POST", "url": "/v1/chat/completions", "body": NaN}',
        ]
    )
    lines, errors = validate_input(content, CHAT, ValidationLimits())
    assert lines == []
    assert [(e.code, e.line) for e in errors] == [
        ("invalid_json_line", 2),
        ("mismatched_url", 3),
        ("duplicate_custom_id", 4),
        ("invalid_json_line", 5),
        ("invalid_request", 6),
        ("invalid_json_line", 7),
        ("invalid_json_line", 8),
    ]
    assert errors[1].param == "url"
    assert errors[1].as_dict()["line"] == 3


def test_custom_id_must_be_a_short_string() -> None:
    for bad in ("", 5, None, "x" * 513):
        line = {"custom_id": bad, "method": "POST", "url": CHAT, "body": {}}
        _, errors = validate_input(json.dumps(line).encode(), CHAT, ValidationLimits())
        assert errors[0].param == "custom_id", bad


def test_create_request() -> None:
    body = {"input_file_id": "file-1", "endpoint": CHAT, "completion_window": "24h"}
    parsed = parse_create_request(
        json.dumps({**body, "metadata": {"k": "v"}, "output_expires_after": None}).encode()
    )
    assert (parsed.input_file_id, parsed.endpoint, parsed.metadata) == ("file-1", CHAT, {"k": "v"})
    for change, param in [
        ({"input_file_id": None}, "input_file_id"),
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "48h"}, "completion_window"),
        ({"metadata": [1]}, "metadata"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata.k"),
        (
            {"output_expires_after": {"anchor": "created_at", "seconds": 3600}},
            "output_expires_after",
        ),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            parse_create_request(json.dumps({**body, **change}).encode())
        assert info.value.param == param


def test_a_body_over_the_request_limit_fails_though_its_line_fits() -> None:
    # The line's own bound leaves room for the envelope (custom_id, url): a body within
    # that room but over the live limit would run here and be a 413 on the endpoint.
    limits = ValidationLimits(max_body_bytes=1024)
    big = _line("big", body={"model": "m", "messages": [{"role": "user", "content": "x" * 1100}]})
    assert len(big) < limits.max_body_bytes + 8 * 1024
    lines, errors = validate_input(_line("a") + b"\n" + big, CHAT, limits)
    assert lines == []
    assert [(e.code, e.line, e.param) for e in errors] == [("line_too_large", 2, "body")]
    # Counted as UTF-8, as a request's bytes are: not inflated by the file's \\u escapes.
    snowmen = {"model": "m", "messages": [{"role": "user", "content": "\u2603" * 300}]}
    fits = _line("fits", body=snowmen)  # 6 bytes a snowman here, 3 in the body
    assert len(fits) > limits.max_body_bytes
    lines, errors = validate_input(fits, CHAT, limits)
    assert (len(lines), errors) == (1, [])
