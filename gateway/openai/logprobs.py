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
from dataclasses import dataclass
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


@dataclass(frozen=True)
class EchoedPrompt:
    """The prompt `echo` puts before a completion: its text, its tokens and where each
    token starts in that text."""

    text: str
    token_ids: tuple[int, ...]
    text_offsets: tuple[int, ...]


class LogprobsWriter:
    """One response's logprobs objects; a stream asks for one per chunk, and text
    offsets run on from chunk to chunk."""

    def __init__(self, texts: TokenTexts, *, chat: bool) -> None:
        self._texts = texts
        self._chat = chat
        self._text_offset = 0

    def body(
        self,
        logprobs: Sequence[TokenLogprob],
        *,
        echoed: tuple[EchoedPrompt, Sequence[TokenLogprob]] | None = None,
    ) -> dict[str, Any]:
        """The logprobs of `logprobs`' tokens; with `echoed` (a text completion's prompt
        and its tokens' log-probabilities from the second on), the prompt's first."""
        if self._chat:
            return self._chat_body(logprobs)
        if echoed is None:
            return self._completion_body(logprobs)
        whole = self.prompt_body(*echoed)
        for key, values in self._completion_body(logprobs).items():
            whole[key] += values
        return whole

    def prompt_body(self, prompt: EchoedPrompt, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        """A text completion's logprobs for its echoed prompt. Nothing predicts the first
        token: its log-probability and top tokens are null, as OpenAI writes them. The
        completion's offsets then run on from the end of the prompt's text."""
        self._text_offset = len(prompt.text)
        return {
            "tokens": [self._texts(token)[0] for token in prompt.token_ids],
            "token_logprobs": [None, *(lp.logprob for lp in logprobs)],
            "top_logprobs": [None, *(self._top_object(lp) for lp in logprobs)],
            "text_offset": list(prompt.text_offsets),
        }

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
        """The text endpoint's top tokens, with the token itself as OpenAI's legacy
        completions and vLLM write them: up to logprobs + 1 entries (one, the token's,
        with `logprobs: 0`)."""
        top: dict[str, float] = {}
        for token, value in logprob.top:  # most likely first: it keeps a shared key
            top.setdefault(self._texts(token)[0], value)
        top.setdefault(self._texts(logprob.token_id)[0], logprob.logprob)
        return top
