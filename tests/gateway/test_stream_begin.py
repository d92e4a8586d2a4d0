"""A client that leaves between the answer's decision and the first SSE chunk.

Under ASGI 2.3 (uvicorn's httptools server), Starlette runs a streamed body in a task
beside one that listens for the client's disconnect; a disconnect that comes first
cancels the body's task before it ever starts the body, so the body's own clean-up
(cancel the jobs, release the rate-limit slots, leave the usage record) never runs. This
drives the real app over ASGI with exactly that order of messages, which a socket cannot
produce reliably, and checks that the request still ends as aborted.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.gateway.conftest import build_test_engine


class AsgiApp:
    """The app, its lifespan run in this event loop, and plain ASGI requests to it."""

    def __init__(self, app: Any, admin_token: str) -> None:
        self.app = app
        self.admin_token = admin_token
        self._events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._replies: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsgiApp:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.3"}}
        self._task = asyncio.create_task(self.app(scope, self._events.get, self._replies.put))
        await self._events.put({"type": "lifespan.startup"})
        assert (await self._replies.get())["type"] == "lifespan.startup.complete"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._events.put({"type": "lifespan.shutdown"})
        await self._replies.get()
        assert self._task is not None
        await self._task

    async def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any],
        token: str,
        receive: Any = None,
        *,
        slow_head: bool = False,
    ) -> tuple[int | None, bytes]:
        """(status, body) of one request; `slow_head`: sending the response's head takes
        a while (a slow socket), the moment a disconnect can overtake the body."""
        raw = json.dumps(body).encode()
        sent: list[dict[str, Any]] = []
        bodies = [{"type": "http.request", "body": raw, "more_body": False}]

        async def body_then_wait() -> dict[str, Any]:
            if bodies:
                return bodies.pop()
            await asyncio.Future()  # the client stays: waits until cancelled
            raise AssertionError

        async def send(message: dict[str, Any]) -> None:
            if slow_head and message["type"] == "http.response.start":
                await asyncio.sleep(0.2)
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"test"),
                (b"content-type", b"application/json"),
                (b"authorization", f"Bearer {token}".encode()),
            ],
            "client": ("127.0.0.1", 1234),
            "server": ("test", 80),
        }
        await self.app(scope, receive or body_then_wait, send)
        status = next((m["status"] for m in sent if m["type"] == "http.response.start"), None)
        content = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return status, content


def _leaves_after_the_answer(raw_body: bytes) -> Any:
    """receive(): the body; then nothing while the route waits for the first output;
    then, to the streamed response's listener, the disconnect at once."""
    calls = 0

    async def receive() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": raw_body, "more_body": False}
        if calls == 2:  # the route's own watch while it waits for the first output
            await asyncio.Future()
        return {"type": "http.disconnect"}

    return receive


@pytest.fixture
async def app(tmp_path) -> AsyncIterator[AsgiApp]:
    from gateway.app import build_app
    from gateway.settings import Settings

    settings = Settings(
        data_dir=tmp_path,
        admin_token=secrets.token_urlsafe(24),
        model="tiny-random",
        device="cpu",
        usage_flush_interval_s=0.05,
    )
    served = AsgiApp(build_app(settings, engine=build_test_engine()), settings.admin_token or "")
    async with served:
        yield served


async def test_a_stream_left_before_its_body_began_ends_as_aborted(app: AsgiApp) -> None:
    admin = app.admin_token
    status, tenant = await app.request(
        "POST", "/admin/v1/tenants", {"name": "left", "tier": "interactive"}, admin
    )
    assert status == 201, tenant
    tenant_id = json.loads(tenant)["id"]
    status, key = await app.request("POST", f"/admin/v1/tenants/{tenant_id}/keys", {}, admin)
    assert status == 201, key
    secret = json.loads(key)["secret"]
    body = {"model": "tiny-random", "prompt": "go", "max_tokens": 200, "stream": True}
    body["logit_bias"] = {"2": -100}  # a long answer, so that it would run on
    status, _ = await app.request(
        "POST",
        "/v1/completions",
        body,
        secret,
        _leaves_after_the_answer(json.dumps(body).encode()),
        slow_head=True,
    )
    assert status is None  # the disconnect came first: not even the head went out
    # The request ended all the same: its usage record says aborted.
    deadline = time.monotonic() + 10
    while True:
        status, usage = await app.request("GET", "/admin/v1/usage", {}, admin)
        lines = json.loads(usage)["data"] if status == 200 else []
        if lines and lines[0]["aborted"] == 1:
            break
        assert time.monotonic() < deadline, usage
        await asyncio.sleep(0.05)
