"""Typed errors raised by the engine. They carry data, not HTTP status codes: the
gateway maps them to responses in one table."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine cannot run as asked (bad sampling value, empty prompt...)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ContextLengthExceededError(InvalidRequestError):
    """Prompt plus max_tokens does not fit the model's context window."""

    def __init__(
        self,
        *,
        num_prompt_tokens: int,
        max_tokens: int,
        max_model_len: int,
        param: str = "max_tokens",
    ) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens; the request asks "
            f"for {num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} to generate).",
            param=param,
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class PromptTooLongError(InvalidRequestError):
    """A prompt so long that it cannot fit the context whatever it tokenizes to: refused
    from its length in characters, without tokenizing it (the gateway answers it as it
    answers ContextLengthExceededError)."""

    def __init__(self, *, num_chars: int, max_model_len: int, param: str) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{num_chars} characters, far more than that many tokens can hold.",
            param=param,
        )
        self.num_chars = num_chars
        self.max_model_len = max_model_len


class UnsupportedModelError(EngineError):
    """A checkpoint whose architecture the engine does not implement."""

    def __init__(self, architecture: str, supported: tuple[str, ...]) -> None:
        super().__init__(
            f"Unsupported architecture {architecture!r}; supported: {', '.join(supported)}"
        )
        self.architecture = architecture
        self.supported = supported


class ModelLoadError(EngineError):
    """A checkpoint directory that is missing files or is malformed."""


class EngineDeadError(EngineError):
    """The engine loop stopped (crash or shutdown) and takes no more work."""


class RequestAbortedError(EngineError):
    """The request was aborted before it finished."""
