"""vLLM's /tokenize and /detokenize: the server's own tokenizer and chat template, so that
a client counts a prompt's tokens (and fits max_tokens to the context) exactly as the
server will. A tenant key is needed; nothing is queued or billed.

POST /tokenize takes a completions body's `prompt` (one) or a chat body's `messages`,
with the same validation (and the same refusals of options this server does not have),
and answers {"count", "max_model_len", "tokens"}, and "token_strs" (each id's vocabulary
entry) with `return_token_strs: true`. POST /detokenize takes {"model",
"tokens"} and answers {"prompt"}: the text those ids decode to.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.errors import InvalidRequestError
from gateway.openai.routes import OpenAIRoutes
from gateway.openai.schemas import chat_request, completion_request, parse_json_object

# Decoded in a worker thread past this many ids, as long prompts are tokenized.
OFF_LOOP_MIN_DECODE_TOKENS = 4096


class TokenizeRoutes:
    def __init__(self, openai: OpenAIRoutes) -> None:
        self._openai = openai

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
        ]

    async def tokenize(self, request: Request) -> Response:
        openai = self._openai
        await openai.deps.auth.authenticate(request.headers.get("authorization"))
        body = await request.body()
        data = parse_json_object(body)
        return_token_strs = data.pop("return_token_strs", False)
        if not isinstance(return_token_strs, bool):
            raise InvalidRequestError(
                "return_token_strs must be a boolean.", param="return_token_strs"
            )
        chat = "messages" in data
        if chat and "prompt" in data:
            raise InvalidRequestError("Send prompt or messages, not both.", param="messages")
        parsed = chat_request(data) if chat else completion_request(data)
        openai.check_model(parsed.options.model)
        prompts = await openai.prompt_token_ids_off_loop(parsed, len(body))
        if len(prompts) != 1:
            raise InvalidRequestError("/tokenize takes one prompt.", param="prompt")
        (ids,) = prompts
        answer = {
            "count": len(ids),
            "max_model_len": openai.deps.model.max_model_len,
            "tokens": ids,
        }
        if return_token_strs:
            answer["token_strs"] = openai.deps.model.tokenizer.token_strs(ids)
        return JSONResponse(answer)

    async def detokenize(self, request: Request) -> Response:
        openai = self._openai
        await openai.deps.auth.authenticate(request.headers.get("authorization"))
        data = parse_json_object(await request.body())
        model = data.get("model")
        if not isinstance(model, str):
            raise InvalidRequestError("model must be a string.", param="model")
        openai.check_model(model)
        tokens = _token_ids(data.get("tokens"), openai.deps.model.tokenizer.vocab_size)
        decode = openai.deps.model.tokenizer.decode
        if len(tokens) < OFF_LOOP_MIN_DECODE_TOKENS:
            text = decode(tokens)
        else:
            text = await asyncio.to_thread(decode, tokens)
        return JSONResponse({"prompt": text})


def _token_ids(value: Any, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not all(
        type(t) is int and 0 <= t < vocab_size for t in value
    ):
        raise InvalidRequestError(
            f"tokens must be a list of token ids from 0 to {vocab_size - 1}.", param="tokens"
        )
    return value
