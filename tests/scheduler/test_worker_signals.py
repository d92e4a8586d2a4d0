"""A worker's signals: the first starts the drain, a second one ends the process at
once (an operator escalating past a drain that does not end), in a real process."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from scheduler.worker import stop_on_signals

    async def main():
        stop = asyncio.Event()
        stop_on_signals(stop)
        print("ready", flush=True)
        await stop.wait()
        print("draining", flush=True)
        await asyncio.sleep(60)  # a drain that does not end

    asyncio.run(main())
    """
)


def test_a_second_sigterm_ends_a_drain_that_does_not() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "draining"
        time.sleep(0.2)
        assert proc.poll() is None  # one signal: the drain runs
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert proc.wait(timeout=10) == 128 + signal.SIGTERM
        assert time.monotonic() - started < 5
        assert "second SIGTERM while draining" in (proc.stderr.read() if proc.stderr else "")
