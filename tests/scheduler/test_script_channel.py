"""The multiplexed script connection against a real Redis: replies reach their callers
in order under concurrency and cancellation, unknown scripts are loaded, and a lost,
silent or absent server raises redis-py's own errors and is recovered from."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid

import pytest
import redis.asyncio as aioredis
import uvloop
from redis import exceptions as redis_errors

from scheduler.backend import BackendUnavailableError
from scheduler.keys import KeySpace
from scheduler.redis_backend import RedisBackend
from scheduler.script_channel import ScriptChannel
from tests.fleet_processes import RedisServer

from .conftest import REDIS_URL

ECHO = "return {ARGV[1], tonumber(ARGV[2]) * 2}"


@contextlib.asynccontextmanager
async def channel_to(url: str = REDIS_URL, **kwargs):
    client = aioredis.Redis.from_url(url, decode_responses=True, **kwargs)
    channel = ScriptChannel.for_client(client)
    assert channel is not None
    try:
        yield client, channel
    finally:
        await channel.aclose()
        await client.aclose()


async def test_concurrent_calls_get_their_own_replies_over_one_connection(redis_client) -> None:
    async with channel_to() as (client, channel):
        echo = client.register_script(ECHO)
        await channel.evalsha(echo.sha, echo.script, ["warm", 0])
        connection = channel._protocol
        replies = await asyncio.gather(
            *(channel.evalsha(echo.sha, echo.script, [f"call-{i}", i]) for i in range(500))
        )
        assert replies == [[f"call-{i}", 2 * i] for i in range(500)]
        # All of them went over the one connection the first call opened.
        assert channel._protocol is connection
        ours = [c for c in await redis_client.client_list() if c["addr"] == _local_address(channel)]
        assert [c["cmd"] for c in ours] == ["evalsha"]


def _local_address(channel: ScriptChannel) -> str:
    protocol = channel._protocol
    assert protocol is not None
    assert protocol.transport is not None
    host, port = protocol.transport.get_extra_info("sockname")[:2]
    return f"{host}:{port}"


async def test_a_cancelled_caller_does_not_shift_the_replies_of_the_others() -> None:
    async with channel_to() as (client, channel):
        slow = client.register_script("redis.call('SET', ARGV[1], 1) return ARGV[1]")
        echo = client.register_script(ECHO)
        await channel.evalsha(echo.sha, echo.script, ["warm", 0])
        calls = [
            asyncio.ensure_future(channel.evalsha(echo.sha, echo.script, [f"c{i}", i]))
            for i in range(50)
        ]
        for call in calls[::3]:
            call.cancel()
        key = f"{{test-{uuid.uuid4().hex[:8]}}}:x"
        assert await channel.evalsha(slow.sha, slow.script, [key]) == key
        await client.delete(key)
        for i, call in enumerate(calls):
            if i % 3 == 0:
                assert call.cancelled()
            else:
                assert await call == [f"c{i}", 2 * i]


async def test_an_argument_it_cannot_send_fails_that_call_alone() -> None:
    async with channel_to() as (client, channel):
        echo = client.register_script(ECHO)
        await channel.evalsha(echo.sha, echo.script, ["warm", 0])
        for bad in (None, True):
            with pytest.raises(TypeError):
                await channel.evalsha(echo.sha, echo.script, ["bad", bad])
        # The connection owes nobody a reply: the next callers get their own at once.
        replies = await asyncio.wait_for(
            asyncio.gather(
                *(channel.evalsha(echo.sha, echo.script, [f"c{i}", i]) for i in range(5))
            ),
            2.0,
        )
        assert replies == [[f"c{i}", 2 * i] for i in range(5)]


async def test_an_unknown_script_is_loaded_and_a_script_error_is_a_response_error() -> None:
    async with channel_to() as (client, channel):
        # A script no server has seen (its text is unique), so the first call is NOSCRIPT.
        fresh = client.register_script(f"return '{uuid.uuid4().hex}'")
        assert len(await channel.evalsha(fresh.sha, fresh.script, [])) == 32
        failing = client.register_script("return redis.error_reply('ERR refused on purpose')")
        with pytest.raises(redis_errors.ResponseError, match="refused on purpose"):
            await channel.evalsha(failing.sha, failing.script, [])
        echo = client.register_script(ECHO)
        assert await channel.evalsha(echo.sha, echo.script, ["after", 1]) == ["after", 2]


async def test_a_killed_connection_is_replaced_by_the_next_call(redis_client) -> None:
    async with channel_to() as (client, channel):
        echo = client.register_script(ECHO)
        assert await channel.evalsha(echo.sha, echo.script, ["first", 1]) == ["first", 2]
        address = _local_address(channel)
        assert await redis_client.client_kill(address)
        await asyncio.sleep(0.1)  # the close reaches the channel
        assert await channel.evalsha(echo.sha, echo.script, ["again", 2]) == ["again", 4]
        assert _local_address(channel) != address


async def test_a_connection_lost_mid_call_fails_the_call_and_the_next_reconnects() -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        await reader.read(4096)
        writer.close()  # a command arrived: hang up without a reply

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with channel_to(f"redis://127.0.0.1:{port}/0") as (client, channel):
            echo = client.register_script(ECHO)
            calls = [channel.evalsha(echo.sha, echo.script, [f"c{i}", i]) for i in range(3)]
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            assert all(isinstance(o, redis_errors.ConnectionError) for o in outcomes)
            with pytest.raises(redis_errors.ConnectionError):
                await channel.evalsha(echo.sha, echo.script, ["next", 1])
            assert len(accepted) == 2  # the next call opened a new connection
    finally:
        server.close()
        await server.wait_closed()


async def test_no_server_is_a_connection_error_and_the_queue_says_unavailable() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"redis://127.0.0.1:{port}/0"
    async with channel_to(url, socket_connect_timeout=0.5) as (client, channel):
        echo = client.register_script(ECHO)
        with pytest.raises(redis_errors.ConnectionError):
            await channel.evalsha(echo.sha, echo.script, ["x", 1])
        backend = RedisBackend(client, keys=KeySpace("{test-down}:"), channel=channel)
        with pytest.raises(BackendUnavailableError):
            await backend.dispatch("w", 1_000)


async def test_a_silent_server_times_out_each_call() -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        while await reader.read(4096):
            pass

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        url = f"redis://127.0.0.1:{port}/0"
        async with channel_to(url, socket_timeout=0.2) as (client, channel):
            echo = client.register_script(ECHO)
            for _ in range(2):
                with pytest.raises(redis_errors.TimeoutError):
                    await channel.evalsha(echo.sha, echo.script, ["x", 1])
            # Each timeout dropped its connection: the second call opened another.
            assert len(accepted) == 2
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_a_reply_that_came_while_this_process_stood_still_is_no_timeout() -> None:
    # A gateway stopped past the reply timeout (SIGSTOP, a starved CPU) found the reply
    # in its socket when it ran again, yet failed its streams with "Redis did not
    # answer": the timer had fired in the same loop pass that read the reply.
    async with channel_to(socket_timeout=0.2) as (client, channel):
        echo = client.register_script(ECHO)
        assert await channel.evalsha(echo.sha, echo.script, ["warm", 1]) == ["warm", 2]
        call = asyncio.ensure_future(channel.evalsha(echo.sha, echo.script, ["x", 2]))
        protocol = channel._protocol
        while not protocol.pending or protocol.outgoing:  # noqa: ASYNC110 (until it is written)
            await asyncio.sleep(0)
        # The process does not run (the loop is held); Redis answers meanwhile.
        time.sleep(0.9)  # noqa: ASYNC251
        assert await call == ["x", 4]
        assert await channel.evalsha(echo.sha, echo.script, ["y", 3]) == ["y", 6]
        assert channel._protocol is protocol  # no timeout dropped the connection


async def test_the_handshake_selects_the_database_of_the_url() -> None:
    key = f"{{test-{uuid.uuid4().hex[:8]}}}:db"
    async with channel_to(REDIS_URL.rsplit("/", 1)[0] + "/3") as (client, channel):
        setter = client.register_script("return redis.call('SET', ARGV[1], 'here')")
        await channel.evalsha(setter.sha, setter.script, [key])
        assert await client.get(key) == "here"  # redis-py on db 3 sees it
        await client.delete(key)


def test_on_uvloop_as_the_servers_run_it() -> None:
    # uvloop's transports are not asyncio's classes; the servers run on uvloop.
    async def scenario() -> None:
        async with channel_to() as (client, channel):
            echo = client.register_script(ECHO)
            replies = await asyncio.gather(
                *(channel.evalsha(echo.sha, echo.script, [f"u{i}", i]) for i in range(100))
            )
            assert replies == [[f"u{i}", 2 * i] for i in range(100)]
            address = _local_address(channel)
            assert await client.client_kill(address)
            await asyncio.sleep(0.1)
            assert await channel.evalsha(echo.sha, echo.script, ["again", 2]) == ["again", 4]
            assert _local_address(channel) != address

    uvloop.run(scenario())


async def test_connections_it_does_not_make_stay_on_redis_py() -> None:
    # TLS and Unix sockets: no channel, so the queue's scripts go through redis-py.
    for url in ("rediss://127.0.0.1:6380/0", "unix:///nonexistent/redis.sock"):
        client = aioredis.Redis.from_url(url, decode_responses=True)
        try:
            assert ScriptChannel.for_client(client) is None
        finally:
            await client.aclose()


async def test_a_password_the_server_does_not_ask_for_is_taken_as_redis_py_takes_it() -> None:
    # redis-py authenticates as the default user (HELLO 3 AUTH default <password>), which
    # a server without a password accepts with any password. The channel sent the
    # one-argument AUTH, which such a server refuses ("called without any password
    # configured"): the start-up ping passed, then every request's script call failed.
    url = REDIS_URL.replace("redis://", "redis://:not-asked-for@", 1)
    async with channel_to(url) as (client, channel):
        assert await client.ping()
        echo = client.register_script(ECHO)
        assert await channel.evalsha(echo.sha, echo.script, ["in", 1]) == ["in", 2]


async def test_refused_credentials_are_an_authentication_error_and_the_queue_unavailable(
    tmp_path,
) -> None:
    server = RedisServer(tmp_path / "redis.log")
    server.start()
    try:
        async with channel_to(server.url) as (admin, _):
            await admin.config_set("requirepass", "right")
        for url, refusal in (
            (server.url.replace("redis://", "redis://:wrong@", 1), "WRONGPASS"),
            (server.url, "NOAUTH"),  # no password at all, on a server that wants one
        ):
            async with channel_to(url) as (client, channel):
                echo = client.register_script(ECHO)
                # A ConnectionError (AuthenticationError is one), as redis-py raises it:
                # the queue is unavailable to this process, not a script's error.
                with pytest.raises(redis_errors.AuthenticationError, match=refusal):
                    await channel.evalsha(echo.sha, echo.script, ["x", 1])
                backend = RedisBackend(client, keys=KeySpace("{test-auth}:"), channel=channel)
                with pytest.raises(BackendUnavailableError, match=refusal):
                    await backend.dispatch("w", 1_000)
        right = server.url.replace("redis://", "redis://:right@", 1)
        async with channel_to(right) as (client, channel):
            echo = client.register_script(ECHO)
            assert await channel.evalsha(echo.sha, echo.script, ["in", 1]) == ["in", 2]
    finally:
        server.stop()
