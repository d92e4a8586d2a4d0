"""Decoding JSON from clients the same way everywhere (API bodies, admin bodies, the
lines of a batch input file).

`json.loads` accepts more than a request may carry, and each extra fails later as a 500
or, worse, is silently misread: NaN and Infinity (not JSON); integers of more than 4,300
digits and nesting deep enough to exhaust the stack (a ValueError and a RecursionError,
not a JSONDecodeError); escapes of lone surrogates ("\\ud800"), which decode to a str that
no encoder takes, so the tokenizer, the database or the JSON response fails on it; and an
object with the same key twice, of which json.loads keeps the last value, so that
`{"tier": "batch", "tier": "interactive"}` means what the last one says while a proxy or
an audit log that reads the first one sees something else. `loads` refuses all of them
with JsonBodyError, whose message says what is wrong.
"""

from __future__ import annotations

import json
import re
from typing import Any

# An escape of a surrogate code point: only then can the decoded value hold a lone one
# (a body that is strict UTF-8 cannot carry one unescaped), so only then is it walked.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
# How much of a repeated key an error message shows: the key is the client's, any length.
_MAX_KEY_SHOWN = 64


class JsonBodyError(ValueError):
    """The text is not JSON a request may carry; the message says why."""


def loads(text: str) -> Any:
    """The JSON value of `text`, or JsonBodyError."""
    try:
        if text.startswith("\ufeff"):  # what json.loads says, which the decoder does not
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        value = _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        raise JsonBodyError(f"{exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise JsonBodyError("it is nested too deeply") from None
    except JsonBodyError:
        raise
    except ValueError as exc:  # an integer too long to convert
        raise JsonBodyError(str(exc)) from None
    if _SURROGATE_ESCAPE.search(text):
        _refuse_lone_surrogates(value)
    return value


def _reject_constant(name: str) -> Any:
    raise JsonBodyError(f"{name} is not valid JSON")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Called by the C scanner once per object: the common case costs one dict() and one
    # len() comparison; only an object that lost a key to a repeat is walked again.
    obj = dict(pairs)
    if len(obj) != len(pairs):
        _refuse_repeated_key(pairs)
    return obj


def _refuse_repeated_key(pairs: list[tuple[str, Any]]) -> None:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            shown = key if len(key) <= _MAX_KEY_SHOWN else key[:_MAX_KEY_SHOWN] + "..."
            # repr: the key may hold quotes, controls or a lone surrogate, all escaped.
            raise JsonBodyError(f"an object has the key {shown!r} more than once")
        seen.add(key)


# One decoder for every call: json.loads with any option builds a new JSONDecoder (and
# its scanner) each time, which costs more than the parse of a typical body. The scanner
# keeps no state between calls but its key cache, which it clears after each one.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_object)


def _refuse_lone_surrogates(value: Any) -> None:
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise JsonBodyError(
                    "a string holds a lone surrogate escape (such as \\ud800), which is not "
                    "Unicode text"
                ) from None
        elif isinstance(item, dict):
            pending.extend(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
