"""Redis credentials, with real processes and a redis-server of the test's own: what the
start-up check passes, serving takes; a password Redis refuses is one line at start-up,
and one it starts refusing later (rotated) makes requests 503 and /readyz not ready."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.fleet_processes import RedisServer, free_port
from tests.gateway.conftest import output_until_started, reap

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PATH": "/usr/bin:/bin", "TIERGATE_DEVICE": "cpu", "TIERGATE_MAX_MODEL_LEN": "256"}


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _with_password(url: str, password: str) -> str:
    return url.replace("redis://", f"redis://:{password}@", 1)


def _require_password(server: RedisServer, password: str, *, current: str = "") -> None:
    """Set the server's password (it asks for `current` now) and drop every connection,
    as a restart with a rotated password does (one already authenticated would keep
    working)."""
    admin = redis.Redis.from_url(_with_password(server.url, current))
    try:
        admin.config_set("requirepass", password)
        admin.client_kill_filter(_type="normal", skipme=True)
    finally:
        admin.close()


@pytest.mark.parametrize("command", ["gateway", "worker"])
def test_a_password_redis_refuses_is_one_line_at_start_up(
    tmp_path: Path, redis_server: RedisServer, command: str
) -> None:
    _require_password(redis_server, "right-password")
    url = _with_password(redis_server.url, "wrong-password")
    argv = [command, "--redis-url", url]
    if command == "gateway":
        argv += ["--data-dir", str(tmp_path), "--port", str(free_port())]
    ran = subprocess.run(
        [sys.executable, "-m", "gateway.cli", *argv],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ran.returncode == 2, ran.stderr[-3000:]
    [line] = ran.stderr.splitlines()
    assert line.startswith(
        f"tiergate: error: cannot reach Redis at redis://:***@127.0.0.1:{redis_server.port}/0: "
    )
    assert "WRONGPASS" in line or "invalid username-password" in line, line
    assert "wrong-password" not in line  # a start-up error lands in logs


def test_serve_takes_a_password_redis_does_not_ask_for_and_a_rotated_one_is_a_503(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    # A Redis without a password takes any (redis-py's start-up ping passed), yet every
    # request's script call failed with a 500 and /readyz said the queue was ok.
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--demo", "--port", str(port)],
        cwd=ROOT,
        env={
            **ENV,
            "TIERGATE_DATA_DIR": str(tmp_path),
            "TIERGATE_REDIS_URL": _with_password(redis_server.url, "first"),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    started = ""
    try:
        started = output_until_started(proc)
        keys = dict(re.findall(r"tier=(\w+)\s+(tg-[A-Za-z0-9_-]+)", started))
        assert "interactive" in keys, started[-3000:]
        base = f"http://127.0.0.1:{port}"
        body = {
            "model": "tiny-random",
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 2,
        }
        headers = {"authorization": f"Bearer {keys['interactive']}"}

        def chat() -> httpx.Response:
            return httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60)

        assert chat().status_code == 200
        assert httpx.get(f"{base}/readyz", timeout=10).status_code == 200

        _require_password(redis_server, "second")  # rotated; this process has the old one
        refused = chat()
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "queue_unavailable"
        assert "credentials" in refused.json()["error"]["message"]
        ready = httpx.get(f"{base}/readyz", timeout=10)
        assert ready.status_code == 503
        queue = ready.json()["checks"]["queue"]
        assert queue.startswith("unavailable:"), queue
        assert "password" in queue, queue

        _require_password(
            redis_server, "first", current="second"
        )  # the password this process was given
        assert chat().status_code == 200
        assert httpx.get(f"{base}/readyz", timeout=10).status_code == 200
    finally:
        proc.terminate()
        try:
            output = started + proc.communicate(timeout=30)[0]
        finally:
            reap(proc)
    for noise in ("Internal server error", "Traceback"):
        assert noise not in output, output[-3000:]
