"""Text <-> token ids for the engine: encoding, chat templates, eos ids, and incremental
detokenization with stop strings.

Wraps the Hugging Face fast tokenizer of the checkpoint (or the built-in one).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import TINY_RANDOM
from engine.errors import InvalidRequestError, ModelLoadError

_ASSETS_DIR = Path(__file__).resolve().parent / "assets"
# Tokens of prompt context kept in front of the output when decoding deltas: enough for
# tokenizers whose decode of a token depends on its neighbours (leading-space rules).
_CONTEXT_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"
# From this length on, encode through encode_batch: Tokenizer.encode holds the GIL for
# the whole call, encode_batch releases it. Below it, encode is cheaper (measured on the
# built-in tokenizer: 2.4 us against 3.1 us for 2 characters, 17 us against 20 us for 60)
# and holds the GIL for under a millisecond (about 1 ms per 4,000 characters).
_GIL_FREE_MIN_CHARS = 4096


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): every byte stands for a printable character,
    itself where printable, else the next unused code point from 256 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    code_points = {byte: byte for byte in printable}
    for byte in range(256):
        if byte not in code_points:
            code_points[byte] = 256 + len(code_points) - len(printable)
    return {chr(point): byte for byte, point in code_points.items()}


_BYTE_LEVEL_CHARS = _byte_level_chars()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    """A checkpoint's tokenizer: encode/decode, chat template and end-of-sequence ids.

    `max_token_chars` is an upper bound on the characters one token stands for: the
    longest vocabulary entry (for byte-level BPE each entry character is one byte, so it
    bounds decoded characters too). It is a bound, not an estimate of the average: text
    longer than n * max_token_chars characters is sure to take more than n tokens (for a
    tokenizer that keeps every input character, as byte-level BPE does), which lets a
    caller refuse an oversized prompt without tokenizing it.
    """

    def __init__(self, source: str | Path) -> None:
        path = _ASSETS_DIR if str(source) == TINY_RANDOM else Path(source)
        try:
            from transformers import AutoTokenizer

            # transformers warns about things a serving process cannot act on.
            logging.getLogger("transformers").setLevel(logging.ERROR)
            self._hf = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ModelLoadError(f"cannot load the tokenizer from {path}: {exc}") from exc
        self.eos_token_ids = _eos_token_ids(self._hf, path)
        self.vocab_size = len(self._hf)
        # The Rust tokenizer behind a fast tokenizer, called directly on the request path:
        # transformers' wrapper goes through its batch API (with a thread pool) and builds
        # a BatchEncoding for every call, several times the cost of the work itself.
        self._rust = getattr(self._hf, "backend_tokenizer", None)
        # With space clean-up on, what decode returns depends on the transformers version
        # (and the tokenizer model): leave those checkpoints to the wrapper.
        self._rust_decode = self._rust
        if getattr(self._hf, "clean_up_tokenization_spaces", False):
            self._rust_decode = None
        # get_vocab holds added tokens under their content.
        self.max_token_chars = max(len(token) for token in self._hf.get_vocab())
        decoder = getattr(self._rust, "decoder", None)
        self._is_byte_level = type(decoder).__name__ == "ByteLevel"
        special = [t.content for t in self._hf.added_tokens_decoder.values() if t.special]
        self._special_text = re.compile("|".join(map(re.escape, special))) if special else None
        # A second instance that reads special-token text as plain text, for chat message
        # contents. Its own instance: the setting is per instance, and other threads
        # encode with the shared one.
        self._rust_plain = None
        if self._rust is not None:
            self._rust_plain = type(self._rust).from_str(self._rust.to_str())
            self._rust_plain.encode_special_tokens = True

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the special tokens the checkpoint adds (BOS...).

        Long texts are encoded without holding the GIL, so running this in a worker
        thread leaves the event loop free.
        """
        if self._rust is not None:
            return _encode(self._rust, text, add_special_tokens)
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def token_starts(self, text: str) -> list[int] | None:
        """Where each token of `encode(text)` starts in `text`, in characters (a token
        the tokenizer adds, as BOS, starts at 0); None without a fast tokenizer."""
        if self._rust is None:
            return None
        if len(text) < _GIL_FREE_MIN_CHARS:
            encoding = self._rust.encode(text, add_special_tokens=True)
        else:
            encoding = self._rust.encode_batch([text], add_special_tokens=True)[0]
        return [start for start, _ in encoding.offsets]

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        if self._rust_decode is None:
            return self._hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self._rust_decode.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary entry of each id, as the tokenizer writes it (byte-level BPE's
        "Ġthe" for " the"): what vLLM's /tokenize answers with `return_token_strs`."""
        return [str(piece) for piece in self._hf.convert_ids_to_tokens(list(token_ids))]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for on its own. Decoding a token that holds part of
        a character gives U+FFFD; a byte-level BPE piece maps back byte for byte, and a
        byte-fallback piece ("<0xE2>") is its byte. Other pieces (special tokens too)
        are their decoded text."""
        piece = self._hf.convert_ids_to_tokens(token_id)
        if self._is_byte_level and piece and all(c in _BYTE_LEVEL_CHARS for c in piece):
            return bytes(_BYTE_LEVEL_CHARS[c] for c in piece)
        fallback = _BYTE_FALLBACK.fullmatch(piece or "")
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a conversation rendered with the checkpoint's chat template.

        Special-token text inside a message's content ("<|im_end|>"...) is encoded as
        plain text: only the template's own special tokens are special, so a message
        cannot forge role boundaries.
        """
        if not getattr(self._hf, "chat_template", None):
            raise InvalidRequestError("this model has no chat template", param="messages")
        rendered = self._render(messages, add_generation_prompt)
        with_special = [i for i, m in enumerate(messages) if self._has_special_content(m)]
        if not with_special:
            # The template already holds BOS where the model wants it.
            return self.encode(rendered, add_special_tokens=False)
        # Render again with those contents replaced by unique markers: the text around
        # the markers is the template's own. Putting the contents back must give the
        # first rendering, or the template changed them and their place is unknown.
        markers = {i: f"\ue000{uuid.uuid4().hex}\ue001" for i in with_special}
        marked = [
            {**m, "content": markers[i]} if i in markers else m for i, m in enumerate(messages)
        ]
        pieces, rest = [], self._render(marked, add_generation_prompt)
        for i in with_special:
            template_text, found, rest = rest.partition(markers[i])
            if not found:
                raise _content_not_verbatim()
            pieces.append((template_text, messages[i]["content"]))
        if "".join(t + c for t, c in pieces) + rest != rendered:
            raise _content_not_verbatim()
        ids: list[int] = []
        for template_text, content in pieces:
            ids += self.encode(template_text, add_special_tokens=False)
            ids += self._encode_as_plain_text(content)
        return ids + self.encode(rest, add_special_tokens=False)

    def _render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            return self._hf.apply_chat_template(
                list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as exc:  # jinja raises its own errors for malformed messages
            raise InvalidRequestError(f"cannot render messages: {exc}", param="messages") from exc

    def _has_special_content(self, message: dict[str, str]) -> bool:
        """Whether the content holds special-token text; such text in another field
        (role, name) is refused, since nothing tells where a template puts those."""
        if self._special_text is None:
            return False
        for key, value in message.items():
            if key != "content" and isinstance(value, str) and self._special_text.search(value):
                raise InvalidRequestError(
                    f"a message's {key} must not contain special-token text", param="messages"
                )
        content = message.get("content")
        return isinstance(content, str) and self._special_text.search(content) is not None

    def _encode_as_plain_text(self, text: str) -> list[int]:
        if self._rust_plain is not None:
            return _encode(self._rust_plain, text, False)
        return list(self._hf.encode(text, add_special_tokens=False, split_special_tokens=True))

    def detokenizer(self, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()):
        return IncrementalDetokenizer(self, prompt_token_ids, stop)


def _content_not_verbatim() -> InvalidRequestError:
    return InvalidRequestError(
        "a message contains special-token text and the chat template does not copy it "
        "verbatim, so it cannot be kept as plain text; remove the special-token text",
        param="messages",
    )


def _encode(rust: Any, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) < _GIL_FREE_MIN_CHARS:
        return rust.encode(text, add_special_tokens=add_special_tokens).ids
    return rust.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def _eos_token_ids(hf: Any, path: Path) -> frozenset[int]:
    ids: set[int] = set()
    if hf.eos_token_id is not None:
        ids.add(int(hf.eos_token_id))
    generation_config = path / "generation_config.json"
    if generation_config.is_file():
        try:
            eos = json.loads(generation_config.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError):
            eos = None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(t) for t in eos if isinstance(t, int))
    return frozenset(ids)


@dataclass
class TextDelta:
    text: str  # new text to send; joined deltas equal the final text
    stopped: bool  # a stop string matched: the request should finish with "stop"


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    A delta never ends inside a multi-byte character (the decoder's replacement char
    means "wait for more bytes"), and with stop strings the last max(len(stop)) - 1
    characters are held back until they cannot begin a stop string, so a stop string is
    never sent, even in part.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str]
    ) -> None:
        self._tokenizer = tokenizer
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._stop = tuple(stop)
        self._hold_chars = max((len(s) for s in self._stop), default=1) - 1
        # Decoded text not sent yet: what stop strings are searched in and deltas cut
        # from. Sent text is dropped (the caller has it), so each step costs the size of
        # its own text, not of the whole output.
        self._unsent = ""

    def add(self, token_ids: Sequence[int], *, is_last: bool, check_stop: bool = True) -> TextDelta:
        """Add newly generated ids; `is_last` flushes everything held back.

        With `check_stop` False (a request short of its min_tokens) a stop string this
        text completes is ordinary text; one that begins in it and is completed by a
        later, checked add still stops. The text is held back alike either way.
        """
        self._ids.extend(token_ids)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = decode(self._ids[self._prefix_offset :])
        # A trailing replacement char means "wait for more bytes", unless nothing more
        # comes: then the text is final as it is, so the deltas join to the decode of
        # every output id.
        is_complete = is_last or not full_text.endswith(_REPLACEMENT_CHAR)
        if len(full_text) > len(prefix_text) and is_complete:
            new_text = full_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            # A stop string may begin in the text held back (all of it is unsent).
            num_old_chars = len(self._unsent)
            self._unsent += new_text
            if self._stop and check_stop and self._cut_at_stop(num_old_chars):
                return TextDelta(self._flush(), True)
        if is_last:
            return TextDelta(self._flush(), False)
        sendable = len(self._unsent) - self._hold_chars
        if sendable <= 0:
            return TextDelta("", False)
        delta, self._unsent = self._unsent[:sendable], self._unsent[sendable:]
        return TextDelta(delta, False)

    def _cut_at_stop(self, num_old_chars: int) -> bool:
        """Cut the unsent text at the first stop string that ends in its new text (after
        `num_old_chars`): one that ended before was either found then or, before
        min_tokens, is ordinary text."""
        positions = [self._unsent.find(s, max(0, num_old_chars - len(s) + 1)) for s in self._stop]
        found = [p for p in positions if p >= 0]
        if not found:
            return False
        self._unsent = self._unsent[: min(found)]
        return True

    def _flush(self) -> str:
        delta, self._unsent = self._unsent, ""
        return delta
