"""`echo` on /v1/completions: each choice's text starts with the prompt, and with
`logprobs` its log-probabilities start with the prompt tokens' (the engine's prompt
log-probabilities; nothing predicts the first token, so it has none)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from gateway.openai.logprobs import EchoedPrompt


def echoed_prompt(
    tokenizer: Any, prompt_ids: Sequence[int], text: str | None, *, with_offsets: bool
) -> EchoedPrompt:
    """The prompt as `echo` returns it (`tokenizer`: the engine's): `text` (the client's
    own prompt string) or, for a prompt of token ids, their text. `with_offsets`: also
    where each token starts in it, for the logprobs' text_offset."""
    if not with_offsets:
        return EchoedPrompt(text if text is not None else tokenizer.decode(prompt_ids), (), ())
    if text is not None:
        # The tokenizer's own spans: special-token text the client wrote counts as the
        # characters it is, a token the tokenizer added (BOS) as none.
        starts = tokenizer.token_starts(text)
        if starts is not None and len(starts) == len(prompt_ids):
            return EchoedPrompt(text, tuple(prompt_ids), tuple(starts))
    # Token ids: the text each one releases, counted as the engine counts a
    # completion's (special tokens and pieces of a character release none).
    detokenizer = tokenizer.detokenizer([], ())
    last = len(prompt_ids) - 1
    pieces = [
        detokenizer.add([token], is_last=i == last).text for i, token in enumerate(prompt_ids)
    ]
    offsets = tuple(itertools.accumulate((len(p) for p in pieces[:-1]), initial=0))
    return EchoedPrompt(text if text is not None else "".join(pieces), tuple(prompt_ids), offsets)
