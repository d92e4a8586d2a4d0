"""Token log-probabilities as they travel on a job's result stream.

A worker publishes the log-probabilities of a step's tokens with them, as one compact
JSON string (the backends store it as it is); the gateway that reads the stream decodes
it. Only requests that ask for logprobs carry any. The first step of a request that asks
for its prompt's carries those too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from engine.request import TokenLogprob


def encode_logprobs(
    logprobs: Sequence[TokenLogprob], prompt: Sequence[TokenLogprob] | None = None
) -> str:
    """`[[token id, logprob, [[id, logprob], ...], text chars], ...]`, or "" for none;
    with `prompt`, `{"t": <that list>, "p": <the prompt's, as a list alike>}`."""
    if prompt is not None:
        return json.dumps({"t": _rows(logprobs), "p": _rows(prompt)}, separators=(",", ":"))
    if not logprobs:
        return ""
    return json.dumps(_rows(logprobs), separators=(",", ":"))


def _rows(logprobs: Sequence[TokenLogprob]) -> list[list[Any]]:
    return [
        [lp.token_id, lp.logprob, [list(pair) for pair in lp.top], lp.num_text_chars]
        for lp in logprobs
    ]


Logprobs = tuple[TokenLogprob, ...]


def decode_logprobs(raw: str) -> tuple[Logprobs, Logprobs | None]:
    """What encode_logprobs wrote: (the tokens', the prompt's or None)."""
    if not raw:
        return (), None
    data = json.loads(raw)
    if isinstance(data, dict):
        return _logprobs(data["t"]), _logprobs(data["p"])
    return _logprobs(data), None


def _logprobs(rows: list[list[Any]]) -> Logprobs:
    return tuple(
        TokenLogprob(
            int(token), float(logprob), tuple((int(i), float(v)) for i, v in top), int(chars)
        )
        for token, logprob, top, chars in rows
    )
