"""benchmarks/hf_export.py: the float32 Hugging Face directory made for vLLM holds the GGUF's
model: the same hyperparameters, every weight equal to our dequantization of the file's blocks,
the same token ids. So vLLM, served on it, runs the model meshserve serves.

Needs ``torch``, ``transformers`` and ``accelerate`` (the ``hf`` extra); without them skipped,
saying so.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from benchmarks.hf_export import export_hf_dir
from model.weights.loader import load_model

HF_REASON = "needs torch, transformers and accelerate (pip install -e '.[hf]')"


@pytest.mark.slow
def test_the_export_holds_the_ggufs_config_weights_and_tokenizer(smollm2_gguf: Path, tmp_path: Path) -> None:
    for module in ("torch", "transformers", "accelerate"):
        pytest.importorskip(module, reason=HF_REASON)
    out = export_hf_dir(smollm2_gguf, tmp_path / "hf")
    ours = load_model(smollm2_gguf, tokenizer=True)
    theirs = load_model(out, tokenizer=True)
    assert theirs.kind == "hf" and theirs.dtype == "float32"
    assert theirs.cfg == ours.cfg
    a, b = jax.tree.leaves(ours.state), jax.tree.leaves(theirs.state)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    text = "The quick brown fox, 3.14159 and 你好: <|im_start|>user\nhi<|im_end|>"
    assert theirs.tokenizer is not None and ours.tokenizer is not None
    assert theirs.tokenizer.encode(text) == ours.tokenizer.encode(text)
    # A whole directory is reused, not written again.
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert export_hf_dir(smollm2_gguf, out) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
