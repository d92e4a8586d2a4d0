"""HTTP edges: Allow on 405s, compressed bodies (415), trailing slashes (404, never a
redirect), HEAD on GET routes, and CLI ids that would change the request's path."""

from __future__ import annotations

import gzip
import json
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from gateway import admin_cli, batch_cli

if TYPE_CHECKING:
    from tests.gateway.conftest import LiveServer

MODEL = "tiny-random"


def _assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["x-request-id"].startswith("req_")
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert error["code"] == code
    return error


def _headers(server: LiveServer, path: str) -> dict[str, str]:
    token = server.admin_token if path.startswith("/admin/") else server.keys["interactive"]
    return {"authorization": f"Bearer {token}"}


def _allow(response: httpx.Response) -> set[str]:
    values = response.headers.get_list("allow")
    assert len(values) == 1, values  # one Allow, not Starlette's and ours
    return {method.strip() for method in values[0].split(",")}


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/v1/completions", {"POST"}),
        ("DELETE", "/v1/chat/completions", {"POST"}),
        ("OPTIONS", "/v1/completions", {"POST"}),
        ("OPTIONS", "/v1/models", {"GET", "HEAD"}),
        ("PUT", "/v1/batches", {"GET", "HEAD", "POST"}),
        ("POST", "/v1/files/file-nope", {"GET", "HEAD", "DELETE"}),
        ("PUT", "/admin/v1/tiers", {"GET", "HEAD", "POST"}),
        ("POST", "/admin/v1/tiers/gold", {"GET", "HEAD", "PATCH", "DELETE"}),
        ("GET", "/admin/v1/keys/key_0", {"DELETE"}),
        ("POST", "/admin/ui/api/live", {"GET", "HEAD"}),
        ("POST", "/admin/ui", {"GET", "HEAD"}),
    ],
)
def test_405_names_every_method_the_path_takes_in_allow(
    live_server: LiveServer, method: str, path: str, allowed: set[str]
) -> None:
    response = httpx.request(
        method, f"{live_server.base_url}{path}", headers=_headers(live_server, path)
    )
    _assert_error(response, 405, "method_not_allowed")
    assert _allow(response) == allowed


def test_head_on_a_post_route_is_405_with_allow_and_no_body(live_server: LiveServer) -> None:
    response = httpx.head(f"{live_server.base_url}/v1/completions")
    assert response.status_code == 405
    assert _allow(response) == {"POST"}
    assert response.content == b""


def _completion_body() -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()


def _multipart_upload() -> tuple[bytes, str]:
    request = httpx.Request(
        "POST",
        "http://unused/v1/files",
        data={"purpose": "batch"},
        files={"file": ("in.jsonl", b'{"custom_id": "a"}\n', "application/jsonl")},
    )
    return request.read(), request.headers["content-type"]


@pytest.mark.parametrize(
    "path",
    [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/batches",
        "/v1/files",
        "/admin/v1/tiers",
        "/admin/v1/tenants",
    ],
)
@pytest.mark.parametrize("encoding", ["gzip", "GZip", "identity, gzip", "br"])
def test_a_compressed_body_is_415_on_every_route_that_reads_one(
    live_server: LiveServer, path: str, encoding: str
) -> None:
    headers = _headers(live_server, path)
    if path == "/v1/files":
        body, headers["content-type"] = _multipart_upload()
    else:
        body, headers["content-type"] = _completion_body(), "application/json"
    headers["content-encoding"] = encoding
    response = httpx.post(
        f"{live_server.base_url}{path}", headers=headers, content=gzip.compress(body)
    )
    error = _assert_error(response, 415, "unsupported_content_encoding")
    named = encoding.split(",")[-1].strip().lower()
    assert named in error["message"]
    assert "identity" not in error["message"]
    assert response.headers["accept-encoding"] == "identity"


def test_a_compressed_body_without_content_length_is_415(live_server: LiveServer) -> None:
    def chunks():
        yield gzip.compress(_completion_body())

    headers = {**_headers(live_server, "/v1/completions"), "content-encoding": "deflate"}
    response = httpx.post(
        f"{live_server.base_url}/v1/completions", headers=headers, content=chunks()
    )
    assert "deflate" in _assert_error(response, 415, "unsupported_content_encoding")["message"]


def test_identity_and_a_body_less_request_are_let_through(live_server: LiveServer) -> None:
    headers = {
        **_headers(live_server, "/v1/completions"),
        "content-type": "application/json",
        "content-encoding": "identity",
    }
    done = httpx.post(
        f"{live_server.base_url}/v1/completions", headers=headers, content=_completion_body()
    )
    assert done.status_code == 200, done.text
    listed = httpx.get(
        f"{live_server.base_url}/v1/models",
        headers={**_headers(live_server, "/v1/models"), "content-encoding": "gzip"},
    )
    assert listed.status_code == 200, listed.text


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/completions/"),
        ("POST", "/v1/chat/completions/"),
        ("GET", "/v1/batches/"),
        ("POST", "/v1/files/"),
        ("GET", "/healthz/"),
        ("GET", "/admin/v1/tiers/"),
        ("GET", "/admin/v1"),
        ("GET", "/admin/ui/api/live/"),
    ],
)
def test_a_trailing_slash_is_an_unknown_url_not_a_redirect(
    live_server: LiveServer, method: str, path: str
) -> None:
    response = httpx.request(
        method,
        f"{live_server.base_url}{path}",
        headers=_headers(live_server, path),
        json={"model": MODEL, "prompt": "x"} if method == "POST" else None,
    )
    assert "location" not in response.headers
    _assert_error(response, 404, "unknown_url")


def test_the_dashboard_address_still_leads_to_the_dashboard(live_server: LiveServer) -> None:
    response = httpx.get(f"{live_server.base_url}/admin/ui")
    assert response.is_redirect
    assert response.headers["location"] == "/admin/ui/"
    assert httpx.get(f"{live_server.base_url}/admin/ui", follow_redirects=True).status_code == 200


@pytest.mark.parametrize("path", ["/healthz", "/v1/models", "/admin/v1/tiers"])
def test_head_on_a_get_route_is_the_get_without_a_body(live_server: LiveServer, path: str) -> None:
    headers = _headers(live_server, path)
    got = httpx.get(f"{live_server.base_url}{path}", headers=headers)
    head = httpx.head(f"{live_server.base_url}{path}", headers=headers)
    assert got.status_code == head.status_code == 200
    assert got.content
    assert head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]
    assert head.headers["x-request-id"].startswith("req_")


@pytest.fixture
def nothing_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("the CLI sent a request")

    monkeypatch.setattr(httpx.Client, "send", refuse)


ADMIN_FLAGS = ["--url", "http://127.0.0.1:9", "--admin-token", "token"]


@pytest.mark.parametrize(
    "argv",
    [
        ["tiers", "get", "."],
        ["tiers", "get", ".."],
        ["tiers", "delete", ".."],
        ["tiers", "update", ".", "--rank", "3"],
        ["tenants", "get", ".."],
        ["tenants", "get", "ten_x/keys"],
        ["tenants", "delete", "."],
        ["keys", "list", ".."],
        ["keys", "create", "."],
        ["keys", "revoke", ".."],
    ],
)
def test_admin_cli_refuses_ids_that_would_change_the_path(
    nothing_sent: None, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    assert admin_cli.main([*argv[:2], *ADMIN_FLAGS, *argv[2:]]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("tiergate admin: ")
    assert repr(argv[2]) in err


def test_admin_cli_after_is_a_query_value_not_a_path(
    live_server: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # "=": a generated token may start with "-", which argparse would take for an option.
    flags = ["--url", live_server.base_url, f"--admin-token={live_server.admin_token}"]
    # Sent (a dot in a query changes no path); the server refuses the cursor itself.
    assert admin_cli.main(["tenants", "list", *flags, "--after", ".."]) == 1
    assert json.loads(capsys.readouterr().err)["error"]["param"] == "after"


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "."],
        ["status", ".."],
        ["status", "batch_x/cancel"],
        ["cancel", "."],
        ["results", "..", "-o", "out.jsonl"],
    ],
)
def test_batch_cli_refuses_ids_that_would_change_the_path(
    nothing_sent: None, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    flags = ["--url", "http://127.0.0.1:9", "--api-key", "tg-key"]
    assert batch_cli.main([*argv, *flags]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("tiergate batch: the batch id ")
    assert repr(argv[1]) in err
