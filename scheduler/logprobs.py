"""Token log-probabilities as they travel on a job's result stream.

A worker publishes the log-probabilities of a step's tokens with them, as one compact
JSON string (the backends store it as it is); the gateway that reads the stream decodes
it. Only requests that ask for logprobs carry any.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from engine.request import TokenLogprob


def encode_logprobs(logprobs: Sequence[TokenLogprob]) -> str:
    """`[[token id, logprob, [[id, logprob], ...], text chars], ...]`, or "" for none."""
    if not logprobs:
        return ""
    return json.dumps(
        [
            [lp.token_id, lp.logprob, [list(pair) for pair in lp.top], lp.num_text_chars]
            for lp in logprobs
        ],
        separators=(",", ":"),
    )


def decode_logprobs(raw: str) -> tuple[TokenLogprob, ...]:
    """What encode_logprobs wrote."""
    if not raw:
        return ()
    return tuple(
        TokenLogprob(
            int(token), float(logprob), tuple((int(i), float(v)) for i, v in top), int(chars)
        )
        for token, logprob, top, chars in json.loads(raw)
    )
