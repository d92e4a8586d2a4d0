"""Token log-probabilities in OpenAI's two shapes.

Text completions (`logprobs: n`) carry parallel lists: `tokens`, `token_logprobs`,
`top_logprobs` (one {token: logprob} object per token) and `text_offset` (where each
token starts in the completion text). Chat completions (`logprobs: true`,
`top_logprobs: n`) carry `content`: one {token, logprob, bytes, top_logprobs} object per
token. A token's text is its decode alone, special tokens included; `bytes` is that
text's UTF-8 (a token holding part of a character reads as U+FFFD there, as in vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from engine.request import TokenLogprob


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class TokenTexts:
    """Token id -> its text, remembered (a stream asks for the same ids again and again;
    the cache holds at most the vocabulary)."""

    def __init__(self, tokenizer: Decoder) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode(
                [token_id], skip_special_tokens=False
            )
        return text


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
        text = self._texts(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _completion_body(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        tokens = [self._texts(lp.token_id) for lp in logprobs]
        offsets = []
        for text in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [
                {self._texts(token): value for token, value in lp.top} for lp in logprobs
            ],
            "text_offset": offsets,
        }
