"""Decoding JSON from clients the same way everywhere (API bodies, admin bodies, the
lines of a batch input file).

`json.loads` accepts more than a request may carry, and each extra fails later as a 500:
NaN and Infinity (not JSON); integers of more than 4,300 digits and nesting deep enough
to exhaust the stack (a ValueError and a RecursionError, not a JSONDecodeError); and
escapes of lone surrogates ("\\ud800"), which decode to a str that no encoder takes, so
the tokenizer, the database or the JSON response fails on it. `loads` refuses all of
them with JsonBodyError, whose message says what is wrong.
"""

from __future__ import annotations

import json
import re
from typing import Any

# An escape of a surrogate code point: only then can the decoded value hold a lone one
# (a body that is strict UTF-8 cannot carry one unescaped), so only then is it walked.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class JsonBodyError(ValueError):
    """The text is not JSON a request may carry; the message says why."""


def loads(text: str) -> Any:
    """The JSON value of `text`, or JsonBodyError."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise JsonBodyError(f"{exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise JsonBodyError("it is nested too deeply") from None
    except ValueError as exc:  # an integer too long to convert
        raise JsonBodyError(str(exc)) from None
    if _SURROGATE_ESCAPE.search(text):
        _refuse_lone_surrogates(value)
    return value


def _reject_constant(name: str) -> Any:
    raise JsonBodyError(f"{name} is not valid JSON")


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
