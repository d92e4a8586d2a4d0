"""gateway/json_body: an object that names a key twice is refused, at any depth, by every
body that goes through it (API bodies, admin bodies, batch input lines)."""

from __future__ import annotations

import pytest

from gateway import json_body
from gateway.batches.validation import ValidationLimits, validate_input
from gateway.errors import InvalidRequestError
from gateway.openai.schemas import parse_json_object


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('{"name": "dupkey-a", "tier": "batch", "name": "dupkey-b"}', "name"),
        ('{"a": {"b": 1, "c": {"d": 1, "d": 2}}}', "d"),
        ('{"messages": [{"role": "user"}, {"role": "user", "role": "system"}]}', "role"),
        # The same key once escaped: json.loads makes both "name", and keeps the last.
        ('{"name": 1, "n\\u0061me": 2}', "name"),
        ('{"": 1, "": 2}', ""),
    ],
    ids=["top-level", "nested", "in-an-array", "escaped", "empty-key"],
)
def test_a_key_repeated_in_one_object_is_refused(text: str, key: str) -> None:
    with pytest.raises(json_body.JsonBodyError) as info:
        json_body.loads(text)
    assert str(info.value) == f"an object has the key {key!r} more than once"


def test_a_key_may_recur_in_different_objects_but_not_in_one() -> None:
    # Each object is checked on its own: siblings and nesting may reuse a key.
    siblings = '[{"a": 1}, {"a": 2, "b": {"a": 3}}]'
    assert json_body.loads(siblings) == [{"a": 1}, {"a": 2, "b": {"a": 3}}]
    with pytest.raises(json_body.JsonBodyError, match="'a'"):
        json_body.loads('[{"a": 1}, {"a": 2, "b": {"a": 3, "a": 4}}]')


def test_the_message_shows_a_long_or_odd_key_in_short_and_escaped() -> None:
    long_key = "k" * 10_000
    with pytest.raises(json_body.JsonBodyError) as info:
        json_body.loads(f'{{"{long_key}": 1, "{long_key}": 2}}')
    assert len(str(info.value)) < 200
    # A lone surrogate in the key: the message must still be text an encoder takes.
    with pytest.raises(json_body.JsonBodyError) as info:
        json_body.loads('{"\\ud800\\"": 1, "\\ud800\\"": 2}')
    str(info.value).encode("utf-8")
    assert "\\ud800" in str(info.value)


def test_the_api_and_batch_lines_refuse_a_repeated_key_as_invalid_json() -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_json_object(b'{"model": "m", "max_tokens": 1, "max_tokens": 100000}')
    assert info.value.code == "invalid_json"
    assert "'max_tokens'" in str(info.value)

    line = b'{"custom_id": "a", "custom_id": "b", "method": "POST", "url": "/v1/completions"}'
    lines, errors = validate_input(line, "/v1/completions", ValidationLimits())
    assert lines == []
    assert [(e.code, e.line) for e in errors] == [("invalid_json_line", 1)]
    assert "'custom_id'" in errors[0].message
