"""The process's one result-stream reader against a real Redis: many streams over one
blocking connection, a stream joining while the read is blocked is served at once, a
stream that ends or whose consumer leaves is dropped, and a lost connection fails its
followers and is replaced."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
import uvloop
from redis import exceptions as redis_errors

from scheduler.backend import BackendUnavailableError, EventKind
from scheduler.keys import KeySpace
from scheduler.redis_backend import RedisBackend
from scheduler.script_channel import ScriptChannel
from scheduler.stream_reader import STREAMS_PER_READ, StreamReader

from .conftest import REDIS_URL

# Longer than any test waits: an event that arrives sooner did not wait for the timeout.
BLOCK_MS = 20_000


def _is_last(fields: dict[str, str]) -> bool:
    return fields.get("last") == "1"


@contextlib.asynccontextmanager
async def reader_on(
    url: str = REDIS_URL, **options: Any
) -> AsyncIterator[tuple[aioredis.Redis, StreamReader]]:
    client = aioredis.Redis.from_url(url, decode_responses=True)
    channel = ScriptChannel.for_client(client)
    assert channel is not None
    reader = StreamReader(channel, is_last=_is_last, **{"block_ms": BLOCK_MS, **options})
    _open_readers.append(reader)
    prefix = f"{{test-reader-{uuid.uuid4().hex[:8]}}}:"
    client.test_prefix = prefix  # type: ignore[attr-defined]
    try:
        yield client, reader
    finally:
        _open_readers.remove(reader)
        await reader.aclose()
        await channel.aclose()
        await _delete_prefix(client, prefix)
        await client.aclose()


async def _delete_prefix(client: aioredis.Redis, prefix: str) -> None:
    names = [k async for k in client.scan_iter(match=f"{prefix}*")]
    if names:
        await client.delete(*names)


async def _collect(reader: StreamReader, key: str, after: str = "0") -> list[dict[str, str]]:
    return [fields async for _, fields in reader.follow(key, after)]


async def _readers(client: aioredis.Redis) -> list[dict]:
    """The connections blocked in an XREAD (flag b) of this process's readers."""
    ours = {a for r in _open_readers for a in _addresses(r)}
    return [
        c
        for c in await client.client_list()
        if c["addr"] in ours and c["cmd"] == "xread" and "b" in c["flags"]
    ]


def _addresses(reader: StreamReader) -> set[str]:
    """The local addresses of the reader's connections."""
    found = set()
    for shard in reader._shards:
        connection = shard._connection
        if connection is not None and connection.transport is not None:
            host, port = connection.transport.get_extra_info("sockname")[:2]
            found.add(f"{host}:{port}")
    return found


_open_readers: list[StreamReader] = []


async def test_many_streams_are_read_over_a_few_blocking_connections() -> None:
    async with reader_on() as (client, reader):
        keys = [f"{client.test_prefix}s{i}" for i in range(200)]  # type: ignore[attr-defined]
        followers = [asyncio.ensure_future(_collect(reader, key)) for key in keys]
        await asyncio.sleep(0.05)
        # One connection per STREAMS_PER_READ streams, each blocked in one XREAD.
        blocked = await _readers(client)
        assert len(blocked) == math.ceil(len(keys) / STREAMS_PER_READ)
        async with client.pipeline(transaction=False) as pipe:
            for i, key in enumerate(keys):
                for n in range(3):
                    pipe.xadd(key, {"n": str(n), "i": str(i)})
                pipe.xadd(key, {"n": "3", "i": str(i), "last": "1"})
            await pipe.execute()
        results = await asyncio.wait_for(asyncio.gather(*followers), timeout=10)
        for i, fields in enumerate(results):
            assert [f["n"] for f in fields] == ["0", "1", "2", "3"]
            assert {f["i"] for f in fields} == {str(i)}
        # Every stream ended: none is followed, and the reader waits without a read.
        assert not any(reader.is_following(key) for key in keys)
        await asyncio.sleep(0.05)
        assert await _readers(client) == []


async def _a_stream_joining_a_blocked_read_is_served_at_once() -> None:
    async with reader_on() as (client, reader):
        quiet = f"{client.test_prefix}quiet"  # type: ignore[attr-defined]
        waiting = asyncio.ensure_future(_collect(reader, quiet))
        await asyncio.sleep(0.1)  # the read of `quiet` alone is blocked now
        assert [c["cmd"] for c in await _readers(client)] == ["xread"]
        for i in range(5):
            key = f"{client.test_prefix}joiner{i}"  # type: ignore[attr-defined]
            started = time.monotonic()
            joiner = asyncio.ensure_future(_collect(reader, key))
            await asyncio.sleep(0.01)
            await client.xadd(key, {"n": "0", "last": "1"})
            assert await asyncio.wait_for(joiner, timeout=5) == [{"n": "0", "last": "1"}]
            assert time.monotonic() - started < 2.0  # not after BLOCK_MS
        # A stream joining right behind a read just sent (the UNBLOCK may overtake it).
        keys = [f"{client.test_prefix}burst{i}" for i in range(20)]  # type: ignore[attr-defined]
        burst = []
        for key in keys:
            burst.append(asyncio.ensure_future(_collect(reader, key)))
            await asyncio.sleep(0)
        for key in keys:
            await client.xadd(key, {"last": "1"})
        assert len(await asyncio.wait_for(asyncio.gather(*burst), timeout=5)) == 20
        assert not waiting.done()
        waiting.cancel()


async def test_a_stream_joining_a_blocked_read_is_served_at_once() -> None:
    await _a_stream_joining_a_blocked_read_is_served_at_once()


def test_a_stream_joining_a_blocked_read_is_served_at_once_on_uvloop() -> None:
    # The servers run on uvloop.
    uvloop.run(_a_stream_joining_a_blocked_read_is_served_at_once())


async def test_a_follower_reads_from_its_cursor_and_a_leaving_one_is_dropped() -> None:
    async with reader_on() as (client, reader):
        key = f"{client.test_prefix}s"  # type: ignore[attr-defined]
        first = await client.xadd(key, {"n": "0"})
        await client.xadd(key, {"n": "1"})
        entries = reader.follow(key, first)
        assert (await anext(entries))[1] == {"n": "1"}
        assert reader.is_following(key)
        with pytest.raises(ValueError, match="followed already"):
            await anext(reader.follow(key, "0"))
        await entries.aclose()  # the consumer went away (a client disconnected)
        assert not reader.is_following(key)
        # The others go on; the stream can be followed again from where it was left.
        await client.xadd(key, {"n": "2", "last": "1"})
        assert await asyncio.wait_for(_collect(reader, key, first), timeout=5) == [
            {"n": "1"},
            {"n": "2", "last": "1"},
        ]


async def test_a_killed_connection_fails_its_followers_and_the_next_one_reconnects() -> None:
    async with reader_on() as (client, reader):
        keys = [f"{client.test_prefix}s{i}" for i in range(3)]  # type: ignore[attr-defined]
        followers = [asyncio.ensure_future(_collect(reader, key)) for key in keys]
        await asyncio.sleep(0.1)
        [blocked] = await _readers(client)
        assert await client.client_kill_filter(_id=blocked["id"]) == 1
        outcomes = await asyncio.wait_for(
            asyncio.gather(*followers, return_exceptions=True), timeout=5
        )
        assert all(isinstance(o, redis_errors.ConnectionError) for o in outcomes)
        assert not any(reader.is_following(key) for key in keys)
        again = asyncio.ensure_future(_collect(reader, keys[0]))
        await asyncio.sleep(0.1)
        [new] = await _readers(client)
        assert new["id"] != blocked["id"]
        await client.xadd(keys[0], {"last": "1"})
        assert await asyncio.wait_for(again, timeout=5) == [{"last": "1"}]


async def test_closing_the_reader_fails_what_it_follows() -> None:
    async with reader_on() as (client, reader):
        key = f"{client.test_prefix}s"  # type: ignore[attr-defined]
        follower = asyncio.ensure_future(_collect(reader, key))
        await asyncio.sleep(0.05)
        [address] = _addresses(reader)
        await reader.aclose()
        with pytest.raises(redis_errors.ConnectionError, match="closed"):
            await asyncio.wait_for(follower, timeout=5)
        await asyncio.sleep(0.05)
        assert address not in {c["addr"] for c in await client.client_list()}


async def test_the_queue_follows_results_through_the_reader_and_its_failures_are_typed(
    redis_client,
) -> None:
    keys = KeySpace(f"{{test-reader-{uuid.uuid4().hex[:8]}}}:")
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    channel = ScriptChannel.for_client(client)
    backend = RedisBackend(client, keys=keys, channel=channel)
    assert backend._reader is not None
    _open_readers.append(backend._reader)
    try:
        stream = keys.results("job-1")
        await client.xadd(stream, {"k": "tokens", "t": "5,6", "x": "hi"})
        await client.xadd(stream, {"k": "done", "f": "stop"})
        first = backend.results("job-1")
        events = [event async for event in first]
        assert [e.kind for e in events] == [EventKind.TOKENS, EventKind.DONE]
        assert events[0].token_ids == (5, 6)
        # A second reader of a stream already followed reads it on its own.
        held = backend.results("job-2")
        held_first = asyncio.ensure_future(anext(held))
        await asyncio.sleep(0.05)
        await client.xadd(keys.results("job-2"), {"k": "tokens", "t": "1"})
        await client.xadd(keys.results("job-2"), {"k": "error", "c": "engine_error"})
        assert (await asyncio.wait_for(held_first, timeout=5)).token_ids == (1,)
        again = [event async for event in backend.results("job-2")]
        assert [e.kind for e in again] == [EventKind.TOKENS, EventKind.ERROR]
        await held.aclose()
        # The reader's connection killed under a waiting follower: the queue's own error.
        waiting = asyncio.ensure_future(anext(backend.results("job-3")))
        await asyncio.sleep(0.1)
        [blocked] = await _readers(redis_client)
        await redis_client.client_kill_filter(_id=blocked["id"])
        with pytest.raises(BackendUnavailableError):
            await asyncio.wait_for(waiting, timeout=5)
    finally:
        _open_readers.remove(backend._reader)
        await backend.aclose()
        assert channel is not None
        await channel.aclose()
        await _delete_prefix(redis_client, keys.prefix)


async def test_a_server_that_denies_unblock_makes_the_queue_read_streams_one_by_one(
    redis_client,
) -> None:
    user, password = f"tg-test-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    await redis_client.acl_setuser(
        user, enabled=True, passwords=[f"+{password}"], keys=["*"], channels=["*"],
        commands=["+@all", "-client|unblock"],
    )  # fmt: skip
    keys = KeySpace(f"{{test-reader-{uuid.uuid4().hex[:8]}}}:")
    client = aioredis.Redis.from_url(
        f"redis://{user}:{password}@127.0.0.1:6379/0", decode_responses=True
    )
    channel = ScriptChannel.for_client(client)
    backend = RedisBackend(client, keys=keys, channel=channel)
    reader = backend._reader
    assert reader is not None
    try:
        first = asyncio.ensure_future(anext(backend.results("job-1")))
        await asyncio.sleep(0.1)
        second = asyncio.ensure_future(anext(backend.results("job-2")))  # UNBLOCK denied
        await asyncio.sleep(0.1)
        assert not reader.accepts("job-3")
        third = backend.results("job-3")  # read on its own, not behind the blocked read
        third_first = asyncio.ensure_future(anext(third))
        await asyncio.sleep(0.05)
        await client.xadd(keys.results("job-3"), {"k": "done"})
        assert (await asyncio.wait_for(third_first, timeout=2)).kind is EventKind.DONE
        for job_id, waiting in (("job-1", first), ("job-2", second)):
            await client.xadd(keys.results(job_id), {"k": "done"})
            assert (await asyncio.wait_for(waiting, timeout=2)).kind is EventKind.DONE
    finally:
        await backend.aclose()
        assert channel is not None
        await channel.aclose()
        await redis_client.acl_deluser(user)
        await _delete_prefix(redis_client, keys.prefix)


async def test_idle_connections_beyond_the_first_are_closed() -> None:
    async with reader_on(streams_per_read=2, idle_s=0.2) as (client, reader):
        prefix = client.test_prefix  # type: ignore[attr-defined]
        keys = [f"{prefix}s{i}" for i in range(5)]
        followers = [asyncio.ensure_future(_collect(reader, key)) for key in keys]
        await asyncio.sleep(0.1)
        addresses = _addresses(reader)
        assert len(addresses) == 3  # five streams, two per read
        for key in keys:
            await client.xadd(key, {"last": "1"})
        await asyncio.wait_for(asyncio.gather(*followers), timeout=5)
        await asyncio.sleep(0.6)  # idle past idle_s
        [kept] = _addresses(reader)
        open_now = {c["addr"] for c in await client.client_list()}
        assert open_now & addresses == {kept}
        # The next burst starts on the kept connection and opens new ones as needed.
        fresh = [f"{prefix}t{i}" for i in range(3)]
        again = [asyncio.ensure_future(_collect(reader, key)) for key in fresh]
        await asyncio.sleep(0.1)
        assert kept in _addresses(reader)
        assert len(_addresses(reader)) == 2
        for key in fresh:
            await client.xadd(key, {"last": "1"})
        await asyncio.wait_for(asyncio.gather(*again), timeout=5)


async def test_a_connection_lost_while_idle_is_replaced_at_once() -> None:
    """Killed while no read was in flight (no stream followed): the next stream opens a
    new connection instead of writing to the dead one and waiting out the timeout."""
    async with reader_on() as (client, reader):
        prefix = client.test_prefix  # type: ignore[attr-defined]
        first = asyncio.ensure_future(_collect(reader, f"{prefix}a"))
        await asyncio.sleep(0.05)
        await client.xadd(f"{prefix}a", {"last": "1"})
        await asyncio.wait_for(first, timeout=5)
        [address] = _addresses(reader)
        killed = [c for c in await client.client_list() if c["addr"] == address]
        assert await client.client_kill_filter(_id=killed[0]["id"]) == 1
        await asyncio.sleep(0.1)  # the close reaches the reader, idle meanwhile
        started = time.monotonic()
        second = asyncio.ensure_future(_collect(reader, f"{prefix}b"))
        await asyncio.sleep(0.05)
        await client.xadd(f"{prefix}b", {"last": "1"})
        assert await asyncio.wait_for(second, timeout=5) == [{"last": "1"}]
        assert time.monotonic() - started < 2.0
        assert _addresses(reader) != {address}
