"""Tokenizer: round trips, chat template, eos ids, incremental deltas and stop strings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine.errors import ModelLoadError
from engine.tokenizer import Tokenizer

TEXT = "Café naïve 日本語 🙂🚀 the gateway, résumé; Straße."
# Characters the tokenizer never merged: each is split over several byte tokens.
RARE_TEXT = "✓ Ωmega жук 한국어 🎉"
ASSETS = Path(engine.__file__).resolve().parent / "assets"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer("tiny-random")


def _stream(tokenizer: Tokenizer, ids: list[int], stop: tuple[str, ...] = ()):
    detokenizer = tokenizer.detokenizer([0, 2], stop)
    deltas, stopped = [], False
    for i, token in enumerate(ids):
        delta = detokenizer.add([token], is_last=i == len(ids) - 1)
        deltas.append(delta.text)
        if delta.stopped:
            stopped = True
            break
    return deltas, stopped


def test_encode_decode_round_trip(tokenizer: Tokenizer) -> None:
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT
    assert tokenizer.vocab_size == 902


def test_chat_template_renders_roles_and_generation_prompt(tokenizer: Tokenizer) -> None:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    rendered = tokenizer.decode(ids, skip_special_tokens=False)
    assert rendered == "<|begin_of_text|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_eos_ids_include_generation_config(tmp_path: Path) -> None:
    tiny = Tokenizer("tiny-random")
    assert tiny.eos_token_ids == {3}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((ASSETS / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    assert Tokenizer(tmp_path).eos_token_ids == {1, 3}


def test_missing_tokenizer_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError):
        Tokenizer(tmp_path)


def test_deltas_join_to_the_full_text_without_broken_characters(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(RARE_TEXT)
    deltas, stopped = _stream(tokenizer, ids)
    assert not stopped
    assert "".join(deltas) == RARE_TEXT
    # Multi-byte characters span several byte-level tokens; no delta shows half of one.
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0


def test_stop_string_is_excluded_and_never_sent(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("the gateway says STOP and more text")
    deltas, stopped = _stream(tokenizer, ids, stop=("STOP",))
    assert stopped
    assert "".join(deltas) == "the gateway says "
    assert not any("S" in d for d in deltas)  # not even the start of the stop string


def test_stop_string_inside_one_token(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("queue fair share")
    deltas, stopped = _stream(tokenizer, ids, stop=("ai",))
    assert stopped
    assert "".join(deltas) == "queue f"


def test_text_that_only_looks_like_a_stop_prefix_is_released(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a STO then STOP")
    deltas, stopped = _stream(tokenizer, ids, stop=("STOP",))
    assert stopped
    assert "".join(deltas) == "a STO then "


WORDS = ["the", " gate", "way", " STOP", " ST", "OP", " é", "日本", "🙂", " a", "\n", "ai"]


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(WORDS), min_size=1, max_size=40),
    stops=st.lists(st.sampled_from(["STOP", "ai", "way ", "本🙂", "\n a"]), max_size=2),
)
def test_streamed_text_is_the_whole_text_cut_at_the_first_stop(
    tokenizer: Tokenizer, pieces: list[str], stops: list[str]
) -> None:
    """Against a reference that sees the whole text at once: the deltas join to the
    text up to the earliest stop string (all of it without one), and no delta sent
    before the stop shows any of the stop string."""
    text = "".join(pieces)
    ids = tokenizer.encode(text)
    deltas, stopped = _stream(tokenizer, ids, tuple(stops))
    full = tokenizer.decode(ids)
    found = [i for i in (full.find(s) for s in stops) if i >= 0]
    assert stopped == bool(found)
    assert "".join(deltas) == (full[: min(found)] if found else full)
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("clean_up_spaces", [False, True])
def test_direct_rust_calls_match_the_transformers_wrapper(
    tmp_path: Path, clean_up_spaces: bool
) -> None:
    """Encode and decode skip transformers' wrapper; they must give what it gives."""
    for asset in ASSETS.iterdir():
        if asset.is_file():
            (tmp_path / asset.name).write_bytes(asset.read_bytes())
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["clean_up_tokenization_spaces"] = clean_up_spaces
    config_path.write_text(json.dumps(config))
    tokenizer = Tokenizer(tmp_path)
    hf = tokenizer._hf
    texts = [TEXT, RARE_TEXT, "", " a , b . c ! don 't", "x" * 300, "<s> inside </s> text"]
    for text in texts:
        ids = tokenizer.encode(text)
        assert ids == list(hf.encode(text)), text
        assert tokenizer.encode(text, add_special_tokens=False) == list(
            hf.encode(text, add_special_tokens=False)
        )
        with_specials = [*hf.all_special_ids, *ids]
        for skip in (True, False):
            assert tokenizer.decode(with_specials, skip_special_tokens=skip) == hf.decode(
                with_specials, skip_special_tokens=skip
            ), (text, skip)
