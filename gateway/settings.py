"""Process settings: read once from the environment (and CLI flags) at the edge.

Everything below the composition root receives plain values from this frozen object;
nothing reads the environment on its own.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from gateway.errors import GatewayError

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# Far beyond any device's memory; a larger budget would not fail to allocate but overflow
# torch's size arithmetic (an int64 of bytes), a traceback instead of a message.
MAX_KV_CACHE_BYTES = 2**50


class SettingsError(GatewayError):
    """An environment variable or flag holds a value that cannot be used."""


@dataclass(frozen=True)
class Settings:
    """Everything `build_app` needs to build one process."""

    data_dir: Path = Path(".tiergate")
    database_url: str | None = None  # None: the SQLite file in data_dir (db_url)
    redis_url: str | None = None
    # Every Redis key of one deployment starts with this (keep the {hash tag}).
    redis_prefix: str = "{tiergate}:"
    admin_token: str | None = None
    model: str = "tiny-random"
    device: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # The engine's KV cache budget; None lets the engine size it from free memory.
    kv_cache_bytes: int | None = None
    max_model_len: int | None = None  # None: the model's own context length
    max_num_seqs: int | None = None  # sequences the engine batches; None: its default
    auth_cache_ttl_s: float = 5.0
    usage_flush_interval_s: float = 0.5
    # Batch API: the upload cap of POST /v1/files, a batch's input limits, and how long
    # a dead gateway's batches wait before another gateway takes them over.
    max_file_bytes: int = 512 * 1024 * 1024
    # What one tenant's uploaded files may hold in all (they live in the database).
    tenant_file_bytes: int = 8 * 1024**3
    batch_max_input_bytes: int = 200 * 1024 * 1024
    batch_max_lines: int = 50_000
    batch_lease_s: float = 10.0
    # What an engine reports of when its busy slots free, for SLO admission: None, the
    # expected times; q, the times by which they have freed with probability q (fewer
    # admitted requests late, more refused; scheduler.slot_release).
    slot_wait_quantile: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        if self.device not in ("auto", "cpu", "cuda"):
            raise SettingsError(f"device must be auto, cpu or cuda, not {self.device!r}")
        if not 0 < self.port < 65536:
            raise SettingsError(f"port must be in 1..65535, not {self.port}")
        if self.max_body_bytes < 1024:
            raise SettingsError("max_body_bytes must be at least 1024")
        for name in ("kv_cache_bytes", "max_model_len", "max_num_seqs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise SettingsError(f"{name} must be at least 1 (or unset), not {value}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes > MAX_KV_CACHE_BYTES:
            raise SettingsError(
                f"kv_cache_bytes must be at most 2**50 (1 PiB), not {self.kv_cache_bytes}"
            )
        for name in (
            "max_file_bytes",
            "tenant_file_bytes",
            "batch_max_input_bytes",
            "batch_max_lines",
        ):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be at least 1, not {getattr(self, name)}")
        if not (math.isfinite(self.batch_lease_s) and self.batch_lease_s > 0):
            raise SettingsError(
                f"batch_lease_s must be a positive number, not {self.batch_lease_s}"
            )
        quantile = self.slot_wait_quantile
        if quantile is not None and not (math.isfinite(quantile) and 0 < quantile < 1):
            raise SettingsError(
                f"slot_wait_quantile must be between 0 and 1 (or unset), not {quantile}"
            )
        if self.database_url:
            _check_database_url(self.database_url)
        if self.redis_url:
            _check_redis_url(self.redis_url)
        if self.admin_token is not None:
            _check_admin_token(self.admin_token)

    @property
    def db_url(self) -> str:
        """The SQLAlchemy URL to use: the configured one or the embedded SQLite file."""
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{(self.data_dir / 'tiergate.db').resolve()}"

    @property
    def is_embedded_db(self) -> bool:
        return self.db_url.startswith("sqlite")

    def with_overrides(self, **values: object) -> Settings:
        """A copy with the given non-None values replaced (CLI flags over environment)."""
        known = {f.name for f in fields(self)}
        chosen = {k: v for k, v in values.items() if v is not None and k in known}
        return replace(self, **chosen)


# The async drivers the gateway runs on; a URL naming another fails only at first use.
_DATABASE_DRIVERS = {"sqlite": "aiosqlite", "postgresql": "asyncpg"}


def _check_database_url(url: str) -> None:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise SettingsError(
            f"database_url {url!r} is not a database URL; use sqlite+aiosqlite:///PATH or "
            "postgresql+asyncpg://USER@HOST/DB"
        ) from None
    # Read from the URL's text: asking SQLAlchemy for the driver loads the dialect, and an
    # unknown one (postgres://, as some hosts write it) raised NoSuchModuleError.
    backend, _, driver = parsed.drivername.partition("+")
    if _DATABASE_DRIVERS.get(backend) != driver:
        raise SettingsError(
            f"database_url must use sqlite+aiosqlite or postgresql+asyncpg, not {parsed.drivername}"
        )
    if backend == "sqlite" and (
        parsed.database in (None, "", ":memory:") or parsed.query.get("mode") == "memory"
    ):
        # Each connection would get its own empty database: the one the schema was
        # migrated on is gone before the server reads its tiers.
        raise SettingsError(
            f"database_url {redacted_url(url)!r} is an in-memory SQLite database, which no two "
            "connections share; give a file path (sqlite+aiosqlite:///PATH)"
        )


def redacted_url(url: str) -> str:
    """A database or Redis URL without its password, which an error must not print."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # a URL SQLAlchemy cannot parse (redis-py may still take it)
        return re.sub(r"://[^@/]*@", "://***@", url)


def _check_redis_url(url: str) -> None:
    scheme, has_scheme, _ = url.partition("://")
    if scheme not in ("redis", "rediss", "unix") or not has_scheme:
        raise SettingsError(
            f"redis_url {redacted_url(url)!r} is not a Redis URL; use redis://HOST:PORT/DB "
            "(rediss:// for TLS, unix:// for a socket)"
        )
    # redis-py reads a database number it cannot parse as none, that is db 0: a typo put
    # one deployment's keys into another's database.
    parts = urlsplit(url)
    numbers = parse_qs(parts.query).get("db", [])
    if scheme != "unix":  # a socket's path is the socket, not a database
        numbers.append(parts.path.strip("/") or "0")
    for number in numbers:
        if not number.isascii() or not number.isdigit():
            raise SettingsError(
                f"redis_url {redacted_url(url)!r} names database {number!r}; a Redis database is a "
                "number (redis://HOST:PORT/DB)"
            )


# An admin token is sent as `Authorization: Bearer TOKEN`: only printable ASCII with no
# space goes through every client unchanged (a space was accepted by curl and refused by
# `tiergate admin`; a non-ASCII one passed or not by the client's header encoding).
_ADMIN_TOKEN = re.compile(r"[!-~]+")
MIN_ADMIN_TOKEN_CHARS = 16  # the generated ones have 43


def _check_admin_token(token: str) -> None:
    if not _ADMIN_TOKEN.fullmatch(token):
        raise SettingsError("admin_token must be printable ASCII with no spaces")
    if len(token) < MIN_ADMIN_TOKEN_CHARS:
        raise SettingsError(
            f"admin_token must be at least {MIN_ADMIN_TOKEN_CHARS} characters: it opens "
            "every tenant's keys and bills"
        )


# variable -> (field, parser). The one list of what the environment may set.
_ENV: dict[str, tuple[str, type]] = {
    "TIERGATE_DATA_DIR": ("data_dir", Path),
    "TIERGATE_DATABASE_URL": ("database_url", str),
    "TIERGATE_REDIS_URL": ("redis_url", str),
    "TIERGATE_REDIS_PREFIX": ("redis_prefix", str),
    "TIERGATE_ADMIN_TOKEN": ("admin_token", str),
    "TIERGATE_MODEL": ("model", str),
    "TIERGATE_DEVICE": ("device", str),
    "TIERGATE_HOST": ("host", str),
    "TIERGATE_PORT": ("port", int),
    "TIERGATE_MAX_BODY_BYTES": ("max_body_bytes", int),
    "TIERGATE_KV_CACHE_BYTES": ("kv_cache_bytes", int),
    "TIERGATE_MAX_MODEL_LEN": ("max_model_len", int),
    "TIERGATE_MAX_NUM_SEQS": ("max_num_seqs", int),
    "TIERGATE_MAX_FILE_BYTES": ("max_file_bytes", int),
    "TIERGATE_TENANT_FILE_BYTES": ("tenant_file_bytes", int),
    "TIERGATE_BATCH_MAX_INPUT_BYTES": ("batch_max_input_bytes", int),
    "TIERGATE_BATCH_MAX_LINES": ("batch_max_lines", int),
    "TIERGATE_BATCH_LEASE_S": ("batch_lease_s", float),
    "TIERGATE_SLOT_WAIT_QUANTILE": ("slot_wait_quantile", float),
}


def settings_from_env(
    environ: Mapping[str, str] | None = None, overrides: Mapping[str, object] | None = None
) -> Settings:
    """Read the TIERGATE_* variables once; empty values count as unset. `overrides`
    (CLI flags; None values and names that are no setting are left out) win over the
    variables, which are then not read at all: a broken variable a flag replaces does
    not stop the command."""
    environ = os.environ if environ is None else environ
    known = {f.name for f in fields(Settings)}
    values = {k: v for k, v in (overrides or {}).items() if v is not None and k in known}
    for var, (name, parse) in _ENV.items():
        raw = environ.get(var, "").strip()
        if not raw or name in values:
            continue
        try:
            values[name] = parse(raw)
        except ValueError:
            raise SettingsError(f"{var}={raw!r} is not a valid {parse.__name__}") from None
    return Settings(**values)  # type: ignore[arg-type]


def env_variables() -> list[str]:
    """Names of the variables settings_from_env reads (for docs and --help)."""
    return list(_ENV)
