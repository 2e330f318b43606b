"""GGUF reading: hyperparameters from metadata, the RoPE row permutation, clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from model.config import LlamaConfig
from model.weights.gguf_file import GGUFMetadataError, field_value, open_gguf
from model.weights.gguf_weights import unpermute_rope_rows


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The permutation llama.cpp's convert_hf_to_gguf.py applies to HF Q/K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(n_head: int) -> None:
    w = np.random.default_rng(n_head).normal(size=(n_head * 64, 40)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(w, n_head), n_head), w)


@pytest.mark.slow
def test_config_comes_from_metadata(smollm2_gguf: Path) -> None:
    reader = open_gguf(smollm2_gguf)
    cfg = LlamaConfig.from_gguf(reader)
    assert cfg.num_layers == field_value(reader, "llama.block_count") == 30
    assert cfg.num_heads == field_value(reader, "llama.attention.head_count") == 9
    assert cfg.num_kv_heads == field_value(reader, "llama.attention.head_count_kv") == 3
    assert cfg.hidden_size == 576 and cfg.intermediate_size == 1536 and cfg.head_dim == 64
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert cfg.rope_theta == 100000.0
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.max_position_embeddings == 8192
    assert cfg.param_count() == pytest.approx(134.5e6, rel=0.01)


def test_not_a_gguf_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFMetadataError, match="not a readable GGUF"):
        open_gguf(bad)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        open_gguf(tmp_path / "missing.gguf")
