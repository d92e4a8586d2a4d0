"""Token log-probabilities in OpenAI's two shapes.

Text completions (`logprobs: n`) carry parallel lists: `tokens`, `token_logprobs`,
`top_logprobs` (one {token: logprob} object per token) and `text_offset` (where each
token starts in the completion text). Chat completions (`logprobs: true`,
`top_logprobs: n`) carry `content`: one {token, logprob, bytes, top_logprobs} object per
token.

A token's text is the bytes it stands for, read as UTF-8; a token holding part of a
character is written `bytes:\\xe6\\x97` (OpenAI's form), and chat's `bytes` are the raw
bytes, so a client can join split characters. Two tokens can still share a text (a
special token and its spelling): in a text completion's `top_logprobs` object the more
likely keeps the key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from engine.request import TokenLogprob


class TokenBytes(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...


class TokenTexts:
    """Token id -> (text, bytes), remembered (a stream asks for the same ids again and
    again; the cache holds at most the vocabulary)."""

    def __init__(self, tokenizer: TokenBytes) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        known = self._texts.get(token_id)
        if known is None:
            raw = self._tokenizer.token_bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
            known = self._texts[token_id] = (text, raw)
        return known


class LogprobsWriter:
    """One response's logprobs objects; a stream asks for one per chunk, and text
    offsets run on from chunk to chunk."""

    def __init__(self, texts: TokenTexts, *, chat: bool) -> None:
        self._texts = texts
        self._chat = chat
        self._text_offset = 0

    def body(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        return self._chat_body(logprobs) if self._chat else self._completion_body(logprobs)

    def _chat_body(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        return {
            "content": [
                {
                    **self._entry(lp.token_id, lp.logprob),
                    "top_logprobs": [self._entry(token, value) for token, value in lp.top],
                }
                for lp in logprobs
            ],
            "refusal": None,
        }

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self._texts(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    def _completion_body(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        offsets = []
        for lp in logprobs:
            # Where the token starts in the text the client gets (the engine's account:
            # special tokens and held-back pieces of a character add nothing there).
            offsets.append(self._text_offset)
            self._text_offset += lp.num_text_chars
        return {
            "tokens": [self._texts(lp.token_id)[0] for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [self._top_object(lp) for lp in logprobs],
            "text_offset": offsets,
        }

    def _top_object(self, logprob: TokenLogprob) -> dict[str, float]:
        top: dict[str, float] = {}
        for token, value in logprob.top:  # most likely first: it keeps a shared key
            top.setdefault(self._texts(token)[0], value)
        return top
