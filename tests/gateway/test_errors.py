"""Every bad request gets the OpenAI error shape, the right status and x-request-id.

Through the official client where it can send the request (so each error surfaces as the
client's own exception class), through raw HTTP where it cannot (bad bytes, huge bodies).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tests.gateway.conftest import LiveServer

MODEL = "tiny-random"


def _assert_error_shape(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["x-request-id"].startswith("req_")
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer", "Basic dXNlcjpwYXNz", "Bearer sk-not-ours", "Bearer tg-" + "A" * 43],
    ids=["missing", "no-key", "basic", "foreign", "unknown"],
)
def test_bad_keys_are_401(live_server: LiveServer, authorization: str | None) -> None:
    headers = {} if authorization is None else {"authorization": authorization}
    response = httpx.post(
        f"{live_server.base_url}/v1/completions",
        headers=headers,
        json={"model": MODEL, "prompt": "x"},
    )
    error = _assert_error_shape(response, 401)
    assert error["type"] == "authentication_error"


def test_client_raises_authentication_and_permission_errors(live_server: LiveServer) -> None:
    with pytest.raises(openai.AuthenticationError):
        live_server.client("tg-" + "B" * 43).models.list()
    with pytest.raises(openai.PermissionDeniedError) as suspended:
        live_server.client(live_server.suspended_key).completions.create(
            model=MODEL, prompt="x", max_tokens=2
        )
    assert suspended.value.code == "tenant_suspended"


def test_revoked_key_stops_working_at_once(live_server: LiveServer) -> None:
    with live_server.admin() as admin:
        tenant_id = live_server.tenant_ids["batch"]
        created = admin.post(f"/tenants/{tenant_id}/keys", json={}).json()
        client = live_server.client(created["secret"])
        assert client.models.list().data
        admin.delete(f"/keys/{created['id']}").raise_for_status()
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_unknown_model_is_404_model_not_found(live_server: LiveServer) -> None:
    client = live_server.client()
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_context_length_exceeded(live_server: LiveServer) -> None:
    client = live_server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=live_server.max_model_len)
    assert info.value.code == "context_length_exceeded"
    assert str(live_server.max_model_len) in info.value.message
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "word " * live_server.max_model_len}],
            max_completion_tokens=4,
        )
    assert chat.value.code == "context_length_exceeded"
    # The field to change: max_tokens when it was given and the prompt leaves room for
    # a token, else the prompt itself (here the chat prompt alone is too long).
    assert (info.value.param, chat.value.param) == ("max_tokens", "messages")
    with pytest.raises(openai.BadRequestError) as newer:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=live_server.max_model_len,
        )
    assert newer.value.param == "max_completion_tokens"  # the name the client used
    with pytest.raises(openai.BadRequestError) as alone:
        client.completions.create(model=MODEL, prompt="word " * live_server.max_model_len)
    assert (alone.value.code, alone.value.param) == ("context_length_exceeded", "prompt")
    with pytest.raises(openai.BadRequestError) as alone:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "word " * live_server.max_model_len}]
        )
    assert (alone.value.code, alone.value.param) == ("context_length_exceeded", "messages")


def test_a_prompt_longer_than_any_context_is_refused_unread(live_server: LiveServer) -> None:
    # Tokenizing a 4 MB prompt held the event loop for seconds, for every tenant; one
    # with more characters than the context holds tokens is now refused from its length.
    client = live_server.client()
    bound = 2 * live_server.max_model_len * Tokenizer(MODEL).max_token_chars
    num_chars = live_server.max_body_bytes - 1024
    assert num_chars > bound
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x" * num_chars, max_tokens=1)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "prompt")
    assert f"{num_chars} characters" in info.value.message
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi " * (bound // 3 + 1)}]
        )
    assert (chat.value.code, chat.value.param) == ("context_length_exceeded", "messages")
    assert "characters" in chat.value.message


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"n": 2, "best_of": 3}, "best_of"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": ["one", [2]]}, "prompt"),  # prompts of both forms
        ({"prompt": [[1], [10**9]]}, "prompt"),
        ({"prompt": ["x"] * 129}, "prompt"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": [[[1]]]}, "prompt"),
        ({"prompt": [[["hi"]]]}, "prompt"),
        ({"model": None}, "model"),
        ({"echo": 0}, "echo"),
        ({"logit_bias": 0}, "logit_bias"),
        ({"logit_bias": {"9999999": 5}}, "logit_bias"),  # beyond the vocabulary
        ({"logit_bias": {"5": -101}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logprobs": 9}, "logprobs"),
        ({"suffix": "tail"}, "suffix"),
        ({"best_of": 5}, "best_of"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"function_call": {"name": "f"}}, "function_call"),
    ],
)
def test_bad_values_are_400_naming_the_param(
    live_server: LiveServer, extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, **extra}
    response = httpx.post(
        f"{live_server.base_url}/v1/completions",
        headers={"authorization": f"Bearer {live_server.keys['interactive']}"},
        json=body,
    )
    error = _assert_error_shape(response, 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_client_raises_bad_request_for_bad_chat_messages(live_server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        live_server.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        )
    assert info.value.param == "messages[0].content[0]"


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b'{"model": "tiny-random", "prompt": "x"', "invalid_json"),
        (b'{"model": "tiny-random", "prompt": "\xff\xfe"}', "invalid_utf8"),
        (b"[]", "invalid_json"),
        (b"", None),
        # What json.loads takes but no request may carry.
        (
            b'{"model": "tiny-random", "prompt": "x", "max_tokens": 1' + b"1" * 5000 + b"}",
            "invalid_json",
        ),
        (
            b'{"model": "tiny-random", "prompt": ' + b"[" * 5_000 + b"]" * 5_000 + b"}",
            "invalid_json",
        ),
        (
            b'{"model": "tiny-random", "messages": [{"role": "user", "content": "\\ud800"}]}',
            "invalid_json",
        ),
        (b'{"model": "tiny-random", "prompt": "NaN", "max_tokens": NaN}', "invalid_json"),
    ],
    ids=["truncated", "bad-utf8", "array", "empty", "huge-int", "deep", "lone-surrogate", "nan"],
)
def test_undecodable_bodies_are_400(live_server: LiveServer, raw: bytes, code: str | None) -> None:
    response = httpx.post(
        f"{live_server.base_url}/v1/chat/completions",
        headers={
            "authorization": f"Bearer {live_server.keys['interactive']}",
            "content-type": "application/json",
        },
        content=raw,
    )
    error = _assert_error_shape(response, 400)
    assert error["code"] == code


def test_body_over_the_limit_is_413(live_server: LiveServer) -> None:
    headers = {"authorization": f"Bearer {live_server.keys['interactive']}"}
    body = {"model": MODEL, "prompt": "x" * (live_server.max_body_bytes + 1)}
    declared = httpx.post(f"{live_server.base_url}/v1/completions", headers=headers, json=body)
    assert _assert_error_shape(declared, 413)["code"] == "request_too_large"

    def chunks():  # no content-length: the limit is enforced while reading
        yield b'{"model": "tiny-random", "prompt": "'
        for _ in range(live_server.max_body_bytes // 1024 + 1):
            yield b"y" * 1024
        yield b'"}'

    streamed = httpx.post(
        f"{live_server.base_url}/v1/completions", headers=headers, content=chunks()
    )
    assert _assert_error_shape(streamed, 413)["code"] == "request_too_large"
    with pytest.raises(openai.APIStatusError) as info:
        live_server.client().completions.create(model=MODEL, prompt=body["prompt"], max_tokens=2)
    assert info.value.status_code == 413


def test_unknown_paths_and_methods(live_server: LiveServer) -> None:
    missing = httpx.get(f"{live_server.base_url}/v1/nothing-here")
    assert _assert_error_shape(missing, 404)["code"] == "unknown_url"
    wrong = httpx.get(f"{live_server.base_url}/v1/completions")
    assert _assert_error_shape(wrong, 405)["code"] == "method_not_allowed"


def test_admin_api_without_the_token_is_401(live_server: LiveServer) -> None:
    response = httpx.get(f"{live_server.base_url}/admin/v1/tenants")
    _assert_error_shape(response, 401)


def test_defaults_and_a_valid_surrogate_pair_are_accepted(live_server: LiveServer) -> None:
    """The unsupported fields' own defaults ask for nothing and pass, and an escaped
    surrogate pair (an emoji) is text."""
    response = httpx.post(
        f"{live_server.base_url}/v1/completions",
        headers={"authorization": f"Bearer {live_server.keys['interactive']}"},
        content=(
            b'{"model": "tiny-random", "prompt": "hi \\ud83d\\ude00", "max_tokens": 2, '
            b'"echo": false, "logprobs": null, "suffix": "", "best_of": 1, '
            b'"response_format": {"type": "text"}}'
        ),
    )
    assert response.status_code == 200, response.text


def test_a_client_gone_before_its_body_arrived_is_not_a_server_error(
    live_server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A body shorter than its content-length, then a close: no 500, no error logged,
    and the engine holds nothing."""
    import socket

    host, port = live_server.base_url.removeprefix("http://").split(":")
    key = live_server.keys["interactive"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/batches"):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                '{"model": "tiny-'.encode()
            )
    # The server still answers, and logged no unhandled error for the three.
    ok = httpx.post(
        f"{live_server.base_url}/v1/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": MODEL, "prompt": "x", "max_tokens": 2},
    )
    assert ok.status_code == 200
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


@pytest.mark.parametrize(
    ("path", "query"),
    [
        ("/tenants", {"limit": "\u00b2"}),
        ("/tenants", {"limit": "9" * 5000}),
        ("/usage", {"end": "9999-12-31T23:59:59-14:00"}),
        ("/usage", {"start": "0001-01-01T00:00:00+14:00"}),
        ("/usage", {"start": "0001-01-01T00:30:00Z", "end": "0001-01-01T02:00:00Z"}),
    ],
)
def test_admin_queries_out_of_range_are_400(
    live_server: LiveServer, path: str, query: dict[str, str]
) -> None:
    with live_server.admin() as admin:
        response = admin.get(path, params=query)
    assert _assert_error_shape(response, 400)["param"] in query


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tenants", '{"name": "\\ud800x", "tier": "batch"}', None),
        ("/tenants", '{"name": "a\\u0085b", "tier": "batch"}', "name"),
        ("KEYS", '{"expires_at": "9999-12-31T23:59:59-14:00"}', "expires_at"),
        ("KEYS", '{"expires_at": "0001-01-01T00:00:00+14:00"}', "expires_at"),
    ],
    ids=["lone-surrogate", "c1-control", "past-9999", "before-year-1"],
)
def test_admin_bodies_that_cannot_be_stored_are_400(
    live_server: LiveServer, path: str, body: str, param: str | None
) -> None:
    if path == "KEYS":
        path = f"/tenants/{live_server.tenant_ids['batch']}/keys"
    with live_server.admin() as admin:
        response = admin.post(path, content=body, headers={"content-type": "application/json"})
    assert _assert_error_shape(response, 400)["param"] == param


def test_a_request_over_the_tpm_limit_says_what_to_set(live_server: LiveServer) -> None:
    with live_server.admin() as admin:
        tenant = admin.post("/tenants", json={"name": "tiny-tpm", "tier": "interactive", "tpm": 64})
        tenant.raise_for_status()
        key = admin.post(f"/tenants/{tenant.json()['id']}/keys", json={}).json()["secret"]
    client = live_server.client(key)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as defaulted:
        client.chat.completions.create(model=MODEL, messages=messages)
    assert defaulted.value.code == "exceeds_token_limit"
    assert "max_tokens was not set" in defaulted.value.message
    with pytest.raises(openai.BadRequestError) as given:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=100)
    assert "Set max_tokens to at most" in given.value.message
    room = int(given.value.message.rsplit("at most ", 1)[1].split(",")[0])
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=room)
    assert reply.usage.prompt_tokens + room == 64


def test_a_database_out_of_reach_is_503_and_a_database_bug_500() -> None:
    # SQLAlchemy's own exceptions, as a dropped database, a server down, a pool with no
    # free connection and a broken constraint raise them.
    from sqlalchemy import exc as sa_exc

    from gateway.errors import error_response

    reason = OSError("connection refused")
    unreachable = [
        sa_exc.DBAPIError(None, None, reason),  # at connect: no statement ('does not exist')
        sa_exc.OperationalError("SELECT 1", {}, reason),
        sa_exc.InterfaceError("SELECT 1", {}, reason),
        sa_exc.DBAPIError("SELECT 1", {}, reason, connection_invalidated=True),
        sa_exc.TimeoutError("QueuePool limit of size 5 overflow 10 reached"),
    ]
    for exc in unreachable:
        response = error_response(exc)
        assert response.status_code == 503, exc
        assert b'"database_unavailable"' in response.body
    assert error_response(sa_exc.IntegrityError("INSERT", {}, reason)).status_code == 500
