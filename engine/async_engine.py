"""The engine for an asyncio server: the step loop runs in its own thread.

The asyncio side only enqueues commands (add, abort) and awaits per-request queues; the
loop thread owns the LLMEngine exclusively, applies the commands between steps, and
hands each output back with `loop.call_soon_threadsafe`. Model compute releases the GIL,
so the event loop stays responsive while a step runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.errors import EngineDeadError, EngineError, InvalidRequestError
from engine.llm_engine import EngineStats, LLMEngine, RequestOutput
from engine.request import Priority, SamplingParams
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: Priority | None
    resumed_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class _Abort:
    request_id: str


class AsyncEngine:
    """Runs an LLMEngine in a background thread and streams outputs to coroutines."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self._init(LLMEngine(config or EngineConfig()))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> AsyncEngine:
        """Wrap an engine built elsewhere; AsyncEngine owns it from now on."""
        self = cls.__new__(cls)
        self._init(engine)
        return self

    def _init(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._commands: list[_Add | _Abort] = []
        self._streams: dict[str, _Stream] = {}
        self._is_stopping = False
        self._dead: EngineDeadError | None = None
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._stats = engine.stats()
        self._accepts: dict[int | None, bool] = {None: engine.can_accept()}

    # ----------------------------------------------------------------- properties
    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine.tokenizer

    @property
    def model_name(self) -> str:
        return self._engine.model_name

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    def stats(self) -> EngineStats:
        """A snapshot taken by the loop thread after its latest step."""
        return self._stats

    def can_accept(self, rank: int | None = None) -> bool:
        """Whether the engine wants one more request (of `rank`, if given) right now."""
        if self._dead is not None:
            return False
        with self._lock:
            pending = [c.priority for c in self._commands if isinstance(c, _Add)]
        # Queued adds are newcomers the scheduler has not seen yet.
        if pending and (rank is None or any(p is None or p.rank <= rank for p in pending)):
            return False
        return self._accepts.get(rank, self._accepts[None])

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the loop thread (idempotent)."""
        if self._dead is not None:
            raise self._dead
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop thread; every open stream gets EngineDeadError."""
        with self._lock:
            self._is_stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._die(EngineDeadError("the engine was shut down"))

    # ----------------------------------------------------------------- requests
    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        priority: Priority | None = None,
        resumed_token_ids: Sequence[int] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput per generated token, the last with `finished` set.

        Bad input raises a typed EngineError on the first iteration. Leaving the
        iteration early (break, cancellation) aborts the request and frees its blocks.
        `resumed_token_ids`: see LLMEngine.add_request.
        """
        batches = self.generate_batches(
            prompt_token_ids,
            params,
            request_id=request_id,
            priority=priority,
            resumed_token_ids=resumed_token_ids,
        )
        async with contextlib.aclosing(batches):  # leaving early aborts the request
            async for batch in batches:
                for output in batch:
                    yield output

    async def generate_batches(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        priority: Priority | None = None,
        resumed_token_ids: Sequence[int] = (),
    ) -> AsyncIterator[list[RequestOutput]]:
        """As `generate`, but yields lists: every output that arrived since the previous
        list was taken (at least one). A caller that publishes several steps at once
        needs no task of its own to gather them."""
        request_id, stream = self._open(
            prompt_token_ids, params, request_id, priority, resumed_token_ids
        )
        queue = stream.queue
        is_done = False
        try:
            while not is_done:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                batch = []
                for item in items:
                    if isinstance(item, BaseException):
                        is_done = True
                        if batch:
                            yield batch
                        raise item
                    batch.append(item)
                    if item.finished:
                        is_done = True
                        break
                yield batch
        finally:
            if not is_done:
                self.abort(request_id)

    def _open(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None,
        priority: Priority | None,
        resumed_token_ids: Sequence[int],
    ) -> tuple[str, _Stream]:
        """Validate and queue the request for the loop thread; returns its id and stream."""
        if self._dead is not None:
            raise self._dead
        self._engine.validate(prompt_token_ids, params, resumed_token_ids)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if self._dead is not None:
                raise self._dead
            if request_id in self._streams:
                raise InvalidRequestError(
                    f"request id {request_id!r} is already in use", param="request_id"
                )
            self._streams[request_id] = stream
            self._commands.append(
                _Add(
                    request_id,
                    list(prompt_token_ids),
                    params,
                    priority,
                    tuple(resumed_token_ids),
                )
            )
            self._wake.notify()
        return request_id, stream

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its stream (if open) ends with "abort"."""
        with self._lock:
            self._commands.append(_Abort(request_id))
            self._wake.notify()

    # ----------------------------------------------------------------- loop thread
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while (
                        not self._commands
                        and not self._is_stopping
                        and not self._engine.has_unfinished()
                    ):
                        self._wake.wait()
                    if self._is_stopping:
                        return
                    commands, self._commands = self._commands, []
                for command in commands:
                    self._apply(command)
                self._deliver_all(self._engine.step())
                self._snapshot()
        except BaseException as exc:
            logger.exception("engine loop crashed")
            self._die(EngineDeadError(f"the engine loop crashed: {exc!r}"))

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            final = self._engine.abort_request(command.request_id)
            if final is not None:
                self._deliver(final)
            else:
                self._pop_stream(command.request_id)
            return
        try:
            self._engine.add_request(
                command.request_id,
                command.prompt_token_ids,
                command.params,
                command.priority,
                resumed_token_ids=command.resumed_token_ids,
            )
        except EngineError as exc:
            # Refused at add (for example a duplicate id): that caller alone gets it.
            stream = self._pop_stream(command.request_id)
            if stream is not None:
                _send(stream, exc)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        # One thread-safe hand-off per event loop per step, not one per output: each
        # hand-off writes the loop's wake-up pipe, and a step yields an output for every
        # running request.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue  # the caller left; its abort command is on the way
                if output.finished:
                    del self._streams[output.request_id]
                by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the callers' event loop is closed
                for _, output in items:
                    if not output.finished:
                        self.abort(output.request_id)

    def _deliver(self, output: RequestOutput) -> None:
        with self._lock:
            stream = self._streams.get(output.request_id)
            if stream is not None and output.finished:
                del self._streams[output.request_id]
        if stream is None:
            return  # the caller left; its abort command is on the way
        if not _send(stream, output) and not output.finished:
            self.abort(output.request_id)  # its event loop is gone

    def _pop_stream(self, request_id: str) -> _Stream | None:
        with self._lock:
            return self._streams.pop(request_id, None)

    def _snapshot(self) -> None:
        engine = self._engine
        self._stats = engine.stats()
        ranks = {r.priority.rank for r in engine.scheduler.running}
        ranks |= {r.priority.rank for r in engine.scheduler.waiting}
        accepts: dict[int | None, bool] = {None: engine.can_accept()}
        for rank in ranks:
            accepts[rank] = engine.can_accept(rank)
        self._accepts = accepts

    def _die(self, error: EngineDeadError) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = error
            streams, self._streams = list(self._streams.values()), {}
            self._commands = []
        for stream in streams:
            _send(stream, error)


def _put_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    """Runs on the callers' event loop: hand each output to its stream."""
    for stream, output in items:
        stream.queue.put_nowait(output)


def _send(stream: _Stream, item: RequestOutput | BaseException) -> bool:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:  # the caller's event loop is closed
        return False
    return True
