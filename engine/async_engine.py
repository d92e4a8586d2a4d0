"""The engine for an asyncio server: the step loop runs in its own thread.

The asyncio side only enqueues commands (add, abort) and awaits per-request queues; the
loop thread owns the LLMEngine exclusively, applies the commands between steps, and
hands the outputs back to the callers' event loop. Model compute releases the GIL, so the
event loop stays responsive while a step runs.

The loop thread competes with the event loop for the GIL for everything else, so its own
bookkeeping per step is kept small: outputs waiting for an event loop that has not yet
taken the previous ones join them without waking it again, and the statistics snapshot
is refreshed at most every STATS_EVERY_S while the engine is busy (always once idle).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.errors import EngineDeadError, EngineError, InvalidRequestError
from engine.llm_engine import EngineStats, LLMEngine, RequestOutput
from engine.request import FinishReason, Priority, SamplingParams
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# How stale the statistics snapshot may be while the engine is busy. Its readers (the
# heartbeat's capacity report, metrics, admission's view of held work) look once a
# second or so, and building it walks every held request: per step, at thousands of
# steps a second, it cost more than the step's scheduling.
STATS_EVERY_S = 0.005


_Item = RequestOutput | BaseException  # what a stream's queue holds


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

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.resumed_token_ids)


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
        self._stats_at_s = time.monotonic()
        # What the latest step left, read by can_accept and newcomer_room from any thread
        # (LLMEngine's own answers are the loop thread's alone).
        self._accepts_any = engine.can_accept()
        self._displacing_below = engine.scheduler.displacing_rank_bound()
        self._room = engine.newcomer_room()
        # Items for each event loop that were handed off but that it has not taken yet.
        self._handoffs: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, _Item]]] = {}

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
        """A snapshot taken by the loop thread: after its latest step when idle, at most
        STATS_EVERY_S old while it steps."""
        return self._stats

    def can_accept(self, rank: int | None = None) -> bool:
        """Whether the engine wants one more request (of `rank`, if given) right now.

        Adds not yet taken by the loop thread count against the room the latest step left
        (LLMEngine.newcomer_room): a dispatcher hands over a step's worth of newcomers at
        once instead of one per step, which under a burst held the rest back in the queue
        a whole step each."""
        if self._dead is not None:
            return False
        pending = self._pending_adds()
        # A rank the engine holds no request of is answered too (StepScheduler's
        # displacing_rank_bound): a dispatcher asks for the best rank queued, and an
        # answer kept only for the ranks running or waiting said no to a better one, so
        # a full engine never took the request that would have preempted its batch work.
        displaces = rank is not None and rank < self._displacing_below
        if not pending:
            return self._accepts_any or displaces
        num_seqs, num_tokens = self._room_left(pending)
        if num_seqs > 0 and num_tokens > 0:
            return True
        # No room for plain newcomers: one of `rank` may still preempt worse work, unless
        # a pending add of its rank or better would be first in line.
        return displaces and not any(c.priority is None or c.priority.rank <= rank for c in pending)

    def newcomer_room(self) -> tuple[int, int]:
        """(requests, prompt tokens) the engine would still take as newcomers: the room
        its latest step left (LLMEngine.newcomer_room) less the adds not yet taken."""
        if self._dead is not None:
            return 0, 0
        return self._room_left(self._pending_adds())

    def _room_left(self, pending: list[_Add]) -> tuple[int, int]:
        num_seqs, num_tokens = self._room
        num_pending_tokens = sum(c.num_tokens for c in pending)
        return max(0, num_seqs - len(pending)), max(0, num_tokens - num_pending_tokens)

    def _pending_adds(self) -> list[_Add]:
        with self._lock:
            return [c for c in self._commands if isinstance(c, _Add)]

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
                    self._took(commands)
                for command in commands:
                    self._apply(command)
                outputs = self._engine.step()
                # A request that stopped before its max_tokens frees held work that the
                # capacity report made as its end is published must not count: the
                # snapshot goes first then (a step that only ran requests out needs
                # none; what they held was down to nothing).
                stopped_early = any(
                    o.finished and o.finish_reason is not FinishReason.LENGTH for o in outputs
                )
                if stopped_early:
                    self._snapshot(force=True)
                self._deliver_all(outputs)
                if not stopped_early:
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
                self._hand_off([(stream, exc)])

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        items = []
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue  # the caller left; its abort command is on the way
                if output.finished:
                    del self._streams[output.request_id]
                items.append((stream, output))
        self._hand_off(items)

    def _deliver(self, output: RequestOutput) -> None:
        with self._lock:
            stream = self._streams.get(output.request_id)
            if stream is not None and output.finished:
                del self._streams[output.request_id]
        if stream is None:
            return  # the caller left; its abort command is on the way
        self._hand_off([(stream, output)])

    def _hand_off(self, items: list[tuple[_Stream, _Item]]) -> None:
        """Give each item to its stream on the stream's event loop, in order.

        A loop is woken (a write to its wake-up pipe, and a GIL hand-over) only when
        nothing already waits for it: a step yields an output for every running request,
        and a loop busy elsewhere takes several steps' outputs in one go."""
        to_wake = []
        with self._lock:
            for stream, item in items:
                loop = stream.loop
                waiting = self._handoffs.get(loop)
                if waiting is None:
                    self._handoffs[loop] = [(stream, item)]
                    to_wake.append(loop)
                else:
                    waiting.append((stream, item))
                    # A loop closed before taking what waited: found out below, its
                    # requests aborted.
                    if loop.is_closed() and loop not in to_wake:
                        to_wake.append(loop)
        for loop in to_wake:
            try:
                loop.call_soon_threadsafe(self._take_handoffs, loop)
            except RuntimeError:  # the callers' event loop is closed
                with self._lock:
                    lost = self._handoffs.pop(loop, [])
                for _, item in lost:
                    if isinstance(item, RequestOutput) and not item.finished:
                        self.abort(item.request_id)

    def _take_handoffs(self, loop: asyncio.AbstractEventLoop) -> None:
        """Runs on `loop`: put everything handed off to it into its streams' queues."""
        with self._lock:
            items = self._handoffs.pop(loop, [])
        for stream, item in items:
            stream.queue.put_nowait(item)

    def _pop_stream(self, request_id: str) -> _Stream | None:
        with self._lock:
            return self._streams.pop(request_id, None)

    def _took(self, commands: list[_Add | _Abort]) -> None:
        """Under the lock, as the loop thread takes `commands`: the adds among them leave
        the pending list but will not show in the room until the step after them ends.
        Counted against the room now, or a dispatcher asking meanwhile saw the whole room
        free again and leased a second step's worth of jobs, which waited in this engine
        while another worker had slots free."""
        adds = [c for c in commands if isinstance(c, _Add)]
        if not adds:
            return
        self._room = self._room_left(adds)
        self._accepts_any = self._accepts_any and min(self._room) > 0
        # They wait in the engine now: nothing of a worse rank displaces them.
        best = min(-math.inf if c.priority is None else c.priority.rank for c in adds)
        self._displacing_below = min(self._displacing_below, best)

    def _snapshot(self, *, force: bool = False) -> None:
        engine = self._engine
        now_s = time.monotonic()
        if force or now_s - self._stats_at_s >= STATS_EVERY_S or not engine.has_unfinished():
            self._stats = engine.stats()
            self._stats_at_s = now_s
        self._accepts_any = engine.can_accept()
        self._displacing_below = engine.scheduler.displacing_rank_bound()
        self._room = engine.newcomer_room()

    def _die(self, error: EngineDeadError) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = error
            streams, self._streams = list(self._streams.values()), {}
            self._commands = []
        self._hand_off([(stream, error) for stream in streams])
