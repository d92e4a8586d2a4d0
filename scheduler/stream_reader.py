"""A few blocking readers per process for the result streams of all its open jobs.

Each open request waits for its job's result stream. Read with one XREAD BLOCK per
request, every waiting request holds a Redis connection and every event costs a round
trip through redis-py for its request alone. Here one task per connection reads up to
STREAMS_PER_READ streams of the process with a single XREAD and hands each stream's
entries to its follower: one connection per that many open requests, and one round trip
for the events of many.

A follower that joins while its connection's XREAD is blocked would wait for the next
event of some other stream (or the block timeout). The reader therefore interrupts the
blocked call with CLIENT UNBLOCK, sent over the script channel, and reads again with the
new stream included. An UNBLOCK can overtake the XREAD it is meant for (the two travel
on different connections) and then finds nothing to unblock; it is sent again until the
XREAD has returned. A server whose ACL denies CLIENT UNBLOCK turns the reader off for
new streams (`accepts`), which are then read one by one, as without a reader.

A lost connection, or a reply later than the socket timeout, fails every follower of
that connection with its error (the gateway answers 503, as before); the next follower
opens a new connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from redis import exceptions as redis_errors

from scheduler.script_channel import ScriptChannel

log = logging.getLogger(__name__)

Entry = tuple[str, dict[str, str]]  # (entry id, fields) of one stream entry
# A blocked XREAD is unblocked again after this long if the first UNBLOCK overtook it.
UNBLOCK_RETRY_S = 0.001
# Streams one XREAD reads at most. A stream joining interrupts its read, which is then
# sent again with every stream of its connection: capped, that costs O(this) per new
# request instead of O(open requests), for one connection per this many open requests.
STREAMS_PER_READ = 64
# A connection beyond the first that has followed nothing for this long is closed: a
# burst of open requests does not leave its connections behind.
IDLE_S = 30.0


class _Follower:
    """One stream's cursor and the entries read for it that its consumer has not taken."""

    __slots__ = ("cursor", "entries", "error", "waiter")

    def __init__(self, cursor: str) -> None:
        self.cursor = cursor
        self.entries: deque[Entry] = deque()
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None

    def deliver(self, entries: list[Entry]) -> None:
        self.entries.extend(entries)
        self.cursor = entries[-1][0]
        self._wake()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[Entry]:
        while not self.entries:
            if self.error is not None:
                raise self.error
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        taken = list(self.entries)
        self.entries.clear()
        return taken


class StreamReader:
    """Follows many Redis streams with few blocking XREADs; see the module docstring.

    `is_last(fields)` says whether an entry ends its stream: the stream is dropped from
    the next read at once, before its consumer has seen the entry.
    """

    def __init__(
        self,
        channel: ScriptChannel,
        *,
        is_last: Callable[[dict[str, str]], bool],
        block_ms: int = 500,
        count: int = 256,
        streams_per_read: int = STREAMS_PER_READ,
        idle_s: float = IDLE_S,
    ) -> None:
        self._channel = channel
        self._is_last = is_last
        self._block_ms = block_ms
        self._count = count
        self._streams_per_read = streams_per_read
        self._idle_s = idle_s
        self._shards: list[_Shard] = []
        self._shard_of: dict[str, _Shard] = {}  # stream key -> the shard reading it
        self._can_interrupt = True

    def is_following(self, key: str) -> bool:
        return key in self._shard_of

    def accepts(self, key: str) -> bool:
        """Whether `follow(key)` may be called: the stream is not followed yet, and the
        server lets this reader interrupt its reads (CLIENT UNBLOCK; an ACL may deny
        it, and a new follower would then wait for a read's timeout)."""
        return self._can_interrupt and key not in self._shard_of

    async def follow(self, key: str, after: str) -> AsyncIterator[Entry]:
        """The entries of stream `key` after cursor `after`, as they arrive, until one
        `is_last`. One follower per key at a time (see `accepts`)."""
        if key in self._shard_of:
            raise ValueError(f"stream {key} is followed already")
        shard = next((s for s in self._shards if s.has_room()), None)
        if shard is None:
            shard = _Shard(self)
            self._shards.append(shard)
        self._shard_of[key] = shard
        try:
            async for entry in shard.follow(key, after):
                yield entry
        finally:
            if self._shard_of.get(key) is shard:
                del self._shard_of[key]

    def _retire(self, shard: _Shard) -> bool:
        """Forget an idle shard (it then closes); the first one stays, for the next burst
        to start on without a connect."""
        if shard not in self._shards or shard is self._shards[0]:
            return False
        self._shards.remove(shard)
        return True

    def _unblock_denied(self, error: BaseException) -> None:
        if self._can_interrupt:
            log.warning(
                "Redis refused CLIENT UNBLOCK (%s): result streams are read one by one", error
            )
        self._can_interrupt = False

    async def aclose(self) -> None:
        shards, self._shards = self._shards, []
        for shard in shards:
            await shard.aclose()
        self._shard_of.clear()


class _Shard:
    """Up to `streams_per_read` streams read by one blocking XREAD on a connection of
    its own."""

    def __init__(self, owner: StreamReader) -> None:
        self._owner = owner
        self._channel = owner._channel
        self._is_last = owner._is_last
        self._followers: dict[str, _Follower] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._joined: asyncio.Event | None = None
        self._connection: Any = None
        self._client_id: int | None = None
        # The XREAD in flight (a fresh object per call) and the one already interrupted.
        self._reading: object | None = None
        self._interrupted: object | None = None
        self._unblockers: set[asyncio.Task[None]] = set()

    def has_room(self) -> bool:
        return len(self._followers) < self._owner._streams_per_read

    async def follow(self, key: str, after: str) -> AsyncIterator[Entry]:
        self._start()
        follower = _Follower(after)
        self._followers[key] = follower
        self._joined.set()  # type: ignore[union-attr]  # _start made it
        self._interrupt()
        try:
            while True:
                for entry in await follower.take():
                    yield entry
                    if self._is_last(entry[1]):
                        return
        finally:
            if self._followers.get(key) is follower:
                del self._followers[key]

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None and self._loop is loop and not self._task.done():
            return
        if self._loop is not loop:
            # Another event loop (a test's, say): what belonged to the old one is dead.
            self._followers.clear()
            self._connection = self._client_id = self._reading = self._interrupted = None
            self._unblockers.clear()
        self._loop = loop
        self._joined = asyncio.Event()
        self._task = loop.create_task(self._run(), name="result-stream-reader")

    def _interrupt(self) -> None:
        reading = self._reading
        if reading is None or self._interrupted is reading or self._client_id is None:
            return
        self._interrupted = reading
        task = asyncio.get_running_loop().create_task(self._unblock(reading, self._client_id))
        self._unblockers.add(task)
        task.add_done_callback(self._unblockers.discard)

    async def _unblock(self, reading: object, client_id: int) -> None:
        try:
            while self._reading is reading:
                if await self._channel.call("CLIENT", "UNBLOCK", client_id):
                    return
                await asyncio.sleep(UNBLOCK_RETRY_S)  # the XREAD is not blocked yet
        except redis_errors.ResponseError as exc:
            self._owner._unblock_denied(exc)
        except redis_errors.RedisError:
            pass  # the connection's trouble: the reader's own read reports it

    async def _run(self) -> None:
        try:
            await self._read_forever()
        except Exception as exc:
            # A bug here must not leave requests waiting forever: they fail (the gateway
            # answers 503) and the next follower starts a new reader.
            log.exception("the result stream reader failed")
            self._drop_connection()
            error = redis_errors.ConnectionError(f"the result stream reader failed: {exc!r}")
            for follower in self._followers.values():
                follower.fail(error)
            self._followers.clear()

    async def _read_forever(self) -> None:
        joined = self._joined
        assert joined is not None
        while True:
            if not self._followers:
                joined.clear()
                try:
                    await asyncio.wait_for(joined.wait(), self._owner._idle_s)
                except TimeoutError:
                    if not self._followers and self._owner._retire(self):
                        self._drop_connection()
                        return
                continue
            followers = self._followers
            try:
                connection = await self._connect()
                # Copied with no await before the read is marked in flight: whoever joins
                # later sees it in flight and interrupts it.
                followers = dict(self._followers)
                reply = await self._read(connection, followers)
            except redis_errors.RedisError as exc:
                self._drop_connection()
                for key, follower in list(followers.items()):
                    follower.fail(exc)
                    if self._followers.get(key) is follower:
                        del self._followers[key]
                continue
            for key, raw_entries in reply or ():
                follower = followers[key]
                entries = [(entry_id, _fields(flat)) for entry_id, flat in raw_entries]
                follower.deliver(entries)
                if self._is_last(entries[-1][1]) and self._followers.get(key) is follower:
                    del self._followers[key]  # nothing follows; its consumer ends itself

    async def _connect(self) -> Any:
        if self._connection is not None and self._connection.lost is not None:
            # Lost while no read was in flight (Redis restarted, the client was killed):
            # a new connection, and with it a new client id for CLIENT UNBLOCK.
            self._drop_connection()
        if self._connection is None:
            connection = await self._channel.open_connection()
            try:
                self._client_id = int(await self._channel.send(connection, ("CLIENT", "ID")))
            except BaseException:
                self._channel.close_connection(connection)
                raise
            self._connection = connection
        return self._connection

    async def _read(self, connection: Any, followers: dict[str, _Follower]) -> Any:
        owner = self._owner
        command = (
            "XREAD", "COUNT", owner._count, "BLOCK", owner._block_ms, "STREAMS",
            *followers, *(f.cursor for f in followers.values()),
        )  # fmt: skip
        self._reading = reading = object()
        try:
            return await self._channel.send(connection, command)
        finally:
            if self._reading is reading:
                self._reading = None

    def _drop_connection(self) -> None:
        connection, self._connection = self._connection, None
        self._client_id = None
        if connection is not None:
            self._channel.close_connection(connection)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        same_loop = self._loop is asyncio.get_running_loop()
        if same_loop:  # a task of a loop that is gone cannot be cancelled (nor run again)
            for unblocker in list(self._unblockers):
                unblocker.cancel()
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._unblockers.clear()
        error = redis_errors.ConnectionError("the result stream reader was closed")
        for follower in self._followers.values():
            follower.fail(error)
        self._followers.clear()
        self._drop_connection()


def _fields(flat: list[str]) -> dict[str, str]:
    """A stream entry's fields from RESP's flat [name, value, name, value, ...]."""
    return dict(zip(flat[::2], flat[1::2], strict=True))
