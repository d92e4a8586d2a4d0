"""One multiplexed Redis connection for the queue's script calls.

Every request makes several short script calls (reserve, enqueue, dispatch, publish,
release). Through redis-py's asyncio client each costs about 100 µs of the event loop:
a pooled connection taken and given back, the arguments packed in Python, a timeout
task around the write. Here every call of one process shares a single connection:
commands issued in the same event loop iteration go out in one write, replies come back
in order and are matched to their callers first in, first out, and hiredis packs and
parses in C, which together cost a fraction of that. A blocking read would stall a
shared connection: the result streams' reader (stream_reader.py) opens one of its own
here (`open_connection`), and everything else stays on redis-py.

Errors are redis-py's own classes, so callers map them as before: a refused connection,
a lost one or a reply later than the socket timeout raise ConnectionError or
TimeoutError (the connection is dropped and the next call opens a new one), and a
script's error raises ResponseError. Credentials the server refuses raise
AuthenticationError, a ConnectionError as in redis-py: the queue is unavailable to this
process, which is no script's fault. A script the server does not know (restarted, or
SCRIPT FLUSH) is loaded and called again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.exceptions import ResponseError

DEFAULT_TIMEOUT_S = 5.0
# A reply timer that fires this much later than due says this process did not run for a
# while (stopped, or starved of CPU), not that Redis was slow: the reply may sit in the
# socket unread. The loop then gets STALL_GRACE_S to read it before Redis is blamed (a
# gateway stopped for 12 s failed its streams with "Redis did not answer").
STALL_S = 0.5
STALL_GRACE_S = 0.5
# The replies of a server that will not take this connection's credentials (a password
# rotated, or missing): redis-py raises AuthenticationError for them.
_AUTH_REFUSALS = ("WRONGPASS", "NOAUTH")


async def run_script(script: Any, channel: ScriptChannel | None, args: Sequence[object]) -> Any:
    """Run a script registered with redis-py (`register_script`) with no keys and `args`,
    over `channel` when there is one, else through redis-py."""
    if channel is None:
        return await script(keys=[], args=list(args))
    return await channel.evalsha(script.sha, script.script, args)


class _Protocol(asyncio.Protocol):
    """Replies, in order, to the futures of the commands that asked for them."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.pending: deque[asyncio.Future[Any]] = deque()
        self.outgoing: list[bytes] = []
        self.lost: BaseException | None = None
        self._reader = hiredis.Reader(encoding="utf-8", replyError=ResponseError)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while (reply := self._reader.gets()) is not False:
            future = self.pending.popleft()
            if future.done():  # its caller was cancelled; the reply is dropped
                continue
            if isinstance(reply, ResponseError):
                if str(reply).startswith(_AUTH_REFUSALS):
                    reply = redis_errors.AuthenticationError(
                        f"Redis refused this process's credentials: {reply}"
                    )
                future.set_exception(reply)
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        reason = exc or "closed"
        self.lost = redis_errors.ConnectionError(f"the connection to Redis was lost: {reason}")
        while self.pending:
            future = self.pending.popleft()
            if not future.done():
                future.set_exception(self.lost)

    def flush(self) -> None:
        if self.outgoing and self.transport is not None and self.lost is None:
            self.transport.write(b"".join(self.outgoing))
        self.outgoing.clear()


class ScriptChannel:
    """EVALSHA (and what it needs) over one shared connection; see the module docstring.

    Bound to the event loop of its first call; called from another loop it reconnects.
    """

    def __init__(
        self,
        *,
        host: str = "localhost",
        port: int = 6379,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self._address = (host, port)
        self._handshake: list[tuple[object, ...]] = []
        if password:
            # As redis-py sends it (HELLO 3 AUTH default <password>): a server whose
            # default user has no password takes any, where it refuses the one-argument
            # AUTH ("called without any password configured"). Sent that way, a URL that
            # passed redis-py's start-up check failed every request's script call.
            self._handshake.append(("AUTH", username or "default", password))
        if db:
            self._handshake.append(("SELECT", db))
        if not self._handshake:
            # A server that wants a password answers this NOAUTH as the connection
            # opens; unchecked, the refusal came to a request's script instead, or, for
            # a script with many arguments, a protocol error and a closed connection.
            self._handshake.append(("PING",))
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._protocol: _Protocol | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None

    @classmethod
    def for_client(cls, client: aioredis.Redis) -> ScriptChannel | None:
        """A channel to the server `client` talks to, with its credentials and timeouts;
        None for connections this channel does not make (TLS, Unix sockets)."""
        pool = client.connection_pool
        if pool.connection_class is not aioredis.Connection:
            return None
        kw = pool.connection_kwargs
        return cls(
            host=kw.get("host", "localhost"),
            port=int(kw.get("port", 6379)),
            db=int(kw.get("db", 0) or 0),
            username=kw.get("username"),
            password=kw.get("password"),
            timeout_s=kw.get("socket_timeout") or DEFAULT_TIMEOUT_S,
            connect_timeout_s=kw.get("socket_connect_timeout") or DEFAULT_TIMEOUT_S,
        )

    async def evalsha(self, sha: str, source: str, args: Sequence[object]) -> Any:
        """The reply of script `sha` (its text `source`) run with no keys and `args`."""
        try:
            return await self.call("EVALSHA", sha, 0, *args)
        except ResponseError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        await self.call("SCRIPT", "LOAD", source)
        return await self.call("EVALSHA", sha, 0, *args)

    async def call(self, *command: object) -> Any:
        """The reply of one command that does not block, over the shared connection."""
        protocol = await self._connected()
        return await self.send(protocol, command)

    async def open_connection(self) -> _Protocol:
        """A connection of the caller's own to the same server (same database and
        credentials), for commands that block; `send` on it, `close_connection` it."""
        return await self._open()

    def close_connection(self, protocol: _Protocol) -> None:
        self._drop(protocol)

    async def send(self, protocol: _Protocol, command: tuple[object, ...]) -> Any:
        """The reply of `command` on `protocol`; a reply later than the timeout drops
        the connection (ConnectionError for whatever else waits on it). A connection
        already lost fails the call at once: nothing written to it would be answered."""
        if protocol.lost is not None:
            raise protocol.lost
        # Packed before its reply is awaited: an argument hiredis cannot send (None, a
        # bool) must fail this call alone, not leave a reply owed that never comes and
        # hand every later caller the reply of the one before it.
        packed = hiredis.pack_command(command)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        protocol.pending.append(future)
        if not protocol.outgoing:
            loop.call_soon(protocol.flush)  # this iteration's other commands join the write
        protocol.outgoing.append(packed)
        due = loop.time() + self._timeout_s
        timer = loop.call_at(due, self._expire, protocol, future, due)
        try:
            return await future
        finally:
            timer.cancel()

    def _expire(self, protocol: _Protocol, future: asyncio.Future[Any], due: float | None) -> None:
        """A reply's timer: fail the call and drop the connection, unless the reply came
        or this process was the one not running (`due` given: see STALL_S)."""
        if future.done():
            return
        loop = future.get_loop()
        if due is not None and loop.time() - due > STALL_S:
            loop.call_later(STALL_GRACE_S, self._expire, protocol, future, None)
            return
        future.set_exception(
            redis_errors.TimeoutError(f"Redis did not answer within {self._timeout_s} s")
        )
        # Replies are matched by order: with one missing, none after it can be trusted.
        self._drop(protocol)

    async def _connected(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        protocol = self._protocol
        if protocol is not None and protocol.lost is None and self._loop is loop:
            return protocol
        if protocol is not None:
            self._drop(protocol)
        if self._connecting is None or self._loop is not loop:
            self._loop = loop
            # One connect for every caller that arrives meanwhile; a caller cancelled
            # while waiting does not cancel it for the others.
            self._connecting = connecting = asyncio.ensure_future(self._open())
            connecting.add_done_callback(self._opened)
        return await asyncio.shield(self._connecting)

    def _opened(self, connecting: asyncio.Future[_Protocol]) -> None:
        if self._connecting is connecting:
            self._connecting = None
        if connecting.cancelled() or connecting.exception() is not None:
            return
        self._protocol = connecting.result()

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        host, port = self._address
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, protocol = await loop.create_connection(_Protocol, host, port)
        except (OSError, TimeoutError) as exc:
            raise redis_errors.ConnectionError(
                f"cannot connect to Redis at {host}:{port}: {exc}"
            ) from exc
        try:
            for command in self._handshake:
                await self.send(protocol, command)
        except BaseException:
            self._drop(protocol)
            raise
        return protocol

    def _drop(self, protocol: _Protocol) -> None:
        if protocol.transport is not None:
            with contextlib.suppress(RuntimeError):  # its event loop is closed already
                protocol.transport.abort()  # connection_lost fails whatever still waits
        if self._protocol is protocol:
            self._protocol = None

    async def aclose(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            with contextlib.suppress(RuntimeError):  # its event loop is closed already
                protocol.transport.close()
