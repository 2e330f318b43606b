"""``model.weights.build.random_block_llama``: a random model with its matmul weights as blocks (the GPU
check's int8 sweep at Llama 3 8B's shapes), laid out as ``block_params.quantize_params`` lays out
a float model's, with weights of about ``random_llama``'s spread; and ``meshserve sweep
--weights int8`` times it."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from benchmarks.sweep import model_to_time
from model.config import LlamaConfig
from model.weights import block_params, quant_panels
from model.weights.build import random_block_llama, random_llama
from model.weights.quant_panels import QuantPanels


def shapes(tree: dict) -> dict:  # type: ignore[type-arg]
    return jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), tree)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_the_blocks_are_laid_out_as_quantize_params_lays_them_out(fmt: str) -> None:
    cfg = LlamaConfig.tiny()
    _, state = random_block_llama(cfg, seed=1, fmt=fmt)
    got = nnx.to_pure_dict(state)
    _, floats = random_llama(cfg, seed=1)
    want = block_params.quantize_params(jax.tree.map(np.asarray, nnx.to_pure_dict(floats)))  # Q8_0
    assert block_params.block_formats(got) == {k: fmt for k in block_params.block_formats(want)}
    if fmt == "q8_0":
        assert shapes(got) == shapes(want)
    w = got["layers"]["wqkv"]
    assert isinstance(w, QuantPanels) and w.format == fmt
    values = np.asarray(quant_panels.dequantize(w))
    assert 0.015 < values.std() < 0.025 and abs(values.mean()) < 0.002  # about random_llama's normal(0, 0.02)
    assert np.all(np.asarray(got["layers"]["attn_norm"]) == 1.0)


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown block format"):
        random_block_llama(LlamaConfig.tiny(), fmt="q2_k")


def test_the_sweep_times_int8_blocks() -> None:
    cfg, _, params, source = model_to_time(None, None, random=False, tiny=True, weights="int8")
    assert "int8 (Q8_0) blocks" in source
    assert set(block_params.block_formats(nnx.to_pure_dict(params)).values()) == {"q8_0"}
    assert cfg == LlamaConfig.tiny()
