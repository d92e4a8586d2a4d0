"""Request heads are bounded before any credential is read: a client without a key can
neither make the server buffer an endless header nor hold sockets open by sending no head
(or a byte now and then). uvicorn's httptools protocol bounds neither by itself."""

from __future__ import annotations

import asyncio
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from uvicorn.server import ServerState

from gateway.http_server import BoundedHttpToolsProtocol, uvicorn_config
from tests.gateway.conftest import ROOT, build_test_engine

HEAD_TIMEOUT_S = 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _closed_by_server(sock: socket.socket, within_s: float) -> tuple[bool, bytes]:
    """Whether the server closed `sock` within `within_s`, and what it sent before."""
    sock.settimeout(0.2)
    received = b""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return True, received
        if not chunk:
            return True, received
        received += chunk
    return False, received


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[str, int]]:
    """`tiergate serve` as an operator runs it (its own process, SQLite, tiny-random)."""
    port = _free_port()
    data_dir = tmp_path_factory.mktemp("head-serve")
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(data_dir),
        "TIERGATE_DATA_DIR": str(data_dir),
        "TIERGATE_DEVICE": "cpu",
        "TIERGATE_MAX_MODEL_LEN": "256",
        "TIERGATE_KV_CACHE_BYTES": str(16 * 2**20),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "tiergate serve exited"
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "tiergate serve did not start"
            time.sleep(0.2)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_serve_answers_a_huge_header_with_431_without_buffering_it(
    served: tuple[str, int],
) -> None:
    url, pid = served
    before = _rss_kib(pid)
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
        chunk = b"a" * 2**20
        try:
            for _ in range(64):  # 64 MiB, were the server to keep reading
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed on us: what the bound does
        closed, received = _closed_by_server(sock, within_s=10)
    assert received.startswith(b"HTTP/1.1 431 "), received[:100]
    assert closed
    # Before, the parser held the whole header, twice over (more than 100 MiB here).
    assert _rss_kib(pid) - before < 32 * 1024
    # The server still serves everyone else, with ordinary heads.
    assert httpx.get(f"{url}/healthz", headers={"x-pad": "a" * 8000}).status_code == 200


@pytest.mark.slow
def test_serve_uses_the_bounded_protocol(served: tuple[str, int]) -> None:
    # A head just under the bound is served; the same head one chunk larger is not.
    url, _pid = served
    ok = httpx.get(f"{url}/healthz", headers={"x-pad": "a" * 60_000})
    assert ok.status_code == 200
    try:
        status = httpx.get(f"{url}/healthz", headers={"x-pad": "a" * 200_000}).status_code
    except httpx.TransportError:  # closed while the client still sent its head
        status = None
    assert status in (431, None)


class _ShortDeadline(BoundedHttpToolsProtocol):
    head_timeout_s = HEAD_TIMEOUT_S


@pytest.fixture(scope="module")
def short_deadline_server(tmp_path_factory) -> Iterator[int]:
    """The real app on uvicorn with the serving commands' config, the head deadline short."""
    from gateway.app import build_app
    from gateway.settings import Settings

    data_dir = tmp_path_factory.mktemp("head-deadline")
    settings = Settings(
        data_dir=data_dir,
        database_url=f"sqlite+aiosqlite:///{data_dir / 'tiergate.db'}",
        admin_token=secrets.token_urlsafe(24),
        model="tiny-random",
        device="cpu",
    )
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    config = uvicorn_config(
        build_app(settings, engine=build_test_engine()),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
    )
    assert config.http is BoundedHttpToolsProtocol
    config.http = _ShortDeadline
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        listener.close()


def test_a_connection_that_sends_no_head_is_closed(short_deadline_server: int) -> None:
    with socket.create_connection(("127.0.0.1", short_deadline_server)) as sock:
        closed, _ = _closed_by_server(sock, within_s=HEAD_TIMEOUT_S + 4)
    assert closed  # before, it stayed open for good


def test_a_head_trickled_in_is_closed_at_the_deadline(short_deadline_server: int) -> None:
    with socket.create_connection(("127.0.0.1", short_deadline_server)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        closed = False
        while time.monotonic() - started < HEAD_TIMEOUT_S + 4 and not closed:
            try:
                sock.sendall(b"X-A: b\r\n")  # a header line every 0.2 s, never the end
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            closed, _ = _closed_by_server(sock, within_s=0.2)
    assert closed


def test_a_kept_alive_connection_is_bounded_on_its_next_head(short_deadline_server: int) -> None:
    with socket.create_connection(("127.0.0.1", short_deadline_server)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and then nothing
        closed, received = _closed_by_server(sock, within_s=HEAD_TIMEOUT_S + 4)
    assert closed
    assert received == b""


def test_requests_that_send_their_head_are_served_past_the_deadline(
    short_deadline_server: int,
) -> None:
    # The deadline is on the head only: a request slower than it, once its head is in,
    # and a kept-alive connection reused after it, are served.
    with httpx.Client(base_url=f"http://127.0.0.1:{short_deadline_server}") as client:
        assert client.get("/healthz").status_code == 200
        time.sleep(HEAD_TIMEOUT_S / 2)
        assert client.get("/healthz").status_code == 200
    with socket.create_connection(("127.0.0.1", short_deadline_server)) as sock:
        body = b'{"model": "tiny-random"}'
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        time.sleep(HEAD_TIMEOUT_S + 0.5)
        sock.sendall(body)
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 401 ")  # answered, not closed


class _Loopback(asyncio.Transport):
    """The socket side of one connection, in memory: what the server wrote, and whether
    it closed. Which bytes arrive in which read is up to the kernel on a real socket;
    here the test decides, to put a request's end and the next head in one read."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 80), "peername": ("127.0.0.1", 5555)}.get(name, default)

    def is_closing(self) -> bool:
        return self.closed

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


async def _ok(scope: dict[str, Any], receive: Any, send: Any) -> None:
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_a_pipelined_body_read_with_the_next_head_is_not_counted_as_head() -> None:
    config = uvicorn.Config(_ok, log_level="warning", access_log=False)
    config.load()
    protocol = BoundedHttpToolsProtocol(config=config, server_state=ServerState(), app_state={})
    transport = _Loopback()
    protocol.connection_made(transport)
    body = b"x" * 200_000
    protocol.data_received(b"POST / HTTP/1.1\r\nHost: x\r\ncontent-length: 200000\r\n\r\n")
    protocol.data_received(body[:50_000])
    await asyncio.sleep(0.01)
    # 150 kB of the POST's body, then half of the next request's head, in one read.
    protocol.data_received(body[50_000:] + b"GET / HTTP/1.1\r\nHo")
    protocol.data_received(b"st: x\r\n\r\n")
    await asyncio.sleep(0.05)
    assert not transport.closed  # before: a 431 and a closed connection
    assert transport.written.count(b"HTTP/1.1 200 ") == 2
    protocol.connection_lost(None)
