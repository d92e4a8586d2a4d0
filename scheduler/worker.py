"""A worker process: one engine fed by one dispatcher from the shared queue.

`run_worker` starts the engine and the dispatcher and returns when `stop` is set (the
`tiergate worker` command sets it on SIGTERM or SIGINT). Stopping drains: the worker
stops leasing, gives running jobs `drain_timeout_s` to finish, puts the rest back in the
queue (another worker resumes each after the tokens already streamed) and lapses its
capacity report so admission stops counting it. A worker needs no database: everything
a job needs travels with it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
from typing import Any, NoReturn

from scheduler.backend import BackendUnavailableError, QueueBackend
from scheduler.dispatcher import Dispatcher, DispatcherConfig, EngineLike

log = logging.getLogger(__name__)


async def run_worker(
    backend: QueueBackend,
    engine: EngineLike,
    stop: asyncio.Event,
    *,
    worker_id: str | None = None,
    config: DispatcherConfig | None = None,
) -> Dispatcher:
    """Serve queued jobs on `engine` until `stop` is set, then drain. Returns the
    dispatcher (its counters) once the engine is shut down."""
    await _maybe_await(engine.start())  # type: ignore[attr-defined]
    dispatcher = Dispatcher(backend, engine, worker_id=worker_id, config=config)
    try:
        try:
            await dispatcher.publish_capacity()
        except BackendUnavailableError as exc:
            log.warning("the queue is unreachable at start (%s); retrying in the background", exc)
        dispatcher.start()
        log.info("worker %s is taking work", dispatcher.worker_id)
        await stop.wait()
        log.info("worker %s is draining", dispatcher.worker_id)
    finally:
        await dispatcher.aclose()
        await _maybe_await(engine.shutdown())  # type: ignore[attr-defined]
    return dispatcher


def stop_on_signals(stop: asyncio.Event) -> None:
    """Set `stop` on SIGTERM (what a pod gets before it is killed) and SIGINT. A second
    signal while the drain runs ends the process at once, as an operator who sends it
    asks: its leases lapse and other workers resume its jobs, as after a crash."""
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            exit_now(signum, "draining")
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)


def exit_now(signum: int, during: str) -> NoReturn:
    """End the process at once, on a second signal while `during` (a drain, a shutdown):
    the logs flushed, the status 128 + the signal, as a process killed by it."""
    log.warning("second %s while %s: exiting now", signal.Signals(signum).name, during)
    logging.shutdown()
    os._exit(128 + signum)


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value
