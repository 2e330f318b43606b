"""Streaming detokenization: pieces joined must equal ``Tokenizer.decode`` and never split a character."""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path

import pytest

from model.text.detokenizer import IncrementalDetokenizer
from model.text.tokenizer import Tokenizer, bytes_to_unicode

CASES = json.loads((Path(__file__).parent / "fixtures" / "tokenizer_cases.json").read_text(encoding="utf-8"))
FFFD = "\ufffd"

pytestmark = pytest.mark.slow  # every test decodes with the real SmolLM2 tokenizer


@cache
def _load(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(path)


@pytest.fixture
def tok(smollm2_gguf: Path) -> Tokenizer:
    return _load(smollm2_gguf)


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return pieces


def test_c01_split_characters_are_held_back(tok: Tokenizer) -> None:
    assert len(tok.encode("🙂")) > 1  # precondition: one character spans several tokens
    ids = tok.encode("🙂👍🏽你好")
    pieces = _stream(tok, ids)
    assert "".join(pieces) == "🙂👍🏽你好"
    assert not any(FFFD in p for p in pieces)
    assert any(p == "" for p in pieces[:-1])  # some piece was held back


@pytest.mark.parametrize("case", CASES["encode"], ids=lambda c: ascii(c["text"])[:40])
def test_stream_round_trip_fixture_strings(tok: Tokenizer, case: dict) -> None:
    pieces = _stream(tok, case["ids"])
    assert "".join(pieces) == tok.decode(case["ids"]) == case["decode"]
    if FFFD not in case["text"]:
        assert not any(FFFD in p for p in pieces)


@pytest.mark.parametrize("case", CASES["decode"], ids=lambda c: str(c["ids"])[:40])
def test_stream_round_trip_arbitrary_ids(tok: Tokenizer, case: dict) -> None:
    assert "".join(_stream(tok, case["ids"])) == case["decode"]


def test_special_tokens_give_no_text(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in (2, 1, 0, 2)] == ["", "", "", ""]
    assert detok.flush() == ""
    ids = tok.encode("<|im_start|>assistant\nThe capital<|im_end|>")
    pieces = _stream(tok, ids)
    assert "".join(pieces) == "assistant\nThe capital"
    assert pieces[0] == "" and pieces[-2] == ""  # <|im_start|> and <|im_end|>


def test_special_token_inside_a_split_character(tok: Tokenizer) -> None:
    ids = tok.encode("🙂")
    ids = [*ids[:1], 2, *ids[1:]]  # decode(skip_special_tokens=True) joins the bytes around it
    assert "".join(_stream(tok, ids)) == tok.decode(ids) == "🙂"


def _byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """One single-byte token per byte (every byte-level vocabulary has all 256)."""
    vocab, spelling = tok.backend.get_vocab(), bytes_to_unicode()
    return [vocab[spelling[b]] for b in data]


def test_invalid_bytes_are_released_not_held_forever(tok: Tokenizer) -> None:
    data = b"\x80" * 20 + "🙂".encode() + b"\xe4" + b"ok"
    ids = _byte_ids(tok, data)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces[:20]).count(FFFD) >= 16  # lone continuation bytes come out as they are known bad
    assert len(detok._ids) < 8  # the window stays short
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids) == FFFD * 20 + "🙂" + FFFD + "ok"
    assert "🙂" in pieces  # emitted whole


def test_byte_at_a_time_multilingual(tok: Tokenizer) -> None:
    text = "naïve 你好 👨‍👩‍👧‍👦 Привет"
    ids = _byte_ids(tok, text.encode())
    pieces = _stream(tok, ids)
    assert "".join(pieces) == text
    assert not any(FFFD in p for p in pieces)


def test_random_ids_round_trip(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        assert "".join(_stream(tok, ids)) == tok.decode(ids)


def test_window_stays_bounded_on_long_text(tok: Tokenizer) -> None:
    ids = tok.encode("你好，世界！🙂 hello there. " * 100)
    detok = IncrementalDetokenizer(tok)
    longest = 0
    out = []
    for i in ids:
        out.append(detok.push(i))
        longest = max(longest, len(detok._ids))
    out.append(detok.flush())
    assert "".join(out) == tok.decode(ids)
    assert longest <= 8
