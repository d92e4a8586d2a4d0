"""What the gateway adds to a request: latency (p50, p99) and maximum request rate.

Two servers run side by side on the same uvicorn settings, each in its own process:

- gateway: the real app (`build_app`: auth, validation, usage records, queue, dispatcher,
  engine loop, detokenizer) with the engine's model runner replaced by a null runner that
  returns a token instantly, so the model's compute is out of the picture;
- bare: a plain Starlette endpoint returning the same JSON body;
- gateway+redis (with `--redis URL`): the same app on the shared Redis queue and rate
  limiter instead of the in-process ones, under a key prefix of its own (deleted after),
  so the cost of the Redis round trips shows beside the in-memory figures of the run.

A small raw HTTP/1.1 client (keep-alive) measures latency with one request in flight,
then throughput with many. The null runner is a harness built here, not a product path.

    python benchmarks/gateway_overhead.py [--requests 2000] [--concurrency 32]
        [--redis redis://127.0.0.1:6379/0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this file's folder leads sys.path and its sibling benchmarks (named
# like the packages they measure) would shadow the packages; the checkout goes first.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

PROMPT = "Write one short line."
MAX_TOKENS = 8
NULL_TOKEN_ID = 42  # any id that is not end-of-sequence in tiny-random


class NullRunner:
    """A model runner that 'generates' NULL_TOKEN_ID for every chunk that asks a token."""

    def execute(self, chunks):
        return [NULL_TOKEN_ID if chunk.produces_token else None for chunk in chunks]


def _null_engine():
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    llm = LLMEngine(EngineConfig(model="tiny-random", device="cpu", max_model_len=256))
    llm.runner = NullRunner()  # the harness: keep scheduling, drop the model compute
    return AsyncEngine.from_engine(llm)


def _serve_gateway(
    port: int, data_dir: str, admin_token: str, redis_url: str | None, redis_prefix: str
) -> None:
    import uvicorn

    from gateway.app import build_app
    from gateway.settings import Settings

    settings = Settings(
        data_dir=Path(data_dir),
        admin_token=admin_token,
        device="cpu",
        port=port,
        redis_url=redis_url,
        redis_prefix=redis_prefix,
    )
    app = build_app(settings, engine=_null_engine(), prepare_heap=True)  # as the CLI does
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _serve_bare(port: int, body_path: str) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    body = json.loads(Path(body_path).read_text())

    async def completions(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse(body)

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# ---------------------------------------------------------------- the load generator
class Connection:
    """One keep-alive HTTP/1.1 connection sending the same POST over and over."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def post(self, request: bytes) -> tuple[int, bytes]:
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


def _request_bytes(port: int, key: str | None) -> bytes:
    body = json.dumps(
        {"model": "tiny-random", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    ).encode()
    headers = [
        "POST /v1/completions HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
    ]
    if key:
        headers.append(f"Authorization: Bearer {key}")
    return ("\r\n".join(headers) + "\r\n\r\n").encode() + body


async def latency_ms(port: int, request: bytes, num_requests: int) -> list[float]:
    conn = await Connection.open(port)
    try:
        for _ in range(50):  # warm-up: caches, JIT-free but allocator and auth cache
            await conn.post(request)
        samples = []
        for _ in range(num_requests):
            start = time.perf_counter()
            status, _ = await conn.post(request)
            samples.append((time.perf_counter() - start) * 1000)
            if status != 200:
                raise RuntimeError(f"status {status}")
        return samples
    finally:
        conn.close()


async def max_rate(
    port: int, request: bytes, concurrency: int, duration_s: float
) -> tuple[float, int]:
    """(requests/s, requests completed) with `concurrency` connections for `duration_s`."""
    conns = [await Connection.open(port) for _ in range(concurrency)]
    done = 0
    stop_at = time.perf_counter() + duration_s

    async def worker(conn: Connection) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            status, _ = await conn.post(request)
            if status != 200:
                raise RuntimeError(f"status {status}")
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - start
    for conn in conns:
        conn.close()
    return done / elapsed, done


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc). On a shared machine the
    server's CPU per request is steadier than its request rate, which also measures
    everyone else's load."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_rate(
    port: int, pid: int, request: bytes, concurrency: int, duration_s: float
) -> tuple[float, float]:
    """(requests/s, server CPU microseconds per request) of one throughput run."""
    cpu_before = cpu_seconds(pid)
    rate, num_done = asyncio.run(max_rate(port, request, concurrency, duration_s))
    return rate, (cpu_seconds(pid) - cpu_before) / max(num_done, 1) * 1e6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(port: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {port}")


REPO_ROOT = Path(__file__).resolve().parents[1]


def _spawn(*args: str) -> subprocess.Popen:
    # The servers import the packages from this checkout, whatever the working directory.
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.Popen([sys.executable, __file__, *args], env=env, cwd=REPO_ROOT)


def _make_key(port: int, admin_token: str) -> str:
    import httpx

    with httpx.Client(
        base_url=f"http://127.0.0.1:{port}/admin/v1",
        headers={"authorization": f"Bearer {admin_token}"},
    ) as admin:
        # Limits far above what the load reaches: the limiter runs on every request, as
        # in production, but never refuses (a 429 would end the measurement).
        tenant = admin.post(
            "/tenants",
            json={
                "name": "bench",
                "tier": "interactive",
                "rpm": 2**31 - 1,
                "tpm": 2**31 - 1,
                "max_concurrency": 10**6,
            },
        )
        tenant.raise_for_status()
        key = admin.post(f"/tenants/{tenant.json()['id']}/keys", json={})
        key.raise_for_status()
        return key.json()["secret"]


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="latency samples per server")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration-s", type=float, default=5.0, help="per throughput run")
    parser.add_argument(
        "--redis", metavar="URL", help="also measure the gateway on this Redis (queue, limits)"
    )
    parser.add_argument("--serve", choices=["gateway", "bare"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--arg", help=argparse.SUPPRESS)
    parser.add_argument("--admin-token", help=argparse.SUPPRESS)
    parser.add_argument("--redis-prefix", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "gateway":
        _serve_gateway(args.port, args.arg, args.admin_token, args.redis, args.redis_prefix)
        return
    if args.serve == "bare":
        _serve_bare(args.port, args.arg)
        return

    redis_prefix = f"{{tgbench-{secrets.token_hex(5)}}}:"
    with tempfile.TemporaryDirectory() as tmp:
        admin_token = secrets.token_urlsafe(16)
        servers = [("gateway", _free_port(), Path(tmp) / "memory", [])]
        if args.redis:
            redis_args = ["--redis", args.redis, "--redis-prefix", redis_prefix]
            servers.append(("gateway+redis", _free_port(), Path(tmp) / "redis", redis_args))
        bare_port = _free_port()
        procs = []
        try:
            requests = {}
            for name, port, data_dir, extra in servers:
                data_dir.mkdir()
                proc = _spawn(
                    *("--serve", "gateway", "--port", str(port), "--arg", str(data_dir)),
                    # "=": a token may start with "-", which argparse would take for an option
                    f"--admin-token={admin_token}",
                    *extra,
                )
                procs.append(proc)
                _wait_up(port, proc)
                requests[name] = (
                    port,
                    _request_bytes(port, _make_key(port, admin_token)),
                    proc.pid,
                )
            status, body = asyncio.run(_one(*requests["gateway"][:2]))
            if status != 200:
                raise RuntimeError(f"gateway answered {status}: {body[:300]!r}")
            body_path = Path(tmp) / "body.json"
            body_path.write_bytes(body)
            procs.append(
                _spawn("--serve", "bare", "--port", str(bare_port), "--arg", str(body_path))
            )
            _wait_up(bare_port, procs[-1])
            bare = (bare_port, _request_bytes(bare_port, None), procs[-1].pid)
            requests = {"bare": bare, **requests}

            results = {}
            for name, (port, request, pid) in requests.items():
                samples = asyncio.run(latency_ms(port, request, args.requests))
                rate, cpu_us = measure_rate(port, pid, request, args.concurrency, args.duration_s)
                results[name] = (statistics.median(samples), _pct(samples, 0.99), rate, cpu_us)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=30)
            if args.redis:
                _delete_prefix(args.redis, redis_prefix)

    bare_p50, bare_p99, bare_rate, bare_cpu = results["bare"]
    gw_p50, gw_p99, gw_rate, gw_cpu = results["gateway"]
    print(f"short non-streaming completions, max_tokens={MAX_TOKENS}, null model runner")
    print(f"{'':14}{'p50 ms':>10}{'p99 ms':>10}{'req/s':>10}{'CPU us/req':>12}")
    for name, (p50, p99, rate, cpu_us) in results.items():
        print(f"{name:14}{p50:10.3f}{p99:10.3f}{rate:10.0f}{cpu_us:12.0f}")
    added_p50 = gw_p50 - bare_p50
    print(f"added latency: p50 {added_p50:.3f} ms (goal <= 2 ms), p99 {gw_p99 - bare_p99:.3f} ms")
    print(f"rate ratio gateway/bare: {gw_rate / bare_rate:.2f} (goal >= 0.40)")
    print(f"latency ratio gateway/bare: p50 {gw_p50 / bare_p50:.2f}x, p99 {gw_p99 / bare_p99:.2f}x")
    print(f"server CPU per request ratio bare/gateway: {bare_cpu / gw_cpu:.2f}")
    if "gateway+redis" in results:
        rd_p50, rd_p99, rd_rate, _ = results["gateway+redis"]
        print(
            f"gateway+redis added latency: p50 {rd_p50 - bare_p50:.3f} ms (goal <= 2 ms), "
            f"p99 {rd_p99 - bare_p99:.3f} ms; rate ratio gateway+redis/bare: "
            f"{rd_rate / bare_rate:.2f} (goal >= 0.40)"
        )
        print(
            f"Redis vs in-memory queue: p50 +{rd_p50 - gw_p50:.3f} ms, "
            f"p99 +{rd_p99 - gw_p99:.3f} ms, rate ratio {rd_rate / gw_rate:.2f}"
        )


def _delete_prefix(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        escaped = prefix.replace("{", "\\{").replace("}", "\\}")
        names = list(client.scan_iter(match=escaped + "*", count=1000))
        if names:
            client.delete(*names)
    finally:
        client.close()


async def _one(port: int, request: bytes) -> tuple[int, bytes]:
    conn = await Connection.open(port)
    try:
        return await conn.post(request)
    finally:
        conn.close()


if __name__ == "__main__":
    main()
