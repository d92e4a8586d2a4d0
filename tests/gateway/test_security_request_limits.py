"""Small request fields that cost the fleet many times their size are bounded.

- stop strings and `user` travel with every choice's job through the queue: with n=128
  a 3.6 MB body of stop strings put 190 MB in Redis at once. Each stop string is now at
  most 1,000 characters and `user` at most 256.
- empty chat messages have no characters, so the cheap "too long to fit" check let any
  number through to the chat template and tokenizer: 140,000 of them (4 MB) cost 5 s of
  CPU before the 400, and no rate limit counts a refused request. More messages than
  twice the context are now refused unrendered.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import httpx

from gateway.openai.schemas import MAX_STOP_CHARS, MAX_USER_CHARS

if TYPE_CHECKING:
    from tests.gateway.conftest import LiveServer

MODEL = "tiny-random"


def _post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}{path}",
        json=body,
        headers={"authorization": f"Bearer {server.keys['batch']}"},
        timeout=60,
    )


def _error(response: httpx.Response, param: str) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    return error


def test_a_stop_string_over_the_limit_is_refused(live_server: LiveServer) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 2}
    long_stop = ["\U0001f600" * (MAX_STOP_CHARS + 1)]
    error = _error(_post(live_server, "/v1/completions", {**body, "stop": long_stop}), "stop")
    assert str(MAX_STOP_CHARS) in error["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    _error(_post(live_server, "/v1/chat/completions", {**chat, "stop": long_stop}), "stop")
    # At the limit, four of them: served.
    at_limit = ["\U0001f600" * MAX_STOP_CHARS] * 4
    assert _post(live_server, "/v1/completions", {**body, "stop": at_limit}).status_code == 200


def test_a_user_over_the_limit_is_refused(live_server: LiveServer) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    too_long = {**body, "user": "u" * (MAX_USER_CHARS + 1)}
    assert (
        str(MAX_USER_CHARS)
        in _error(_post(live_server, "/v1/completions", too_long), "user")["message"]
    )
    at_limit = {**body, "user": "u" * MAX_USER_CHARS}
    assert _post(live_server, "/v1/completions", at_limit).status_code == 200


def test_more_messages_than_the_context_can_hold_are_refused_unrendered(
    live_server: LiveServer,
) -> None:
    num_messages = 2 * live_server.max_model_len + 1
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": ""}] * num_messages,
        "max_tokens": 1,
    }
    started = time.monotonic()
    error = _error(_post(live_server, "/v1/chat/completions", body), "messages")
    assert error["code"] == "context_length_exceeded"
    # Refused from the count alone: before, the template rendered them all and the 400
    # named the tokens they came to.
    assert f"{num_messages} messages" in error["message"], error
    assert time.monotonic() - started < 5
    # A conversation that fits is served as before.
    ok = {**body, "messages": [{"role": "user", "content": "hi"}] * 3}
    assert _post(live_server, "/v1/chat/completions", ok).status_code == 200
