"""Gemma's SentencePiece vocabulary (``tokenizer.ggml.model == "llama"`` in a gemma3 GGUF) against
Hugging Face transformers building its tokenizer from the same file
(``AutoTokenizer.from_pretrained(dir, gguf_file=name)``, the reference).

The fast tests write a tiny gemma3 GGUF (tokenizer metadata only) whose vocabulary exercises each
rule: control and user-defined tokens, tokens of only spaces, byte fallback, and merges ranked by
position in the file rather than by score. The ``slow`` ones use the real gemma-3-270m Q4_K_M file
(262,144 tokens), fetched once into the model cache (``meshserve fetch --model gemma-3-270m``).
Building the reference from the real file takes about 15 s, most of these tests' time.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest

from model.text.detokenizer import IncrementalDetokenizer
from model.text.tokenizer import Tokenizer
from model.weights.fetch import fetch_model

HF_REASON = "needs transformers (pip install -e '.[hf]')"
GEMMA_MODEL = "gemma-3-270m"

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Grüße aus München! Ça va? Où est la bibliothèque? Déjà vu, naïve café, Straße, Œuvre.",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "こんにちは世界。東京は日本の首都です。カタカナとひらがな。",
    "안녕하세요 세계. 한국어 텍스트입니다.",
    "مرحبا بالعالم. هذا نص عربي ٣٤٥.",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "emoji 🙂👍🏽🇩🇪 👨‍👩‍👧 and rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U000e0041 ᚠᛇᚻ",
    "  leading, trailing   ",
    "multiple     spaces   and\ttabs\t\t\tand\n\nnewlines\n\n\n\nend\r\n",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "#include <stdio.h>\nint main(void) {\n\tfor (int i = 0; i < 1024; ++i) { sum += a[i] * 3.14159f; }\n\treturn 0;\n}\n",
    '{"name": "gemma", "sizes": [270, 1000], "nested": {"ok": true, "pi": 3.14159}}',
    "digits 0 12 345 6789 1234567890 3.14 -42 1e-9 2024-01-01",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
    "<bos>text with <b>bold</b> and <table><tr><td>x</td></tr></table> [multimodal] <unused0>",
    "a",
    " ",
    "",
]


def _write_gguf(
    path: Path, tokens: list[str], types: list[int], scores: list[float], arch: str = "gemma3", template: str = ""
) -> Path:
    """A GGUF file with only tokenizer metadata, as a Gemma 3 file has it (no merges; a chat
    template if ``template``)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    if template:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


TINY_CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
TINY_USER = ["\n", "\n\n", "  ", "   ", "<b>", "\t"]
# "bc" has the best score but comes after "ab": the merges follow the position ("abc" is ab + c).
TINY_NORMAL = ["▁", "a", "b", "c", "h", "e", "l", "o", "é", "中", "文", "ab", "bc", "he", "ll", "llo", "hello"]
TINY_NORMAL += ["▁hello", "中文", "▁a"]
TINY_TEXTS = [
    "abc hello  ab\n\n<b>中文x文 é ü <start_of_turn>a<end_of_turn>",
    "  a  ",
    "\t\tabc\n\n\nhello   hello    ",
    "ü🙂 中 \U000e0041",
    "<bos>hello<eos>",
    "",
]


def tiny_gemma_gguf(path: Path, template: str = "") -> Path:
    """The tiny Gemma-style vocabulary: control tokens, user-defined ones (two of only spaces),
    the 256 byte tokens, then normal tokens whose scores disagree with their order."""
    tokens = [*TINY_CONTROL, *TINY_USER, *(f"<0x{b:02X}>" for b in range(256)), *TINY_NORMAL]
    types = [3] * len(TINY_CONTROL) + [4] * len(TINY_USER) + [6] * 256 + [1] * len(TINY_NORMAL)
    first = len(tokens) - len(TINY_NORMAL)
    scores = [-1000.0] * first + [(0.0 if t == "bc" else -100.0 - i) for i, t in enumerate(TINY_NORMAL)]
    return _write_gguf(path, tokens, types, scores, template=template)


# Gemma 3 instruct's template, shortened: it writes the BOS itself.
GEMMA_CHAT = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.mark.parametrize("template", [GEMMA_CHAT, GEMMA_CHAT.removeprefix("{{ bos_token }}")])
def test_a_chat_prompt_starts_with_one_bos(template: str, tmp_path: Path) -> None:
    """A file that asks for a BOS and a template that writes one: the served chat prompt holds it
    once (llama.cpp strips the rendered one, transformers adds none), where plain ``encode`` of
    the rendered text would hold two; a template without it still gets the file's one."""
    from service.server.validation import chat_prompt_ids

    tok = Tokenizer.from_gguf(tiny_gemma_gguf(tmp_path / "chat.gguf", template))
    ids = chat_prompt_ids([("user", "hello")], tok, "messages")
    assert ids[:2] == [2, 5] and ids.count(2) == 1  # <bos> <start_of_turn>
    rendered = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert tok.encode(rendered)[:2] == ([2, 2] if template == GEMMA_CHAT else [2, 5])


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[Path, Tokenizer]:
    path = tiny_gemma_gguf(tmp_path / "tiny-gemma.gguf")
    return path, Tokenizer.from_gguf(path)


def _stream(tok: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    """What :class:`IncrementalDetokenizer` emits pushing ``ids`` one at a time, and its flush."""
    detok = IncrementalDetokenizer(tok)
    return [detok.push(i) for i in ids], detok.flush()


def test_tiny_vocabulary_rules(tiny: tuple[Path, Tokenizer]) -> None:
    _, tok = tiny
    vocab = tok.backend.get_vocab()
    ab, c, bos = vocab["ab"], vocab["c"], 2
    assert tok.encode("abc") == [bos, ab, c]  # by position; by score it would be a + bc
    assert tok.backend.id_to_token(9) == "▁▁" and tok.encode("  a") == [bos, 9, vocab["a"]]  # "  " re-spelled
    assert tok.encode("\n\n<b>x") == [bos, 8, 11, 13 + ord("x")]  # user-defined tokens whole; x: a byte token
    assert tok.encode("ü") == [bos, 13 + 0xC3, 13 + 0xBC]  # byte fallback
    assert tok.encode("<start_of_turn>") == [bos, 5]
    assert (tok.bos_id, tok.eos_ids, tok.special_ids) == (2, frozenset({1, 6}), frozenset(range(7)))
    assert tok.vocab_size == 13 + 256 + len(TINY_NORMAL)
    assert tok.decode(tok.encode(TINY_TEXTS[0])) == TINY_TEXTS[0].replace("<start_of_turn>", "").replace(
        "<end_of_turn>", ""
    )
    assert tok.token_bytes(vocab["▁"]) == b" " and tok.token_bytes(vocab["▁hello"]) == b" hello"
    assert (
        tok.token_bytes(13 + 0xC3) == b"\xc3"
        and tok.token_bytes(9) == b"  "
        and tok.token_bytes(5) == (b"<start_of_turn>")
    )
    text = "ü🙂 中 hello"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids[1:]) == text.encode("utf-8")
    assert len(ids) >= tok.tokens_at_least(len(text.encode("utf-8")))
    pieces, rest = _stream(tok, ids)
    assert "".join(pieces) + rest == text and "\ufffd" not in "".join(pieces)
    assert "" in pieces[2:]  # a character's first byte token was held, not emitted as U+FFFD


def test_tiny_save_and_from_checkpoint_round_trip(tiny: tuple[Path, Tokenizer], tmp_path: Path) -> None:
    _, tok = tiny
    out = tmp_path / "ckpt"
    out.mkdir()
    tok.save(out)
    back = Tokenizer.from_checkpoint(out)
    for text in TINY_TEXTS:
        assert back.encode(text) == tok.encode(text), text
        assert back.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    assert (back.bos_id, back.eos_ids, back.special_ids, back.vocab_size) == (
        tok.bos_id,
        tok.eos_ids,
        tok.special_ids,
        tok.vocab_size,
    )
    assert [back.token_bytes(i) for i in range(tok.vocab_size)] == [tok.token_bytes(i) for i in range(tok.vocab_size)]


def test_tiny_ids_and_text_equal_transformers(tiny: tuple[Path, Tokenizer]) -> None:
    pytest.importorskip("transformers", reason=HF_REASON)
    from transformers import AutoTokenizer

    path, tok = tiny
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TINY_TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=True), text
        assert tok.backend.encode(text, add_special_tokens=False).ids == ref.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_llama_vocabulary_of_another_architecture_raises(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "llama.gguf", ["<unk>", "<s>", "</s>", "▁"], [2, 3, 3, 1], [0.0] * 4, arch="llama")
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model='llama' \(general\.architecture='llama'\).*gemma3"):
        Tokenizer.from_gguf(path)


# --- the real gemma-3-270m file ---------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_file() -> Path:
    return fetch_model(GEMMA_MODEL)  # downloaded once into the model cache


@pytest.fixture(scope="module")
def ours(gemma_file: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gemma_file)


@pytest.fixture(scope="module")
def ref(gemma_file: Path) -> Any:
    pytest.importorskip("transformers", reason=HF_REASON)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gemma_file.parent, gguf_file=gemma_file.name)


@pytest.mark.slow
def test_real_metadata(ours: Tokenizer) -> None:
    assert ours.vocab_size == 262144 and ours.backend.get_vocab_size(with_added_tokens=True) == 262144
    assert (ours.bos_id, ours.eos_ids) == (2, frozenset({1, 106}))  # <eos>, <end_of_turn>
    assert ours.encode("hi")[0] == 2  # add_bos_token
    assert {0, 1, 2, 3, 4, 105, 106} <= ours.special_ids and len(ours.special_ids) == 6249
    assert not {5, 107, 138} & ours.special_ids  # [multimodal], "\n", "  " are user-defined
    with pytest.raises(ValueError, match="no chat template"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.slow
def test_real_ids_equal_transformers(ours: Tokenizer, ref: Any) -> None:
    for text in [*CORPUS, "".join(CORPUS)]:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=True), text
        assert ours.backend.encode(text, add_special_tokens=False).ids == ref.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_real_decode_equals_transformers(ours: Tokenizer, ref: Any) -> None:
    for text in CORPUS:
        ids = ours.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
        if "<" not in text:  # no control token to drop: the text comes back
            assert ours.decode(ids) == text
    special = {i for i, t in ref.added_tokens_decoder.items() if t.special}
    rng = random.Random(0)
    differ = 0
    for _ in range(300):  # arbitrary ids, runs of byte tokens among them
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 10))]
        at = rng.randrange(len(ids) + 1)
        ids[at:at] = [238 + rng.randrange(256) for _ in range(rng.randrange(5))]
        for skip in (True, False):
            text, expected = ours.decode(ids, skip_special_tokens=skip), ref.decode(ids, skip_special_tokens=skip)
            if "\ufffd" in expected:
                # Invalid bytes: transformers' ByteFallback makes every byte token of the run a U+FFFD
                # (valid ones too); ours decodes the bytes, one U+FFFD per invalid sequence.
                assert text == _lossy_text(ref, [i for i in ids if not (skip and i in special)]), ids
                assert len(text) <= len(expected), ids
                differ += text != expected
            else:
                assert text == expected, ids
    assert differ > 0  # the case was exercised


def _lossy_text(ref: Any, ids: list[int]) -> str:
    """The reference's tokens of ``ids`` as bytes ("▁" a space, ``<0xAB>`` a byte), joined and
    decoded with one U+FFFD per invalid sequence."""
    raw = b""
    for token in ref.convert_ids_to_tokens(ids):
        byte = re.fullmatch(r"<0x([0-9A-F]{2})>", token)
        raw += bytes([int(byte[1], 16)]) if byte else token.replace("▁", " ").encode("utf-8")
    return raw.decode("utf-8", errors="replace")


@pytest.mark.slow
def test_real_token_bytes(ours: Tokenizer) -> None:
    vocab = ours.backend.get_vocab()
    assert ours.token_bytes(vocab["▁"]) == b" " and ours.token_bytes(vocab["▁▁▁"]) == b"   "
    assert [ours.token_bytes(238 + b) for b in range(256)] == [bytes([b]) for b in range(256)]
    assert ours.token_bytes(106) == b"<end_of_turn>" and ours.token_bytes(107) == b"\n"
    for text in CORPUS:
        ids = ours.encode(text)[1:]
        assert b"".join(ours.token_bytes(i) for i in ids) == text.encode("utf-8"), text
    assert ours.max_token_bytes == max(len(ours.token_bytes(i)) for i in range(ours.vocab_size))
    # The normalizer: a "▁" in the text (3 bytes) is counted as a space's 1 byte by token_bytes.
    for text in [*CORPUS, "▁" * 3000, " " * 3000, "…" * 3000, "\n" * 3000, "".join(CORPUS) * 20]:
        assert len(ours.encode(text)) >= ours.tokens_at_least(len(text.encode("utf-8"))), text[:20]


@pytest.mark.slow
def test_real_streaming_detokenizer(ours: Tokenizer) -> None:
    for text in CORPUS:
        ids = ours.encode(text)
        pieces, rest = _stream(ours, ids)
        assert "".join(pieces) + rest == ours.decode(ids), text
        assert "\ufffd" not in "".join(pieces) + rest, text
        if "<" not in text:
            assert "".join(pieces) == text and rest == "", text
    ids = ours.encode("𝔘")  # byte fallback: four byte tokens
    assert ids[1:] == [238 + b for b in "𝔘".encode()]
    assert _stream(ours, ids) == (["", "", "", "", "𝔘"], "")


@pytest.mark.slow
def test_real_save_and_from_checkpoint_round_trip(ours: Tokenizer, tmp_path: Path) -> None:
    ours.save(tmp_path)
    back = Tokenizer.from_checkpoint(tmp_path)
    for text in CORPUS:
        ids = ours.encode(text)
        assert back.encode(text) == ids, text
        assert back.decode(ids) == ours.decode(ids)
        assert [back.token_bytes(i) for i in ids] == [ours.token_bytes(i) for i in ids]
    assert (back.bos_id, back.eos_ids, back.special_ids, back.vocab_size) == (
        ours.bos_id,
        ours.eos_ids,
        ours.special_ids,
        ours.vocab_size,
    )
    assert back.max_token_bytes == ours.max_token_bytes


@pytest.mark.slow
def test_real_vocabulary_drives_a_grammar(ours: Tokenizer) -> None:
    """llguidance takes Gemma's SentencePiece vocabulary (▁ for spaces, byte fallback) as the
    constraint compiler builds it: a JSON schema's mask admits our own encoding of a valid answer
    (BOS dropped) id by id, ends it, and refuses an id that would break it."""
    import json

    import llguidance.numpy
    import numpy as np

    from service.server.grammars import Grammars
    from service.server.validation import GrammarSpec

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}}, "required": ["city", "n"], "additionalProperties": False}  # fmt: skip
    constraint = Grammars(ours, ours.vocab_size).compile(GrammarSpec("json_schema", json.dumps(schema), "t")).fresh()
    ids = ours.encode('{"city": "Zürich ☃", "n": 12}')[1:]
    mask = llguidance.numpy.allocate_token_bitmask(1, ours.vocab_size)
    for i, token in enumerate(ids):
        llguidance.numpy.fill_next_token_bitmask(constraint.matcher, mask, 0)
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")
        assert allowed[token], (i, token)
        if i == 0:
            assert not allowed[ours.encode("x")[-1]]  # a JSON object starts with {
        assert constraint.accept(token, i)
    assert constraint.complete
