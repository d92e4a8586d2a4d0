"""Helpers for tests that run real `tiergate` processes (gateways, workers) side by side."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

from scheduler.keys import KeySpace

ROOT = Path(__file__).resolve().parents[1]
# Every process of a fleet shares two cores: one torch thread each avoids oversubscription.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# The log files of every process spawned here: a failing test shows what they wrote
# while it ran (conftest.py), since a fleet's processes are the ones that saw the fault.
SPAWNED_LOGS: set[Path] = set()


def fleet_env(
    *,
    database_url: str,
    redis_url: str,
    prefix: str,
    admin_token: str,
    data_dir: Path,
    **extra: str,
) -> dict[str, str]:
    """The environment every process of a test fleet shares: one database, one Redis
    prefix, the tiny model with a short context, one torch thread."""
    return {
        **os.environ,
        **ONE_THREAD,
        "TIERGATE_DATABASE_URL": database_url,
        "TIERGATE_REDIS_URL": redis_url,
        "TIERGATE_REDIS_PREFIX": prefix,
        "TIERGATE_ADMIN_TOKEN": admin_token,
        "TIERGATE_MODEL": "tiny-random",
        "TIERGATE_MAX_MODEL_LEN": "256",
        "TIERGATE_DATA_DIR": str(data_dir),
        **extra,
    }


@dataclass(frozen=True)
class FleetSetup:
    """What the processes of one test fleet share."""

    database_url: str
    prefix: str
    admin_token: str
    env: dict[str, str]
    logs: Path


@contextlib.contextmanager
def fleet_setup(
    tmp_path_factory: Any, name: str, redis_url: str, **extra_env: str
) -> Iterator[FleetSetup]:
    """A fresh, migrated PostgreSQL database, a Redis key prefix and the shared
    environment for a fleet named `name`; both are removed afterwards (stop the
    fleet's processes first, inside the block)."""
    from gateway.migrate import upgrade_to_head
    from tests.conftest import _create_postgres_database, _drop_postgres_database

    database_url = _create_postgres_database()
    prefix = f"{{tg{name}-{uuid.uuid4().hex[:10]}}}:"
    try:
        upgrade_to_head(database_url)
        logs = tmp_path_factory.mktemp(name)
        admin_token = secrets.token_urlsafe(16)
        env = fleet_env(
            database_url=database_url,
            redis_url=redis_url,
            prefix=prefix,
            admin_token=admin_token,
            data_dir=logs,
            **extra_env,
        )
        yield FleetSetup(database_url, prefix, admin_token, env, logs)
    finally:
        delete_redis_prefix(redis_url, prefix)
        _drop_postgres_database(database_url)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_tiergate(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """`tiergate ARGS` in a child process whose output is appended to `log`."""
    SPAWNED_LOGS.add(log)
    with log.open("ab") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", *args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def spawn_worker(
    name: str, env: dict[str, str], logs: Path, *, max_num_seqs: int, lease_ms: int
) -> subprocess.Popen:
    """`tiergate worker` on the CPU with a small KV cache, logging to `logs/NAME.log`."""
    return spawn_tiergate(
        [
            "worker",
            "--device=cpu",
            "--kv-cache-bytes=16777216",
            f"--max-num-seqs={max_num_seqs}",
            f"--lease-ms={lease_ms}",
            "--drain-timeout-s=5",
            f"--worker-id={name}",
        ],
        env,
        logs / f"{name}.log",
    )


def wait_ready(url: str, procs: list[subprocess.Popen], timeout_s: float = 180.0) -> None:
    """Until `url`/readyz answers 200; fails at once if a process of the fleet exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a fleet process exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not become ready")


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM (the processes drain), then SIGKILL whatever is still up after 30 s."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class RedisServer:
    """A redis-server of a test's own on a free port (never the shared one), to stop,
    pause (SIGSTOP: connections hang, as with a stalled server) and resume."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        SPAWNED_LOGS.add(self._log)
        with self._log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1"),
                    *("--save", "", "--appendonly", "no", "--daemonize", "no"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        client = redis.Redis.from_url(self.url)
        try:
            deadline = time.monotonic() + 10.0
            while not _pings(client):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis-server on port {self.port} did not start")
                time.sleep(0.05)
        finally:
            client.close()

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def delete_redis_prefix(redis_url: str, prefix: str) -> None:
    """Remove every key a fleet made under its own prefix."""
    client = redis.Redis.from_url(redis_url)
    try:
        names = list(client.scan_iter(match=KeySpace(prefix).pattern(), count=1000))
        if names:
            client.delete(*names)
    finally:
        client.close()
