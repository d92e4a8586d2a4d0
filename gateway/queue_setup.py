"""Choosing the queue backend and rate limiter from the settings.

Without TIERGATE_REDIS_URL the queue and the rate limits live in this process
(MemoryBackend, MemoryRateLimiter): right for the one-process `serve`. With it, every
gateway and worker shares them through Redis. The Redis client fails fast (short socket
timeouts, no retries), so a Redis outage turns into quick 503s rather than hung
requests, and keeps no state of its own, so service resumes as soon as Redis is back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from scheduler.backend import QueueBackend
from scheduler.keys import KeySpace
from scheduler.memory_backend import MemoryBackend
from scheduler.rate_limit import MemoryRateLimiter, RedisRateLimiter
from scheduler.redis_backend import RedisBackend
from scheduler.script_channel import ScriptChannel

# A result read blocks up to RESULT_POLL_MS; the socket timeout must stay above it.
RESULT_POLL_MS = 500
# A Redis that is gone refuses connections or resets them at once, whatever these are;
# the timeouts only matter for one that is unreachable (connect) or hung (reply). The
# reply timeout is measured on this process's event loop, which a saturated gateway
# runs late: at 2 s, CPU load alone turned healthy Redis calls into 503s. A reply
# slower than 10 s means Redis is hung, not busy (a dispatch takes well under 1 ms).
SOCKET_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 2.0
# Without a script channel (TLS, Unix sockets) every open result stream holds a
# connection while it waits (XREAD BLOCK); with one, one reader follows them all.
MAX_CONNECTIONS = 4096


@dataclass
class QueueSetup:
    backend: QueueBackend
    limiter: Any  # MemoryRateLimiter or RedisRateLimiter: the same reserve/release
    redis: aioredis.Redis | None = None
    keys: KeySpace | None = None
    channel: ScriptChannel | None = None

    @property
    def is_shared(self) -> bool:
        return self.redis is not None

    def key(self, suffix: str) -> str:
        """A key of this deployment outside the scheduler's families."""
        return (self.keys or KeySpace()).prefix + suffix

    async def aclose(self) -> None:
        await self.backend.aclose()
        if self.channel is not None:
            await self.channel.aclose()


def redis_client(url: str, *, retry_dead_connection: bool = False) -> aioredis.Redis:
    """A client that gives up quickly when Redis is unreachable.

    With `retry_dead_connection`, a command that finds its pooled connection closed
    (Redis restarted since it was last used) is sent once more on a fresh connection
    instead of failing a request. Only for a client that sends no script: everything
    else the queue sends through redis-py is a read or a write that may be repeated.
    """
    retry = Retry(NoBackoff(), 0)
    if retry_dead_connection:
        retry = Retry(NoBackoff(), 1, supported_errors=(redis_errors.ConnectionError,))
    return aioredis.Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        retry=retry,
        health_check_interval=0,
        max_connections=MAX_CONNECTIONS,
    )


def build_queue(redis_url: str | None, redis_prefix: str) -> QueueSetup:
    """The shared Redis queue when a URL is given, else the in-process one."""
    if not redis_url:
        return QueueSetup(MemoryBackend(), MemoryRateLimiter())
    client = redis_client(redis_url)
    keys = KeySpace(redis_prefix)
    # The request path's script calls, queue and limits alike, share one connection.
    channel = ScriptChannel.for_client(client)
    if channel is not None:
        # The scripts go over the channel: redis-py is left with what may be repeated.
        client = redis_client(redis_url, retry_dead_connection=True)
    return QueueSetup(
        RedisBackend(client, keys=keys, channel=channel),
        RedisRateLimiter(client, keys=keys, channel=channel),
        client,
        keys,
        channel,
    )
