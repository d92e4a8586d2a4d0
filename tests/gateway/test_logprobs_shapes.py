"""The logprobs objects of both endpoints, from real token ids of the built-in tokenizer."""

from __future__ import annotations

import pytest

from engine.request import TokenLogprob
from engine.tokenizer import Tokenizer
from gateway.openai.logprobs import LogprobsWriter, TokenTexts


@pytest.fixture(scope="module")
def texts() -> TokenTexts:
    return TokenTexts(Tokenizer("tiny-random"))


def test_a_token_holding_part_of_a_character_keeps_its_bytes(texts: TokenTexts) -> None:
    tokenizer = Tokenizer("tiny-random")
    ids = tokenizer.encode("日本", add_special_tokens=False)
    assert len(ids) > 1  # split inside a character by byte-level BPE
    pieces = [texts(i) for i in ids]
    assert b"".join(raw for _, raw in pieces).decode() == "日本"
    assert all(text.startswith("bytes:\\x") for text, _ in pieces)
    chat = LogprobsWriter(texts, chat=True).body([TokenLogprob(i, -1.0) for i in ids])
    joined = bytes(b for entry in chat["content"] for b in entry["bytes"])
    assert joined.decode() == "日本"


def test_text_offsets_follow_the_text_sent(texts: TokenTexts) -> None:
    tokenizer = Tokenizer("tiny-random")
    first, second = tokenizer.encode("日", add_special_tokens=False)[:2]
    hello = tokenizer.encode("hello", add_special_tokens=False)[-1]
    # A special token releases no text; a piece of a character releases none until the
    # character is whole.
    steps = [
        TokenLogprob(hello, -0.5, num_text_chars=5),
        TokenLogprob(0, -2.0, num_text_chars=0),  # <|begin_of_text|>
        TokenLogprob(first, -1.0, num_text_chars=0),
        TokenLogprob(second, -1.5, num_text_chars=1),
        TokenLogprob(hello, -0.7, num_text_chars=5),
    ]
    writer = LogprobsWriter(texts, chat=False)
    head, tail = writer.body(steps[:3]), writer.body(steps[3:])  # as two stream chunks
    assert head["text_offset"] + tail["text_offset"] == [0, 5, 5, 5, 6]
    assert head["tokens"][:2] == ["hello", "<|begin_of_text|>"]


def test_top_logprobs_keep_the_likelier_of_two_tokens_sharing_a_text(texts) -> None:
    special = 0  # <|begin_of_text|>
    assert texts(special)[0] == "<|begin_of_text|>"
    # Listed twice (as two ids sharing a text would be): the likelier value keeps the key.
    top = ((special, -0.1), (7, -0.2), (special, -3.0))
    body = LogprobsWriter(texts, chat=False).body([TokenLogprob(special, -0.1, top)])
    assert body["top_logprobs"][0] == {"<|begin_of_text|>": -0.1, texts(7)[0]: -0.2}


def test_top_logprobs_hold_the_token_itself(texts) -> None:
    # OpenAI's legacy completions and vLLM: up to logprobs + 1 entries, the token's own
    # among them; with logprobs 0, only the token's.
    sampled, likelier = 9, 7
    writer = LogprobsWriter(texts, chat=False)
    body = writer.body(
        [
            TokenLogprob(sampled, -2.5, ((likelier, -0.3),)),
            TokenLogprob(likelier, -0.3, ((likelier, -0.3),)),
            TokenLogprob(sampled, -2.5),  # logprobs: 0
        ]
    )
    assert body["top_logprobs"] == [
        {texts(likelier)[0]: -0.3, texts(sampled)[0]: -2.5},
        {texts(likelier)[0]: -0.3},
        {texts(sampled)[0]: -2.5},
    ]
    # Chat lists top_logprobs as asked, the token apart (as OpenAI does).
    chat = LogprobsWriter(texts, chat=True).body([TokenLogprob(sampled, -2.5, ((likelier, -0.3),))])
    assert [e["token"] for e in chat["content"][0]["top_logprobs"]] == [texts(likelier)[0]]
