"""What `tiergate serve` checks before it loads the engine, with real processes: a port
in use, and a KV cache larger than the machine's memory, are one line and status 2."""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _serve(
    tmp_path: Path, *argv: str, env: dict[str, str], limit: str = ""
) -> subprocess.CompletedProcess[str]:
    command = shlex.join(
        [sys.executable, "-m", "gateway.cli", "serve", "--data-dir", str(tmp_path), *argv]
    )
    return subprocess.run(
        ["bash", "-c", f"{limit}exec {command}"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "TIERGATE_DEVICE": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_serve_refuses_a_port_in_use_before_loading_the_engine(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ran = _serve(tmp_path, env={"TIERGATE_PORT": str(port)})
    assert ran.returncode == 2, ran.stderr[-3000:]
    # One line: neither uvicorn's error nor the noise of a process that loaded the model.
    assert ran.stderr.splitlines() == [
        f"tiergate: error: cannot listen on 127.0.0.1 port {port}: Address already in use"
    ]


def test_serve_reports_a_kv_cache_the_machine_cannot_hold(tmp_path: Path) -> None:
    # A ceiling on the address space makes the allocation fail at once, on any machine
    # and under any overcommit policy, rather than after it took the memory it could.
    limit = f"ulimit -v {16 * 2**20}; "  # KiB: 16 GiB
    ran = _serve(tmp_path, env={"TIERGATE_KV_CACHE_BYTES": str(2**40)}, limit=limit)
    assert ran.returncode == 2, ran.stderr[-3000:]
    assert "tiergate: error: cannot start the engine" in ran.stderr
    assert "can't allocate memory" in ran.stderr
    assert "Traceback" not in ran.stderr
