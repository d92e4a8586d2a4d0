"""OpenAI response bodies and SSE framing for text and chat completions.

A `ResponseShape` knows how one endpoint spells a whole response and a stream chunk, so
the route logic (queue, engine, usage) is written once for both endpoints.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SYSTEM_FINGERPRINT = "tiergate"
SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + _dumps(payload) + b"\n\n"


def _dumps(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def as_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass(frozen=True)
class FinishedChoice:
    """One choice of a whole response (`logprobs` from gateway.openai.logprobs)."""

    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


@dataclass(frozen=True)
class ResponseShape:
    """How one endpoint names its objects; `chat` selects message/delta vs text."""

    response_id: str
    model: str
    service_tier: str
    chat: bool
    created: int

    @classmethod
    def for_request(
        cls, request_id: str, *, model: str, service_tier: str, chat: bool
    ) -> ResponseShape:
        # The completion id reuses the request id's random part, so logs join on either.
        suffix = request_id.removeprefix("req_")
        prefix = "chatcmpl-" if chat else "cmpl-"
        return cls(prefix + suffix, model, service_tier, chat, int(time.time()))

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "service_tier": self.service_tier,
        }

    def full(self, choices: Sequence[FinishedChoice], usage: Usage) -> dict[str, Any]:
        """The non-streaming response body, choices in index order."""
        body = self._envelope("chat.completion" if self.chat else "text_completion")
        body["choices"] = [self._full_choice(i, c) for i, c in enumerate(choices)]
        body["usage"] = usage.as_dict()
        return body

    def _full_choice(self, index: int, choice: FinishedChoice) -> dict[str, Any]:
        if self.chat:
            return {
                "index": index,
                "message": {"role": "assistant", "content": choice.text, "refusal": None},
                "logprobs": choice.logprobs,
                "finish_reason": choice.finish_reason,
            }
        return {
            "index": index,
            "text": choice.text,
            "logprobs": choice.logprobs,
            "finish_reason": choice.finish_reason,
        }

    def chunk(
        self,
        text_delta: str,
        finish_reason: str | None,
        *,
        index: int = 0,
        first: bool = False,
        include_usage: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        """One streamed chunk of choice `index`. With include_usage every chunk carries
        `usage: null`."""
        if self.chat:
            body = self._envelope("chat.completion.chunk")
            delta: dict[str, Any] = {"role": "assistant", "content": text_delta} if first else {}
            if not first and text_delta:
                delta["content"] = text_delta
            choice: dict[str, Any] = {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        else:
            body = self._envelope("text_completion")
            choice = {
                "index": index,
                "text": text_delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        body["choices"] = [choice]
        if include_usage:
            body["usage"] = None
        return sse_event(body)

    def usage_chunk(self, usage: Usage) -> bytes:
        """The last chunk of a stream with include_usage: no choices, the usage."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage.as_dict()
        return sse_event(body)
