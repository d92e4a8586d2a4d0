"""vLLM's /tokenize and /detokenize against a live server: counts equal what the
completion endpoints bill, chat goes through the template, ids decode back, and bad
input is a typed error."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.conftest import LiveServer

MODEL = "tiny-random"


def _post(
    server: LiveServer, path: str, body: dict, key: str | None = "interactive"
) -> httpx.Response:
    headers = {} if key is None else {"authorization": f"Bearer {server.keys[key]}"}
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=30)


def test_counts_are_what_a_completion_bills(live_server: LiveServer) -> None:
    client = live_server.client()
    text = "The capital of France is"
    counted = _post(live_server, "/tokenize", {"model": MODEL, "prompt": text}).json()
    billed = client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    assert counted["count"] == len(counted["tokens"]) == billed.usage.prompt_tokens
    assert counted["max_model_len"] == live_server.max_model_len
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    counted = _post(live_server, "/tokenize", {"model": MODEL, "messages": messages}).json()
    billed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert counted["count"] == billed.usage.prompt_tokens
    # Token ids decode back to the text (the tokenizer's special tokens left out).
    ids = _post(live_server, "/tokenize", {"model": MODEL, "prompt": text}).json()["tokens"]
    decoded = _post(live_server, "/detokenize", {"model": MODEL, "tokens": ids}).json()
    assert decoded == {"prompt": text}
    assert "token_strs" not in counted


def test_token_strs_are_the_vocabulary_entries_on_request(live_server: LiveServer) -> None:
    from transformers import AutoTokenizer

    from engine.tokenizer import _ASSETS_DIR

    text = "The capital of France is"
    body = {"model": MODEL, "prompt": text, "return_token_strs": True}
    counted = _post(live_server, "/tokenize", body).json()
    reference = AutoTokenizer.from_pretrained(str(_ASSETS_DIR))
    assert counted["token_strs"] == reference.convert_ids_to_tokens(counted["tokens"])
    assert len(counted["token_strs"]) == counted["count"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"model": MODEL}, 400, "prompt"),
        ("/tokenize", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
        ("/tokenize", {"model": MODEL, "prompt": "x", "messages": []}, 400, "messages"),
        ("/tokenize", {"model": MODEL, "messages": [{"role": "x"}]}, 400, "messages[0].role"),
        ("/tokenize", {"model": MODEL, "prompt": "x", "add_special_tokens": False}, 400, None),
        (
            "/tokenize",
            {"model": MODEL, "prompt": "x", "return_token_strs": 1},
            400,
            "return_token_strs",
        ),
        ("/detokenize", {"model": MODEL, "tokens": [1, -1]}, 400, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": "1 2"}, 400, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": [True]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1]}, 400, "model"),
        ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
    ],
)
def test_bad_input_is_a_typed_error(
    live_server: LiveServer, path: str, body: dict, status: int, param: str | None
) -> None:
    response = _post(live_server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param
    assert error["message"]


def test_a_key_is_needed(live_server: LiveServer) -> None:
    for path, body in (
        ("/tokenize", {"model": MODEL, "prompt": "x"}),
        ("/detokenize", {"model": MODEL, "tokens": [1]}),
    ):
        assert _post(live_server, path, body, key=None).status_code == 401
