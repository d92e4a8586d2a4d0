"""OpenAI request bodies turned into typed, frozen dataclasses at the edge.

Everything here is plain parsing: bytes -> JSON object -> dataclass, raising
`InvalidRequestError` (400) with the offending `param` for anything malformed. Nothing
below the routes ever sees a dict. Model-dependent checks (model name, context length,
tokenisation) happen in the routes, where the engine is known.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.request import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from gateway import json_body
from gateway.errors import InvalidRequestError

MAX_STOP_SEQUENCES = 4
# Each choice of a request is a job that carries its own copy of the prompt's token ids,
# the stop strings and `user` through the queue (serialised to Redis with \u escapes, up
# to 12 bytes a character): unbounded, a 3.6 MB body with n=128 put 190 MB in Redis at
# once. Bounded, the strings' copies stay under 6 MB; the prompt's are bounded by the
# context and n by the tenant's concurrency limit (a slot per choice).
MAX_STOP_CHARS = 1_000
MAX_STOP_TOKEN_IDS = 256  # copied into each choice's job, like the stop strings
MAX_USER_CHARS = 256
MAX_TEMPERATURE = 2.0
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2]
MAX_LOGIT_BIAS = 100.0
# Each entry costs every step of the request a little; OpenAI's limit.
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_CHOICES = 128  # OpenAI's bound on `n`
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant"})


@dataclass(frozen=True)
class GenerationOptions:
    """The sampling and delivery options shared by text and chat completions."""

    model: str
    max_tokens: int | None  # None: the route picks the default for the endpoint
    max_tokens_param: str  # the name the client gave it by (for errors)
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    presence_penalty: float
    frequency_penalty: float
    logit_bias: tuple[tuple[int, float], ...]  # (token id, bias), sorted by id
    top_k: int  # 0: no cut (vLLM's extension; -1 means the same there)
    # vLLM's extensions: more tokens that end a choice (finish_reason "stop"), and
    # generating through end-of-sequence to max_tokens (how load generators fix lengths).
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    # vLLM's samplers: a probability floor relative to the likeliest token, a penalty on
    # tokens of the prompt and the output (divides a positive logit, multiplies a
    # negative one), and a length before which nothing ends the output but max_tokens.
    min_p: float
    repetition_penalty: float
    min_tokens: int
    # None: no log-probabilities; n: each token's with the n most likely (chat's
    # top_logprobs, or the text endpoint's logprobs).
    logprobs: int | None
    n: int  # choices to generate, each its own job (see gateway.openai.choices)
    echo: bool  # /v1/completions: the prompt before each choice's text (and logprobs)
    stream: bool
    include_usage: bool
    user: str | None
    service_tier: str | None


Prompt = str | tuple[int, ...]  # text, or token ids


@dataclass(frozen=True)
class CompletionRequest:
    """POST /v1/completions: one prompt or several, each as text or as token ids.

    Several prompts (a list of strings, or of token-id lists) are a batch of requests in
    one: prompt i's choice j is the response's choice i x n + j, as OpenAI numbers them.
    """

    prompts: tuple[Prompt, ...]
    options: GenerationOptions

    @property
    def prompt(self) -> Prompt:
        """The first prompt (the only one, in the common case)."""
        return self.prompts[0]


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None

    def as_template_dict(self) -> dict[str, str]:
        """The shape tokenizer chat templates expect."""
        message = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        return message


@dataclass(frozen=True)
class ChatCompletionRequest:
    """POST /v1/chat/completions."""

    messages: tuple[ChatMessage, ...]
    options: GenerationOptions


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Decode a request body: strict UTF-8, valid JSON, a JSON object at the top."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(
            f"Request body is not valid UTF-8 (byte {exc.start}).", code="invalid_utf8"
        ) from None
    if not text.strip():
        raise InvalidRequestError("Request body is empty; expected a JSON object.")
    try:
        data = json_body.loads(text)
    except json_body.JsonBodyError as exc:
        raise InvalidRequestError(
            f"Request body is not valid JSON: {exc}.", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise InvalidRequestError("Request body must be a JSON object.", code="invalid_json")
    return data


def parse_completion_request(body: bytes) -> CompletionRequest:
    return completion_request(parse_json_object(body))


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    return chat_request(parse_json_object(body))


def completion_request(data: dict[str, Any]) -> CompletionRequest:
    """A completions body already decoded to its JSON object."""
    options = _options(data, chat=False)
    prompts = _prompts(data)
    if len(prompts) * options.n > MAX_CHOICES:
        raise InvalidRequestError(
            f"{len(prompts)} prompts x n={options.n} is {len(prompts) * options.n} "
            f"choices; a request makes at most {MAX_CHOICES}.",
            param="prompt",
        )
    return CompletionRequest(prompts=prompts, options=options)


def chat_request(data: dict[str, Any]) -> ChatCompletionRequest:
    """A chat completions body already decoded to its JSON object."""
    return ChatCompletionRequest(messages=_messages(data), options=_options(data, chat=True))


def _options(data: dict[str, Any], *, chat: bool) -> GenerationOptions:
    model = _required(data, "model", str)
    if not model:
        raise InvalidRequestError("model must not be empty.", param="model")
    max_tokens = _optional(data, "max_tokens", int)
    # max_completion_tokens is the newer name and wins when both are given (a null one
    # is not given: the value checked, and named in an error, is max_tokens then). The
    # legacy text endpoint takes it too, rather than ignore it for the default length.
    newer = _optional(data, "max_completion_tokens", int)
    if newer is not None:
        max_tokens = newer
    if max_tokens is not None and max_tokens < 1:
        param = "max_tokens" if newer is None else "max_completion_tokens"
        raise InvalidRequestError(f"{param} must be at least 1.", param=param)
    temperature = _number(data, "temperature", default=1.0)
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise InvalidRequestError(
            f"temperature must be between 0 and {MAX_TEMPERATURE:g}.", param="temperature"
        )
    top_p = _number(data, "top_p", default=1.0)
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequestError("top_p must be greater than 0 and at most 1.", param="top_p")
    n = _choices(data)
    stream = _optional(data, "stream", bool) or False
    include_usage = False
    stream_options = _optional(data, "stream_options", dict)
    if stream_options is not None:
        if not stream:
            raise InvalidRequestError(
                "stream_options is only allowed when stream is true.", param="stream_options"
            )
        include_usage = _optional(stream_options, "include_usage", bool, "stream_options.") or False
        if _optional(stream_options, "continuous_usage_stats", bool, "stream_options."):
            raise InvalidRequestError(
                "stream_options.continuous_usage_stats is not supported; include_usage "
                "sends the usage once, at the end.",
                param="stream_options.continuous_usage_stats",
            )
    penalties = {}
    for penalty in ("presence_penalty", "frequency_penalty"):
        penalties[penalty] = _number(data, penalty, default=0.0)
        if abs(penalties[penalty]) > MAX_PENALTY:
            raise InvalidRequestError(
                f"{penalty} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}.", param=penalty
            )
    _refuse_other_special_tokens(data, chat=chat)
    if not _REFUSABLE.isdisjoint(data):  # one set operation for the usual body
        _refuse_unsupported(data)
    return GenerationOptions(
        model=model,
        max_tokens=max_tokens,
        max_tokens_param="max_tokens" if newer is None else "max_completion_tokens",
        temperature=temperature,
        top_p=top_p,
        seed=_seed(data),
        stop=_stop(data),
        **penalties,
        logit_bias=_logit_bias(data),
        top_k=_top_k(data),
        stop_token_ids=_stop_token_ids(data),
        ignore_eos=_optional(data, "ignore_eos", bool) or False,
        **_vllm_samplers(data, max_tokens),
        logprobs=_chat_logprobs(data) if chat else _completion_logprobs(data),
        n=n,
        echo=_echo(data, chat=chat, n=n),
        stream=stream,
        include_usage=include_usage,
        user=_user(data),
        service_tier=_optional(data, "service_tier", str),
    )


def _refuse_unsupported(data: dict[str, Any]) -> None:
    for unsupported in _UNSUPPORTED:
        if not _is_unset(data.get(unsupported)):
            raise InvalidRequestError(f"{unsupported} is not supported.", param=unsupported)
    # Fields that only have their default here: anything else would be silently ignored.
    for name, defaults in _DEFAULT_ONLY.items():
        value = data.get(name)
        if value is not None and not any(_same_json(value, d) for d in defaults):
            allowed = " or ".join(repr(d) for d in defaults)
            but = f" except as {allowed}" if defaults else ""
            raise InvalidRequestError(f"{name} is not supported{but}.", param=name)


# Fields refused unless unset (null, false, empty): each asks for something this server
# does not do, and ignoring it would answer a different question. OpenAI's, then vLLM's
# extensions that a client may send in the body (guided decoding under its old names
# and its new one, custom logits processors, chat template overrides, prompt scoring).
_UNSUPPORTED = (
    "tools",
    "functions",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "logits_processors",
    "chat_template",
    "chat_template_kwargs",
    "continue_final_message",
    "prompt_logprobs",
    "return_tokens_as_token_ids",
    "documents",
    "mm_processor_kwargs",
    "prompt_embeds",
)
# Unsupported fields and the values of theirs that ask for nothing (OpenAI's defaults,
# vLLM's for its extensions: a client may send a whole default parameter set); none for
# those where even an empty object asks for something (web_search_options: {} turns
# search on).
_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "audio": (),
    "web_search_options": (),
    "prediction": (),
    "response_format": ({"type": "text"},),
    "suffix": ("",),
    "tool_choice": ("none",),
    "function_call": ("none",),
    "modalities": (["text"],),
    # Guided decoding: any value but null constrains the output in vLLM (an empty
    # schema `{}` means "any JSON value", an empty regex or choice list is an error).
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    # The same under TGI's and llama.cpp's names (a GBNF grammar string is empty there
    # when unset; an empty JSON schema means "any JSON value").
    "grammar": ("",),
    "grammar_string": ("",),
    "json_schema": (),
    # vLLM's sampling knobs at their no-op values.
    "length_penalty": (1, 1.0),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "priority": (0,),  # vLLM's request priority: here the tier decides
    # Other servers' samplers (Hugging Face TGI and transformers, llama.cpp,
    # text-generation-webui, KoboldCpp), which a client written for them may send:
    # accepted only at their no-op values.
    "typical_p": (1, 1.0),
    "tfs": (1, 1.0),
    "tfs_z": (1, 1.0),
    "top_a": (0, 0.0),
    "epsilon_cutoff": (0, 0.0),
    "eta_cutoff": (0, 0.0),
    "mirostat": (0,),
    "mirostat_mode": (0,),
    "dry_multiplier": (0, 0.0),
    "xtc_probability": (0, 0.0),
    "smoothing_factor": (0, 0.0),
    "no_repeat_ngram_size": (0,),
    "repetition_penalty_range": (0,),
    "bad_words_ids": ([],),
    "repeat_penalty": (1, 1.0),
    "rep_pen": (1, 1.0),
    "encoder_repetition_penalty": (1, 1.0),
    "typical": (1, 1.0),
    "dynatemp_range": (0, 0.0),
    "top_n_sigma": (-1, -1.0),
    "penalty_alpha": (0, 0.0),
    "guidance_scale": (1, 1.0),
    "negative_prompt": ("",),
    "ban_eos_token": (False,),
    "custom_token_bans": ("",),
    "num_beams": (1,),
    "do_sample": (True,),  # false is greedy there: here temperature 0 says so
    "watermark": (False,),
    # Their output switches.
    "n_probs": (0,),
    "top_n_tokens": (0,),
    "details": (False,),
    "decoder_input_details": (False,),
    "return_full_text": (False,),
    # vLLM's output switches, at the behaviour this server has.
    "skip_special_tokens": (True,),
    "include_stop_str_in_output": (False,),
    "spaces_between_special_tokens": (True,),
    "use_beam_search": (False,),
    "truncate_prompt_tokens": (),
    "add_generation_prompt": (True,),
    "detokenize": (True,),
    "return_token_ids": (False,),  # vLLM's: adds the token ids to the response
}
_REFUSABLE = frozenset(_UNSUPPORTED) | _DEFAULT_ONLY.keys()
MAX_COMPLETION_LOGPROBS = 5  # the text endpoint's cap
MAX_TOP_LOGPROBS = 20  # chat's


def _echo(data: dict[str, Any], *, chat: bool, n: int) -> bool:
    echo = _optional(data, "echo", bool) or False
    if echo and chat:
        raise InvalidRequestError(
            "echo is a completions field; chat does not take it.", param="echo"
        )
    if echo and n > 1 and data.get("logprobs") is not None:
        # Each choice would score the whole prompt again (no prefix cache for that), for
        # n copies of the same numbers.
        raise InvalidRequestError(
            "echo with logprobs scores the prompt once: it takes n=1.", param="n"
        )
    return echo


def _choices(data: dict[str, Any]) -> int:
    """`n`, and `best_of` where it asks for no more than n (nothing is ranked here)."""
    n = _optional(data, "n", int)
    n = 1 if n is None else n
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidRequestError(f"n must be between 1 and {MAX_CHOICES}.", param="n")
    best_of = _optional(data, "best_of", int)
    if best_of is not None and best_of != n:
        # best_of > n would generate more and return the most likely n: not done here.
        raise InvalidRequestError(
            f"best_of is not supported except equal to n ({n}).", param="best_of"
        )
    return n


def _completion_logprobs(data: dict[str, Any]) -> int | None:
    """The text endpoint's `logprobs`: how many top tokens to list with each token."""
    if data.get("top_logprobs") is not None:
        raise InvalidRequestError(
            "top_logprobs is a chat completions field; here logprobs takes the count.",
            param="top_logprobs",
        )
    n = _optional(data, "logprobs", int)
    if n is not None and not 0 <= n <= MAX_COMPLETION_LOGPROBS:
        raise InvalidRequestError(
            f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}.", param="logprobs"
        )
    return n


def _chat_logprobs(data: dict[str, Any]) -> int | None:
    """Chat's `logprobs: true` with `top_logprobs: n` (0 when not given)."""
    wanted = _optional(data, "logprobs", bool) or False
    n = _optional(data, "top_logprobs", int)
    if n is not None:
        if not 0 <= n <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}.", param="top_logprobs"
            )
        if not wanted:
            raise InvalidRequestError(
                "top_logprobs needs logprobs set to true.", param="top_logprobs"
            )
    return (n or 0) if wanted else None


def _refuse_other_special_tokens(data: dict[str, Any], *, chat: bool) -> None:
    """vLLM's `add_special_tokens`, at what this server does: a text prompt gets the
    tokenizer's special tokens (BOS), a chat prompt only its template's."""
    value = _optional(data, "add_special_tokens", bool)
    if value is not None and value != (not chat):
        raise InvalidRequestError(
            f"add_special_tokens is not supported except as {not chat} on this endpoint.",
            param="add_special_tokens",
        )


def _vllm_samplers(data: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
    """min_p, repetition_penalty and min_tokens, at vLLM's ranges (a max_tokens left to
    the endpoint's default is checked against min_tokens by the routes)."""
    min_p = _number(data, "min_p", default=0.0)
    if not 0.0 <= min_p <= 1.0:
        raise InvalidRequestError("min_p must be between 0 and 1.", param="min_p")
    penalty = _number(data, "repetition_penalty", default=1.0)
    if not MIN_REPETITION_PENALTY <= penalty <= MAX_REPETITION_PENALTY:
        raise InvalidRequestError(
            f"repetition_penalty must be between {MIN_REPETITION_PENALTY:g} and "
            f"{MAX_REPETITION_PENALTY:g}.",
            param="repetition_penalty",
        )
    min_tokens = _optional(data, "min_tokens", int) or 0
    if min_tokens < 0:
        raise InvalidRequestError("min_tokens must be at least 0.", param="min_tokens")
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidRequestError(
            f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens}).",
            param="min_tokens",
        )
    return {"min_p": min_p, "repetition_penalty": penalty, "min_tokens": min_tokens}


def _stop_token_ids(data: dict[str, Any]) -> tuple[int, ...]:
    """vLLM's `stop_token_ids` (each below the vocabulary size, checked by the routes)."""
    ids = _optional(data, "stop_token_ids", list)
    if ids is None:
        return ()
    if not all(_is_int(t) and t >= 0 for t in ids):
        raise InvalidRequestError(
            "stop_token_ids must be a list of token ids (integers >= 0).", param="stop_token_ids"
        )
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(
            f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} token ids.",
            param="stop_token_ids",
        )
    return tuple(sorted(set(ids)))


def _top_k(data: dict[str, Any]) -> int:
    """vLLM's `top_k`: sample among the k most likely tokens; 0 or -1 for all."""
    k = _optional(data, "top_k", int)
    if k is None or k in (0, -1):
        return 0
    if k < 1:
        raise InvalidRequestError("top_k must be -1, 0 or a positive integer.", param="top_k")
    return k


def _is_unset(value: Any) -> bool:
    """None, false, or an empty array or object: a field that asks for nothing. Not 0,
    which JSON tells apart from false (and `0 == False` in Python)."""
    return value is None or value is False or (isinstance(value, dict | list) and not value)


def _same_json(value: Any, expected: Any) -> bool:
    """Equal as JSON values: 1 is not true, "1" is not 1."""
    if isinstance(expected, dict):
        return (
            isinstance(value, dict)
            and value.keys() == expected.keys()
            and all(_same_json(value[k], v) for k, v in expected.items())
        )
    return type(value) is type(expected) and value == expected


def _logit_bias(data: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """{"<token id>": bias, ...} as sorted (id, bias) pairs; whether each id is in the
    vocabulary the route checks, where the tokenizer is known."""
    raw = _optional(data, "logit_bias", dict)
    if not raw:
        return ()
    if len(raw) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(
            f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens, not {len(raw)}.",
            param="logit_bias",
        )
    pairs = []
    for key, value in raw.items():
        # Decimal digits only: int() would also take " 5", "+5", "5_0" and "٥".
        if not (key.isascii() and key.isdigit()):
            raise InvalidRequestError(
                f"logit_bias keys must be token ids as decimal strings, not {key[:40]!r}.",
                param="logit_bias",
            )
        if len(key) > 10:  # no vocabulary reaches 10**10; and int() of a huge key is slow
            raise InvalidRequestError(
                f"logit_bias key {key[:40]!r} has more digits than any token id (at most 10).",
                param="logit_bias",
            )
        bias = _as_finite(value)
        if bias is None or abs(bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias[{key!r}] must be a number between -{MAX_LOGIT_BIAS:g} and "
                f"{MAX_LOGIT_BIAS:g}.",
                param="logit_bias",
            )
        pairs.append((int(key), bias))
    ids = [token_id for token_id, _ in pairs]
    if len(set(ids)) < len(ids):
        # "5" and "05" are one token: which of two biases was meant cannot be told.
        twice = min(token_id for token_id in ids if ids.count(token_id) > 1)
        keys = ", ".join(repr(key) for key in raw if int(key) == twice)
        raise InvalidRequestError(
            f"logit_bias names token {twice} more than once ({keys}).", param="logit_bias"
        )
    return tuple(sorted(pairs))


def _seed(data: dict[str, Any]) -> int | None:
    seed = _optional(data, "seed", int)
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise InvalidRequestError("seed must be a 64-bit integer.", param="seed")
    return seed


def _prompts(data: dict[str, Any]) -> tuple[Prompt, ...]:
    if "prompt" not in data or data["prompt"] is None:
        raise InvalidRequestError("Missing required parameter: 'prompt'.", param="prompt")
    prompt = data["prompt"]
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return (_token_ids(prompt),)
    # A list of prompts: all strings, or all token-id lists (OpenAI's two array forms).
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return tuple(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt)
    ):
        return tuple(_token_ids(p) for p in prompt)
    raise InvalidRequestError(
        "prompt must be a string, a non-empty list of token ids, or a non-empty list of "
        "either (all strings, or all token-id lists).",
        param="prompt",
    )


def _token_ids(prompt: list[int]) -> tuple[int, ...]:
    if any(t < 0 for t in prompt):
        raise InvalidRequestError("Token ids must be >= 0.", param="prompt")
    return tuple(prompt)


def _messages(data: dict[str, Any]) -> tuple[ChatMessage, ...]:
    raw = _required(data, "messages", list)
    if not raw:
        raise InvalidRequestError("messages must not be empty.", param="messages")
    messages = []
    for i, item in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object.", param=where)
        role = _required(item, "role", str, f"{where}.")
        if role == "tool":
            # It answers an assistant message's tool_calls (OpenAI refuses one that does
            # not), and those are refused below: no conversation can hold one here.
            raise InvalidRequestError(
                f"{where} is a tool message, which answers an assistant message's "
                "tool_calls; tool calls are not supported.",
                param=f"{where}.role",
            )
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"{where}.role must be one of {', '.join(sorted(CHAT_ROLES))}.",
                param=f"{where}.role",
            )
        for unsupported in ("tool_calls", "function_call", "audio"):
            # A replayed tool call would vanish from the prompt unnoticed.
            if not _is_unset(item.get(unsupported)):
                raise InvalidRequestError(
                    f"{where}.{unsupported} is not supported.", param=f"{where}.{unsupported}"
                )
        content = _content(item.get("content"), role, f"{where}.content")
        messages.append(ChatMessage(role, content, _optional(item, "name", str, f"{where}.")))
    return tuple(messages)


def _content(content: Any, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidRequestError(
                    f"{where}[{j}] must be a text part; only text content is supported.",
                    param=f"{where}[{j}]",
                )
            parts.append(_required(part, "text", str, f"{where}[{j}]."))
        # One line each, as vLLM joins them: a client sending a question and a document
        # as two parts gets the same prompt (and tokens, and bill) from either server.
        return "\n".join(parts)
    raise InvalidRequestError(f"{where} must be a string or a list of text parts.", param=where)


def _stop(data: dict[str, Any]) -> tuple[str, ...]:
    stop = data.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequestError(
            "stop must be a non-empty string or a list of non-empty strings.", param="stop"
        )
    if len(stop) > MAX_STOP_SEQUENCES:
        raise InvalidRequestError(
            f"stop may hold at most {MAX_STOP_SEQUENCES} sequences.", param="stop"
        )
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise InvalidRequestError(
            f"Each stop sequence may be at most {MAX_STOP_CHARS} characters long.", param="stop"
        )
    return tuple(stop)


def _user(data: dict[str, Any]) -> str | None:
    user = _optional(data, "user", str)
    if user is not None and len(user) > MAX_USER_CHARS:
        raise InvalidRequestError(
            f"user may be at most {MAX_USER_CHARS} characters long.", param="user"
        )
    return user


_TYPE_NAMES = {
    str: "a string",
    int: "an integer",
    bool: "a boolean",
    list: "an array",
    dict: "an object",
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_type(value: Any, kind: type, param: str) -> Any:
    ok = _is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        raise InvalidRequestError(
            f"{param} must be {_TYPE_NAMES[kind]}, not {_json_type(value)}.", param=param
        )
    return value


def _required(data: dict[str, Any], key: str, kind: type, prefix: str = "") -> Any:
    if data.get(key) is None:
        raise InvalidRequestError(
            f"Missing required parameter: '{prefix}{key}'.", param=f"{prefix}{key}"
        )
    return _check_type(data[key], kind, f"{prefix}{key}")


def _optional(data: dict[str, Any], key: str, kind: type, prefix: str = "") -> Any:
    value = data.get(key)
    return None if value is None else _check_type(value, kind, f"{prefix}{key}")


def _number(data: dict[str, Any], key: str, *, default: float) -> float:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"{key} must be a number, not {_json_type(value)}.", param=key)
    number = _as_finite(value)
    if number is None:
        raise InvalidRequestError(f"{key} must be a finite number.", param=key)
    return number


def _as_finite(value: Any) -> float | None:
    """A JSON number as a finite float; None for anything else, NaN, infinities and
    integers beyond float's range (float() would overflow)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
