"""The `tiergate` command: serve [--demo], gateway, worker, migrate, admin, batch, usage,
simulate.

Flags mirror the TIERGATE_* environment variables and win over them; both are read here,
once, into a frozen Settings that the composition root receives.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import logging
import math
import os
import secrets
import shlex
import socket
import sys
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.cli_output import print_subcommand_help
from gateway.errors import GatewayError
from gateway.settings import Settings, SettingsError, redacted_url, settings_from_env

if TYPE_CHECKING:
    from scheduler.dispatcher import EngineLike

log = logging.getLogger("tiergate")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    from gateway.observability.config import TelemetryConfigError

    try:
        return int(args.func(args) or 0)
    except (SettingsError, GatewayError, TelemetryConfigError) as exc:
        print(f"tiergate: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130  # the shell's code for SIGINT; nothing to add to the ^C
    except BrokenPipeError:
        # The reader of our output left (`... | head`): not an error of ours. Python
        # would complain again flushing stdout at exit, so it points at nothing now.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # the shell's code for SIGPIPE


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiergate", description="Multi-tenant LLM inference gateway."
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    serve = commands.add_parser("serve", help="run gateway + dispatcher + engine in one process")
    _add_common_flags(serve)
    serve.add_argument("--host", help="bind address (TIERGATE_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="bind port (TIERGATE_PORT, default 8000)")
    serve.add_argument("--model", help="HF checkpoint directory or tiny-random (TIERGATE_MODEL)")
    serve.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], help="engine device (TIERGATE_DEVICE)"
    )
    serve.add_argument("--redis-url", help="Redis URL (TIERGATE_REDIS_URL)")
    serve.add_argument("--admin-token", help="admin API bearer token (TIERGATE_ADMIN_TOKEN)")
    serve.add_argument(
        "--max-body-bytes", type=int, help="request body limit (TIERGATE_MAX_BODY_BYTES)"
    )
    serve.add_argument(
        "--max-model-len", type=int, help="cap the context window (TIERGATE_MAX_MODEL_LEN)"
    )
    _add_engine_flags(serve)
    _add_queue_and_batch_flags(serve)
    serve.add_argument(
        "--demo",
        action="store_true",
        help="create one demo tenant per tier and print their keys and example requests",
    )
    serve.set_defaults(func=_serve)

    gateway = commands.add_parser(
        "gateway", help="run the HTTP gateway only (needs a database and Redis; no engine)"
    )
    _add_common_flags(gateway)
    gateway.add_argument("--host", help="bind address (TIERGATE_HOST, default 127.0.0.1)")
    gateway.add_argument("--port", type=int, help="bind port (TIERGATE_PORT, default 8000)")
    gateway.add_argument(
        "--model", help="the served model; only its tokenizer is loaded (TIERGATE_MODEL)"
    )
    gateway.add_argument("--redis-url", help="Redis URL, required (TIERGATE_REDIS_URL)")
    gateway.add_argument("--admin-token", help="admin API bearer token (TIERGATE_ADMIN_TOKEN)")
    gateway.add_argument(
        "--max-body-bytes", type=int, help="request body limit (TIERGATE_MAX_BODY_BYTES)"
    )
    gateway.add_argument(
        "--max-model-len", type=int, help="cap the context window (TIERGATE_MAX_MODEL_LEN)"
    )
    _add_queue_and_batch_flags(gateway)
    gateway.set_defaults(func=_gateway)

    worker = commands.add_parser(
        "worker", help="run a dispatcher and an engine on one device (needs Redis; no database)"
    )
    worker.add_argument("--model", help="HF checkpoint directory or tiny-random (TIERGATE_MODEL)")
    worker.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], help="engine device (TIERGATE_DEVICE)"
    )
    worker.add_argument("--redis-url", help="Redis URL, required (TIERGATE_REDIS_URL)")
    worker.add_argument(
        "--max-model-len", type=int, help="cap the context window (TIERGATE_MAX_MODEL_LEN)"
    )
    _add_engine_flags(worker)
    worker.add_argument("--redis-prefix", help="prefix of every Redis key (TIERGATE_REDIS_PREFIX)")
    worker.add_argument("--worker-id", help="worker name (default host-pid-random)")
    worker.add_argument(
        "--lease-ms",
        type=_lease_ms,
        default=10_000,
        help="a job whose worker stops heartbeating returns to the queue after this",
    )
    worker.add_argument(
        "--drain-timeout-s",
        type=_drain_timeout_s,
        default=30.0,
        help="on SIGTERM, how long running jobs may finish before they are requeued",
    )
    worker.set_defaults(func=_worker)

    migrate = commands.add_parser("migrate", help="upgrade the database to the newest schema")
    _add_common_flags(migrate)
    migrate.add_argument(
        "--revision",
        default="head",
        help="upgrade or downgrade to this revision instead: an id such as 0005, or base "
        "(default head)",
    )
    migrate.set_defaults(func=_migrate)

    usage = commands.add_parser("usage", help="usage records maintenance")
    usage.set_defaults(func=lambda _args: print_subcommand_help(usage))
    usage_commands = usage.add_subparsers(title="usage commands", metavar="COMMAND")
    rebuild = usage_commands.add_parser(
        "rebuild-rollup",
        help="recompute the hourly usage rollup over a time range (after a rolling upgrade)",
    )
    _add_common_flags(rebuild)
    rebuild.add_argument("--start", type=_utc_datetime, required=True, help="ISO 8601, UTC")
    rebuild.add_argument("--end", type=_utc_datetime, required=True, help="ISO 8601, UTC")
    rebuild.set_defaults(func=_rebuild_rollup)

    from gateway.admin_cli import add_admin_parser
    from gateway.batch_cli import add_batch_parser
    from scheduler.sim.cli import add_simulate_parser

    add_admin_parser(commands)
    add_batch_parser(commands)
    add_simulate_parser(commands)
    return parser


def _lease_ms(raw: str) -> int:
    """A lease of at least MIN_LEASE_MS (a worker heartbeats it four times per lease) and
    at most MAX_LEASE_MS."""
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not an integer") from None
    if value < MIN_LEASE_MS:
        raise argparse.ArgumentTypeError(f"a lease must be at least {MIN_LEASE_MS} ms")
    if value > MAX_LEASE_MS:
        raise argparse.ArgumentTypeError(f"a lease must be at most {MAX_LEASE_MS} ms (an hour)")
    return value


MIN_LEASE_MS = 200
# The jobs of a worker that dies wait out its lease before another worker resumes them:
# past an hour that is an outage, not a setting (and the queue's clock arithmetic runs
# in Lua doubles, exact only up to 2**53).
MAX_LEASE_MS = 3_600_000


def _drain_timeout_s(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(
            f"a drain timeout must be a finite number of seconds, at least 0, not {raw}"
        )
    return value


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-cache-bytes", type=int, help="KV cache budget (TIERGATE_KV_CACHE_BYTES)"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, help="sequences batched at once (TIERGATE_MAX_NUM_SEQS)"
    )
    parser.add_argument(
        "--slot-wait-quantile",
        type=float,
        help="a probability between 0 and 1: report the wait for a busy slot by which it "
        "frees that often (fewer admitted requests late, more refused); unset: the expected "
        "wait (TIERGATE_SLOT_WAIT_QUANTILE)",
    )


def _add_queue_and_batch_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the processes that serve the API (and so the Batch API)."""
    parser.add_argument("--redis-prefix", help="prefix of every Redis key (TIERGATE_REDIS_PREFIX)")
    parser.add_argument(
        "--max-file-bytes", type=int, help="largest file upload (TIERGATE_MAX_FILE_BYTES)"
    )
    parser.add_argument(
        "--tenant-file-bytes",
        type=int,
        help="what one tenant's uploaded files may hold in all (TIERGATE_TENANT_FILE_BYTES)",
    )
    parser.add_argument(
        "--batch-max-input-bytes",
        type=int,
        help="largest batch input file (TIERGATE_BATCH_MAX_INPUT_BYTES)",
    )
    parser.add_argument(
        "--batch-max-lines", type=int, help="most lines per batch (TIERGATE_BATCH_MAX_LINES)"
    )
    parser.add_argument(
        "--batch-lease-s",
        type=float,
        help="how long a gateway owns a running batch between heartbeats (TIERGATE_BATCH_LEASE_S)",
    )


def _add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--database-url", help="SQLAlchemy async URL (TIERGATE_DATABASE_URL)")
    parser.add_argument(
        "--data-dir", type=Path, help="data directory (TIERGATE_DATA_DIR, default ./.tiergate)"
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Environment first, then the flags that were given."""
    return settings_from_env(overrides=vars(args))


def _configure_logging() -> None:
    """JSON lines for log collectors; plain text when a person watches a terminal."""
    from gateway.observability.logs import configure_logging

    configure_logging(logging.INFO, is_json=not sys.stderr.isatty())


def _utc_datetime(value: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {value!r}") from exc
    try:
        return parsed.astimezone(UTC) if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    except OverflowError:  # 0001-01-01T00:00+01:00 is in year 0 in UTC
        raise argparse.ArgumentTypeError(f"{value!r} is out of range in UTC") from None


# The rebuild covers whole hours, so it rounds --end up to the next hour; the hour after
# this one is past the last time Python can represent.
LATEST_ROLLUP_END = datetime(9999, 12, 31, 23, tzinfo=UTC)


def _rebuild_rollup(args: argparse.Namespace) -> int:
    from gateway.db.session import create_db_engine, create_sessionmaker
    from gateway.migrate import check_revision
    from gateway.usage import rebuild_usage_rollup

    if args.end <= args.start:
        raise SettingsError("--end must be after --start")
    if args.end > LATEST_ROLLUP_END:
        raise SettingsError(f"--end must be at most {LATEST_ROLLUP_END.isoformat()}")
    settings = settings_from_args(args)
    _require_sqlite_file(settings)
    asyncio.run(_reach_database(settings))
    check_revision(settings.db_url)

    async def rebuild() -> int:
        db_engine = create_db_engine(settings.db_url)
        try:
            async with create_sessionmaker(db_engine).begin() as session:
                return await rebuild_usage_rollup(session, args.start, args.end)
        finally:
            await db_engine.dispose()

    print(f"usage rollup rebuilt: {asyncio.run(rebuild())} hourly rows written")
    return 0


def _migrate(args: argparse.Namespace) -> int:
    from gateway.migrate import migrate_to

    settings = settings_from_args(args)
    _prepare_data_dir(settings)
    asyncio.run(_reach_database(settings))
    reached = migrate_to(settings.db_url, args.revision)
    where = "the newest revision" if args.revision == "head" else f"revision {reached or 'base'}"
    print(f"database is at {where}: {redacted_url(settings.db_url)}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from gateway.app import build_app

    settings = settings_from_args(args)
    # --demo upgrades the database (any database) before it adds the demo tenants.
    _preflight(settings, upgrades_database=settings.is_embedded_db or args.demo)
    _configure_logging()
    with _own_data_dir(settings), _listening_socket(settings) as listener:
        if args.demo:
            generated = settings.admin_token is None
            if generated:
                settings = settings.with_overrides(admin_token=secrets.token_urlsafe(32))
            tenants = asyncio.run(_demo_tenants(settings))
            print(_demo_banner(settings, tenants, generated), flush=True)
        app = build_app(settings, engine=_load_engine(settings), prepare_heap=True)
        return _run_server(app, settings, listener)


def _load_engine(settings: Settings) -> EngineLike:
    """The engine, loaded before the server starts: a model or cache setting it cannot
    run with is then one line, not a traceback from the server's start-up."""
    import torch

    from engine.errors import EngineError
    from gateway.engine_setup import build_engine

    try:
        return build_engine(settings)
    except EngineError as exc:
        raise SettingsError(f"cannot start the engine: {exc}") from None
    except (torch.OutOfMemoryError, MemoryError) as exc:
        raise SettingsError(f"cannot start the engine: out of memory: {exc}") from None
    except RuntimeError as exc:
        # What the CPU allocator raises for a KV cache larger than the machine's memory.
        if "can't allocate memory" not in str(exc):
            raise
        raise SettingsError(f"cannot start the engine: {exc}") from None


def _gateway(args: argparse.Namespace) -> int:
    from gateway.app import build_app

    settings = settings_from_args(args)
    if not settings.redis_url:
        raise SettingsError("tiergate gateway needs TIERGATE_REDIS_URL (or --redis-url)")
    _preflight(settings, upgrades_database=settings.is_embedded_db)
    _configure_logging()
    with _listening_socket(settings) as listener:
        app = build_app(settings, with_engine=False, prepare_heap=True)
        return _run_server(app, settings, listener)


def _listening_socket(settings: Settings) -> socket.socket:
    """The server's socket, bound before anything slow loads: an address in use or one
    this machine does not have is then one line, not uvicorn's error after the model
    loaded. Bound as uvicorn binds it (IPv6 for a host with a colon)."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((settings.host, settings.port))
    except OSError as exc:
        listener.close()
        raise SettingsError(
            f"cannot listen on {settings.host} port {settings.port}: {exc.strerror or exc}"
        ) from None
    return listener


def _run_server(app: Any, settings: Settings, listener: socket.socket) -> int:
    import uvicorn

    from gateway.http_server import uvicorn_config
    from scheduler.worker import exit_now

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # A second signal while the first one's drain runs: the operator wants out
            # now, as a worker's second signal does (scheduler/worker.py). uvicorn's own
            # forced exit printed a traceback per cancelled task and exited with 0.
            if self.should_exit:
                exit_now(sig, "shutting down")
            super().handle_exit(sig, frame)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:  # uvicorn announces only an address it bound itself
                host = f"[{settings.host}]" if ":" in settings.host else settings.host
                logging.getLogger("uvicorn.error").info(
                    "Uvicorn running on http://%s:%d (Press CTRL+C to quit)", host, settings.port
                )

    # Bounded request heads: an unauthenticated client cannot exhaust memory or sockets.
    # log_config=None: uvicorn's own lines go through the handler _configure_logging set
    # (JSON lines off a terminal), not through uvicorn's plain-text one.
    config = uvicorn_config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        access_log=False,
        log_config=None,
    )
    server = Server(config)
    # As uvicorn.run ends: a ^C after a graceful shutdown is no error, and 3 is its status
    # for a server that never started (it exits with it itself when the app's start-up
    # fails).
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[listener])
    return 0 if server.started else 3


def _worker(args: argparse.Namespace) -> int:
    from gateway.heap import prepare_heap_for_serving
    from gateway.queue_setup import build_queue
    from scheduler.dispatcher import DispatcherConfig
    from scheduler.worker import run_worker, stop_on_signals

    _configure_logging()
    settings = settings_from_args(args)
    if not settings.redis_url:
        raise SettingsError("tiergate worker needs TIERGATE_REDIS_URL (or --redis-url)")
    _check_model(settings)
    asyncio.run(_reach_redis(settings))
    heartbeat_ms = max(50, min(1_000, args.lease_ms // 4))
    config = DispatcherConfig(
        lease_ms=args.lease_ms,
        heartbeat_ms=heartbeat_ms,
        capacity_ttl_ms=max(5 * heartbeat_ms, 2_000),
        drain_timeout_s=args.drain_timeout_s,
        slot_wait_quantile=settings.slot_wait_quantile,
    )

    async def main() -> None:
        queue = build_queue(settings.redis_url, settings.redis_prefix)
        stop = asyncio.Event()
        stop_on_signals(stop)
        engine = await asyncio.to_thread(_load_engine, settings)
        prepare_heap_for_serving()
        try:
            await run_worker(queue.backend, engine, stop, worker_id=args.worker_id, config=config)
        finally:
            await queue.aclose()

    asyncio.run(main())
    return 0


def _preflight(settings: Settings, *, upgrades_database: bool) -> None:
    """What would otherwise fail inside the server's start-up, with a traceback, as one
    clear message: the model, the data directory, the database, its schema revision and
    Redis. `upgrades_database`: the process upgrades the database itself before it uses
    it (the embedded one always); upgraded here, a database it cannot upgrade (tables of
    another application's in the way) is one line too. Run before logging is configured:
    the checks' own chatter (alembic's) stays out of the way of the one line that
    matters."""
    from gateway.migrate import check_revision, upgrade_to_head

    _check_model(settings)
    _prepare_data_dir(settings)

    async def reach() -> None:
        await _reach_database(settings)
        await _reach_redis(settings)

    asyncio.run(reach())
    if upgrades_database:
        upgrade_to_head(settings.db_url)
    else:
        check_revision(settings.db_url)


def _check_model(settings: Settings) -> None:
    if settings.model != "tiny-random" and not Path(settings.model).is_dir():
        raise SettingsError(
            f"model {settings.model!r} is neither tiny-random nor a checkpoint directory"
        )


def _prepare_data_dir(settings: Settings) -> None:
    if not settings.is_embedded_db:
        return
    try:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SettingsError(f"cannot use data directory {settings.data_dir}: {exc}") from None


def _require_sqlite_file(settings: Settings) -> None:
    """A maintenance command on a SQLite database that is not there: one message, where
    connecting would create the directory and an empty file first."""
    from sqlalchemy.engine import make_url

    if not settings.is_embedded_db:
        return
    path = make_url(settings.db_url).database
    if path and path != ":memory:" and not Path(path).is_file():
        raise SettingsError(
            f"no database at {path}: run tiergate migrate (or serve) with these settings first"
        )


@contextlib.contextmanager
def _own_data_dir(settings: Settings) -> Iterator[None]:
    """Hold the data directory for this `serve` while it runs on the embedded database
    and its in-memory queue. A second `serve` on the same directory used to start too:
    the two shared the tenants and keys but each kept its own queue, rate limits and
    concurrency counts, so a tenant got twice its limits and neither process saw the
    other's queue. With Redis, processes share the queue and limits, and may share it."""
    if not settings.is_embedded_db or settings.redis_url:
        yield
        return
    path = settings.data_dir / "serve.lock"
    try:
        handle = open(path, "a+")  # noqa: SIM115 - closed by the with below
    except OSError as exc:
        raise SettingsError(f"cannot use data directory {settings.data_dir}: {exc}") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise SettingsError(
                f"another tiergate serve (pid {holder}) is using the data directory "
                f"{settings.data_dir} with its own in-memory queue; two would each enforce "
                "the tenants' limits on their own. Stop it, use another --data-dir, or "
                "share a queue with TIERGATE_REDIS_URL"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        yield


REACH_TIMEOUT_S = 5.0


async def _reach_database(settings: Settings) -> None:
    from sqlalchemy import text

    from gateway.db.session import create_db_engine

    engine = create_db_engine(settings.db_url)
    try:
        async with asyncio.timeout(REACH_TIMEOUT_S), engine.connect() as connection:
            await connection.execute(text("SELECT 1"))
    except Exception as exc:
        raise SettingsError(
            f"cannot reach the database at {redacted_url(settings.db_url)}: {_reason(exc)}"
        ) from None
    finally:
        await engine.dispose()


async def _reach_redis(settings: Settings) -> None:
    if not settings.redis_url:
        return
    from gateway.queue_setup import redis_client
    from scheduler.script_channel import ScriptChannel

    client = redis_client(settings.redis_url)
    # Both ways this process talks to Redis, so that the check passes only what serving
    # will: redis-py's connections and the script channel authenticate each their own way.
    channel = ScriptChannel.for_client(client)
    try:
        async with asyncio.timeout(REACH_TIMEOUT_S):
            await client.ping()
            if channel is not None:
                await channel.call("PING")
    except Exception as exc:
        raise SettingsError(
            f"cannot reach Redis at {redacted_url(settings.redis_url)}: {_reason(exc)}"
        ) from None
    finally:
        if channel is not None:
            await channel.aclose()
        await client.aclose()


def _reason(exc: BaseException) -> str:
    """The error's own words on one line, without SQLAlchemy's link to its error page."""
    text = str(exc).split("(Background on this error at:", 1)[0]
    return " ".join(text.split()) or type(exc).__name__


async def _demo_tenants(settings: Settings) -> list:
    from gateway.db.session import create_db_engine, create_sessionmaker
    from gateway.demo import ensure_demo_tenants
    from gateway.migrate import upgrade_to_head

    _prepare_data_dir(settings)
    await asyncio.to_thread(upgrade_to_head, settings.db_url)
    db_engine = create_db_engine(settings.db_url)
    try:
        return await ensure_demo_tenants(create_sessionmaker(db_engine))
    finally:
        await db_engine.dispose()


def _demo_banner(settings: Settings, tenants: list, generated_token: bool) -> str:
    host = f"[{settings.host}]" if ":" in settings.host else settings.host  # IPv6
    base_url = f"http://{host}:{settings.port}"
    model = settings.model
    key = tenants[0].api_key if tenants else "tg-..."
    for tenant in tenants:
        if tenant.tier == "interactive":
            key = tenant.api_key
    body = (
        f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}], '
        '"max_tokens": 16}'
    )
    lines = [
        "",
        f"tiergate demo: serving {model} at {base_url}",
        "",
        "Demo tenants (keys are shown once; a rerun mints new ones):",
    ]
    lines += [f"  {t.name:<24} tier={t.tier:<12} {t.api_key}" for t in tenants]
    # A token the operator chose is theirs to know: printed, it would land in the logs.
    token = (
        f"Admin token (generated; set TIERGATE_ADMIN_TOKEN to choose one): {settings.admin_token}"
        if generated_token
        else "Admin token: the one in TIERGATE_ADMIN_TOKEN (not printed)"
    )
    lines += [
        "",
        token,
        "",
        "Try it with curl:",
        f"  curl {base_url}/v1/chat/completions \\",
        f"    -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' \\",
        f"    -d {shlex.quote(body)}",
        "",
        "Or with the openai client (paste the lines as they are: Python and the heredoc",
        "end take no indent):",
        "python - <<'EOF'",
        "from openai import OpenAI",
        f'client = OpenAI(base_url="{base_url}/v1", api_key="{key}")',
        "reply = client.chat.completions.create(",
        f'    model="{model}", messages=[{{"role": "user", "content": "Hello"}}], max_tokens=16',
        ")",
        "print(reply.choices[0].message.content, reply.usage)",
        "EOF",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
