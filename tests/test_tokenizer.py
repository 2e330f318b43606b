"""Our GGUF tokenizer against the references in ``tests/fixtures/tokenizer_cases.json``.

The fixture is made by ``scripts/make_golden.py`` with llama.cpp (``llama-cpp-python``, vocabulary
only) and transformers reading the same GGUF file. Token ids must equal llama.cpp's, which applies
the file's ``smollm`` pre-tokenizer (every digit split off first) as the model was trained.
transformers ignores that pre-tokenizer, so its ids may differ on text with digits and nowhere else;
decoding and chat templates are checked against transformers.
"""

from __future__ import annotations

import json
import time
import unicodedata
from functools import cache
from pathlib import Path

import pytest

from model.text.tokenizer import Tokenizer

CASES = json.loads((Path(__file__).parent / "fixtures" / "tokenizer_cases.json").read_text(encoding="utf-8"))


@cache
def _load(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(path)


@pytest.fixture
def tok(smollm2_gguf: Path) -> Tokenizer:
    return _load(smollm2_gguf)


def _id(case: dict) -> str:
    return ascii(case["text"])[:40]


def _has_numeral(text: str) -> bool:
    """Whether ``text`` has a ``\\p{N}`` character (what the ``smollm`` pre-tokenizer splits off)."""
    return any(unicodedata.category(c).startswith("N") for c in text)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES["encode"], ids=_id)
def test_encode_matches_llama_cpp(tok: Tokenizer, case: dict) -> None:
    assert tok.encode(case["text"]) == case["llama_cpp_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES["encode"], ids=_id)
def test_encode_matches_transformers_except_digit_split(tok: Tokenizer, case: dict) -> None:
    if case["ids"] == case["llama_cpp_ids"]:
        assert tok.encode(case["text"]) == case["ids"]
    else:
        # The only tolerated difference: transformers does not split digits off first ('smollm').
        assert _has_numeral(case["text"]), f"transformers {case['ids']} != llama.cpp {case['llama_cpp_ids']}"


@pytest.mark.slow
def test_digit_split_differs_from_transformers(tok: Tokenizer) -> None:
    # "x  1": llama.cpp and the original SmolLM2 tokenizer give [x, ĠĠ, 1]; transformers [x, Ġ, Ġ, 1].
    case = next(c for c in CASES["encode"] if c["text"] == "x  1")
    assert case["llama_cpp_ids"] == tok.encode("x  1") == [104, 256, 33]
    assert case["ids"] == [104, 216, 216, 33]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES["encode"], ids=_id)
def test_decode_matches_reference(tok: Tokenizer, case: dict) -> None:
    assert tok.decode(case["ids"]) == case["decode"]
    assert tok.decode(case["ids"], skip_special_tokens=False) == case["decode_keep_special"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES["decode"], ids=lambda c: str(c["ids"])[:40])
def test_decode_of_arbitrary_ids_matches_reference(tok: Tokenizer, case: dict) -> None:
    assert tok.decode(case["ids"]) == case["decode"]
    assert tok.decode(case["ids"], skip_special_tokens=False) == case["decode_keep_special"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", CASES["chat"], ids=lambda c: f"{len(c['messages'])}msg-agp{c['add_generation_prompt']}"
)
def test_chat_template_matches_reference(tok: Tokenizer, case: dict) -> None:
    rendered = tok.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert rendered == case["rendered"]


def test_fixture_has_enough_cases() -> None:
    assert len(CASES["encode"]) >= 30
    assert sum(_has_numeral(c["text"]) for c in CASES["encode"]) >= 10
    assert all("llama_cpp_ids" in c for c in CASES["encode"])
    assert {"transformers", "torch", "tokenizers", "llama_cpp_python"} <= CASES["meta"].keys()


@pytest.mark.slow
def test_special_ids_and_metadata(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_id == 1
    assert tok.eos_ids == frozenset({2})
    assert {0, 1, 2} <= tok.special_ids
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1  # control token matched whole
    assert tok.encode("hi")[0] != tok.bos_id  # add_bos_token is False in this file
    assert tok.decode([1, 2, 0]) == ""


@pytest.mark.slow
def test_chat_prompt_ids(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.encode(text).count(1) == 3  # system, user, assistant turns


def _tiny_gguf(path: Path, model: str = "gpt2", pre: str = "smollm", template: str | None = None) -> Path:
    """Write a GGUF file with only tokenizer metadata: a 4-token byte-level vocabulary."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["<|end|>", "h", "i", "hi"])
    writer.add_token_types([3, 1, 1, 1])
    writer.add_token_merges(["h i"])
    writer.add_eos_token_id(0)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_gguf_tokenizer(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(_tiny_gguf(tmp_path / "t.gguf", template="{{ eos_token }}{{ messages[0].content }}"))
    assert tok.encode("hih<|end|>") == [3, 1, 0]
    assert tok.decode([3, 1, 0]) == "hih"
    assert tok.eos_ids == frozenset({0}) and tok.bos_id is None
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|end|>x"


def test_raise_exception_helper(tmp_path: Path) -> None:
    import jinja2

    tok = Tokenizer.from_gguf(
        _tiny_gguf(tmp_path / "t.gguf", template="{{ raise_exception('no ' + messages[0].role) }}")
    )
    with pytest.raises(jinja2.TemplateError, match="no user"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_chat_template_raises(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(_tiny_gguf(tmp_path / "t.gguf"))
    with pytest.raises(ValueError, match="chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_unsupported_tokenizer_model_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model='llama'"):
        Tokenizer.from_gguf(_tiny_gguf(tmp_path / "t.gguf", model="llama"))


def test_unsupported_pre_tokenizer_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.pre='falcon'"):
        Tokenizer.from_gguf(_tiny_gguf(tmp_path / "t.gguf", pre="falcon"))


@pytest.mark.slow
@pytest.mark.parametrize("i", [0, 1, 2])
def test_golden_prompts_encode_like_reference(tok: Tokenizer, i: int) -> None:
    import numpy as np

    golden = np.load(Path(__file__).parent / "fixtures" / "golden_logits.npz")
    assert tok.encode(str(golden[f"prompt_text_{i}"])) == golden[f"prompt_ids_{i}"].tolist()
    if i == 1:
        france = [{"role": "user", "content": "What is the capital of France?"}]
        assert tok.apply_chat_template(france) == str(golden["prompt_text_1"])


def test_token_bytes_join_to_the_text_even_inside_a_character(tiny_tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "héllo wörld 你好 🙂"
    ids = tiny_tokenizer.encode(text)
    parts = [tiny_tokenizer.token_bytes(i) for i in ids]
    assert b"".join(parts) == text.encode("utf-8")
    assert any(not _is_utf8(p) for p in parts)  # some token holds part of a character
    assert tiny_tokenizer.token_bytes(1) == b"<|im_start|>"  # a control token: its own text
    with pytest.raises(ValueError):
        tiny_tokenizer.token_bytes(tiny_tokenizer.vocab_size)


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.slow
def test_encoding_a_long_text_lets_other_threads_run(tok: Tokenizer) -> None:
    """The server tokenizes on a worker thread; that keeps its event loop running only if
    ``encode`` lets go of the GIL (``tokenizers``' ``encode`` holds it for the whole text: 50-200
    ms for 160 KB here, a stall of every stream). While a thread tokenizes three times, this one
    wakes from 1 ms sleeps: hundreds of times when the GIL is free, once per encode when not."""
    import threading

    text = "The capital of France is Paris. " * 5000  # 160 KB: about what the pre-tokenization bound lets through
    results: list[list[int]] = []
    worker = threading.Thread(target=lambda: results.extend(tok.encode(text) for _ in range(3)))
    wakes = 0
    worker.start()
    while worker.is_alive():
        time.sleep(0.001)
        wakes += 1
    worker.join()
    assert results[0] == tok._backend.encode(text, add_special_tokens=False).ids  # the same ids as encode
    assert wakes > 30, wakes
