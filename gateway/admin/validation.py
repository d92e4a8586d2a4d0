"""Checking admin JSON bodies and query values at the edge: every mistake is a 400 with
the offending field in `param`, never a database error (a 500) later."""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request

from gateway import json_body
from gateway.errors import InvalidRequestError, PayloadTooLargeError

MAX_BODY_BYTES = 64 * 1024
MAX_INT = 2**31 - 1  # the columns are 32-bit on PostgreSQL
MAX_NUMBER = 1e12
# A price per million tokens (a million per token is beyond any model's). Costs are
# summed as 64-bit billionths: at this cap one maximal request (128 choices of a full
# context) is ~3e14 of them, so a tenant's hourly sum fits for some 30,000 such requests;
# at MAX_NUMBER a single 10,000-token request overflowed its usage record.
MAX_PRICE_PER_MTOK = 1e6
MIN_WEIGHT = 0.001

TIER_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
# TIER_NAME in words, for the refusal (a bare "invalid format" left one guessing).
TIER_NAME_FORMAT = "1 to 32 lowercase letters, digits, '_' or '-', starting with a letter or digit"
TENANT_ID = re.compile(r"ten_[0-9a-f]{24}")
KEY_ID = re.compile(r"key_[0-9a-f]{24}")
# Printable text: PostgreSQL rejects NUL, and control characters have no place in a name.
_PRINTABLE = re.compile(r"[^\x00-\x1f\x7f-\x9f]+")
# Bidirectional embeddings, overrides and isolates reorder the text after them, so a name
# holding one shows in a listing, a log line or a terminal as other text than it is
# ("\u202eemca" reads "acme"), and one left open reorders the rest of the line too. A
# label needs none of them: the marks (U+200E, U+200F, U+061C) that mixed-direction
# names may need are allowed.
_BIDI_CONTROLS = re.compile("[\u202a-\u202e\u2066-\u2069]")
# What shows as nothing on its own: spaces and line separators, controls, format
# characters (zero-width space and joiners, word joiner, BOM, tags), private-use,
# unassigned and surrogate code points, and combining marks, which need a base.
_INVISIBLE_CATEGORIES = frozenset(
    {"Zs", "Zl", "Zp", "Cc", "Cf", "Co", "Cn", "Cs", "Mn", "Mc", "Me"}
)
# Letters and symbols that are drawn blank: the Hangul fillers and the empty braille cell.
_BLANK_GRAPHICS = frozenset("\u115f\u1160\u3164\uffa0\u2800")
_DIGITS = re.compile(r"[0-9]{1,18}")


@dataclass(frozen=True)
class Field:
    """One accepted body field: JSON type, nullability and bounds."""

    kind: str  # "int", "number", "bool", "str", "datetime"
    nullable: bool = False
    min: float | None = None
    max: float | None = None
    min_exclusive: bool = False
    max_exclusive: bool = False
    pattern: re.Pattern[str] | None = None
    pattern_words: str = ""  # what `pattern` accepts, as "name must be <pattern_words>"
    max_len: int = 100
    choices: tuple[str, ...] | None = None


async def read_json_object(request: Request, *, allow_empty: bool = False) -> dict[str, Any]:
    """The request body as a JSON object; 400 if it is not one, 413 if too large."""
    chunks: list[bytes] = []
    num_bytes = 0
    async for chunk in request.stream():
        num_bytes += len(chunk)
        if num_bytes > MAX_BODY_BYTES:
            raise PayloadTooLargeError(f"Request body exceeds {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if allow_empty and not raw.strip():
        return {}
    try:
        body = json_body.loads(raw.decode("utf-8"))
    except ValueError as exc:  # JsonBodyError, UnicodeDecodeError
        raise InvalidRequestError(
            f"Request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise InvalidRequestError("Request body must be a JSON object", code="invalid_json")
    return body


def _check(name: str, value: Any, field: Field) -> Any:
    if value is None:
        if field.nullable:
            return None
        raise InvalidRequestError(f"{name} may not be null", param=name)
    if field.kind == "bool":
        if not isinstance(value, bool):
            raise InvalidRequestError(f"{name} must be a boolean", param=name)
        return value
    if field.kind in ("int", "number"):
        is_int = isinstance(value, int) and not isinstance(value, bool)
        is_number = is_int or (isinstance(value, float) and math.isfinite(value))
        if not (is_int if field.kind == "int" else is_number):
            kind = "an integer" if field.kind == "int" else "a finite number"
            raise InvalidRequestError(f"{name} must be {kind}", param=name)
        upper = min(field.max if field.max is not None else math.inf, _upper(field.kind))
        if field.min is not None and (
            value <= field.min if field.min_exclusive else value < field.min
        ):
            op = ">" if field.min_exclusive else ">="
            raise InvalidRequestError(f"{name} must be {op} {_bound(field.min)}", param=name)
        if value >= upper if field.max_exclusive else value > upper:
            op = "<" if field.max_exclusive else "<="
            raise InvalidRequestError(f"{name} must be {op} {_bound(upper)}", param=name)
        return float(value) if field.kind == "number" else value
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name} must be a string", param=name)
    if field.kind == "datetime":
        return parse_datetime(name, value)
    if field.choices is not None and value not in field.choices:
        raise InvalidRequestError(f"{name} must be one of {', '.join(field.choices)}", param=name)
    if len(value) > field.max_len:
        raise InvalidRequestError(f"{name} is longer than {field.max_len} characters", param=name)
    if field.pattern is not None and not field.pattern.fullmatch(value):
        raise InvalidRequestError(f"{name} must be {field.pattern_words}", param=name)
    if not _PRINTABLE.fullmatch(value):
        raise InvalidRequestError(f"{name} may not contain control characters", param=name)
    if _BIDI_CONTROLS.search(value):
        raise InvalidRequestError(
            f"{name} may not contain bidirectional embedding, override or isolate controls "
            "(U+202A to U+202E, U+2066 to U+2069)",
            param=name,
        )
    if not _has_visible_character(value):
        # Printable, yet shows as nothing in a listing or a log line.
        raise InvalidRequestError(f"{name} may not be blank", param=name)
    return value


def _has_visible_character(value: str) -> bool:
    # str.strip() is not enough: it keeps format characters such as U+200B.
    return any(
        char not in _BLANK_GRAPHICS and unicodedata.category(char) not in _INVISIBLE_CATEGORIES
        for char in value
    )


def _bound(value: float) -> str:
    """A bound as an operator would write it: 2147483647, not :g's 2.14748e+09."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _upper(kind: str) -> float:
    return MAX_INT if kind == "int" else MAX_NUMBER


def parse_datetime(name: str, value: str) -> datetime:
    """An ISO 8601 timestamp with a time zone (a trailing Z is accepted), as aware UTC."""
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequestError(f"{name} must be an ISO 8601 timestamp", param=name) from None
    if parsed.tzinfo is None:
        raise InvalidRequestError(f"{name} must include a time zone", param=name)
    return in_range_utc(name, parsed)


# Times a request may name: arithmetic on them (a day's range, an hour's truncation)
# stays inside what datetime can hold.
MIN_YEAR, MAX_YEAR = 1970, 9998


def in_range_utc(name: str, value: datetime) -> datetime:
    """`value` (aware) as UTC, or a 400 if it lies outside MIN_YEAR..MAX_YEAR."""
    try:
        utc = value.astimezone(UTC)
    except OverflowError:
        utc = None
    if utc is None or not MIN_YEAR <= utc.year <= MAX_YEAR:
        raise InvalidRequestError(
            f"{name} must lie between the years {MIN_YEAR} and {MAX_YEAR}", param=name
        )
    return utc


def parse_fields(
    body: dict[str, Any], spec: dict[str, Field], *, required: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The checked values of `body`; unknown or missing required fields are 400s."""
    for name in body:
        if name not in spec:
            raise InvalidRequestError(f"Unknown field {name!r}", param=name)
    for name in required:
        if name not in body:
            raise InvalidRequestError(f"Missing required field {name!r}", param=name)
    return {name: _check(name, value, spec[name]) for name, value in body.items()}


def query_int(request: Request, name: str, *, default: int, min: int, max: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    # ASCII digits only: str.isdigit() also takes "²", which int() refuses.
    if not _DIGITS.fullmatch(raw) or not min <= int(raw) <= max:
        raise InvalidRequestError(f"{name} must be an integer in [{min}, {max}]", param=name)
    return int(raw)


LIMIT = Field("int", nullable=True, min=1)

TIER_FIELDS: dict[str, Field] = {
    "name": Field("str", pattern=TIER_NAME, pattern_words=TIER_NAME_FORMAT, max_len=32),
    "rank": Field("int", min=0, max=1000),
    "ttft_slo_ms": Field("number", nullable=True, min=0, min_exclusive=True),
    "tpot_slo_ms": Field("number", nullable=True, min=0, min_exclusive=True),
    "max_queue_ms": Field("number", nullable=True, min=0, min_exclusive=True),
    "max_queued_jobs": Field("int", nullable=True, min=1),
    "completion_window_s": Field("int", nullable=True, min=1),
    "min_share": Field("number", min=0, max=1, max_exclusive=True),
    "preemptible": Field("bool"),
    "rpm": LIMIT,
    "tpm": LIMIT,
    "max_concurrency": LIMIT,
    "price_input_per_mtok": Field("number", min=0, max=MAX_PRICE_PER_MTOK),
    "price_output_per_mtok": Field("number", min=0, max=MAX_PRICE_PER_MTOK),
}

TENANT_FIELDS: dict[str, Field] = {
    "name": Field("str", max_len=100),
    "tier": Field("str", pattern=TIER_NAME, pattern_words=TIER_NAME_FORMAT, max_len=32),
    # Bounded below: the queue divides charges by the weight, and a weight near zero
    # would send a counter, then the tier's floor, to infinity.
    "weight": Field("number", min=MIN_WEIGHT, max=1000),
    "rpm": LIMIT,
    "tpm": LIMIT,
    "max_concurrency": LIMIT,
    "status": Field("str", choices=("active", "suspended")),
}

KEY_FIELDS: dict[str, Field] = {
    "name": Field("str", max_len=100),
    "expires_at": Field("datetime", nullable=True),
    "expires_in_s": Field("int", min=1),
}
