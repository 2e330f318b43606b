"""model.weights.loader.load_model: one function for a GGUF file, a Hugging Face directory and a
checkpoint written by ``meshserve convert``, on tiny random models (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file
from tiny_gguf import write_tiny_llama_gguf

from model.config import LlamaConfig
from model.text.tokenizer import Tokenizer
from model.weights.gguf_weights import load_gguf_params
from model.weights.hf_weights import _expected_shapes, load_hf_llama
from model.weights.loader import load_model, load_tokenizer, model_format, num_tensors, read_model_config
from sharding.layouts import load_layout
from sharding.mesh import make_mesh
from sharding.plan import make_plan
from sharding.rules import param_shardings


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def checkpoint(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GGUF converted by the real CLI, stored as bfloat16."""
    from service.server.cli import main

    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    assert main(["convert", str(gguf_path), str(out), "--dtype", "bfloat16"]) == 0
    return out


@pytest.fixture(scope="module")
def hf_dir(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face directory: config.json, random float32 model.safetensors, the tiny tokenizer."""
    out = tmp_path_factory.mktemp("hf")
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
    (out / "config.json").write_text(json.dumps(hf))
    from model.weights.hf_weights import config_from_hf

    rng = np.random.default_rng(1)
    shapes = _expected_shapes(config_from_hf(hf))
    save_file({n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}, str(out / "model.safetensors"))
    Tokenizer.from_gguf(gguf_path).save(out)
    return out


def shardings_for(layout_name: str):  # type: ignore[no-untyped-def]
    layout = load_layout(layout_name)

    def shardings(cfg: LlamaConfig, state: nnx.State):  # type: ignore[no-untyped-def]
        return param_shardings(
            state, make_mesh(layout, jax.devices()[: layout.num_devices]), make_plan(layout, cfg).rules
        )

    return shardings


def leaves(state: nnx.State) -> dict[str, object]:
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in flat}


def test_model_format_tells_the_three_apart(gguf_path: Path, checkpoint: Path, hf_dir: Path, tmp_path: Path) -> None:
    assert [model_format(p) for p in (gguf_path, checkpoint, hf_dir)] == ["gguf", "checkpoint", "hf"]
    with pytest.raises(FileNotFoundError, match="model not found"):
        model_format(tmp_path / "absent.gguf")
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        model_format(tmp_path)


def test_gguf_on_the_host_with_its_tokenizer(gguf_path: Path) -> None:
    calls: list[str] = []
    m = load_model(gguf_path, tokenizer=True, progress=calls.append)
    cfg = LlamaConfig.from_gguf(gguf_path)
    assert (m.kind, m.dtype, m.cfg, m.path) == ("gguf", "float32", cfg, gguf_path)
    assert len(calls) == num_tensors(gguf_path) == 9 * cfg.num_layers + 2  # tied: no output.weight
    expected = jax.tree_util.tree_leaves(load_gguf_params(gguf_path, cfg))
    got = jax.tree_util.tree_leaves(nnx.to_pure_dict(m.state))
    assert len(got) == len(expected) and all(isinstance(a, np.ndarray) for a in got)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)
    assert m.tokenizer is not None
    assert m.tokenizer.encode("hello") == Tokenizer.from_gguf(gguf_path).encode("hello") != []
    assert load_model(gguf_path).tokenizer is None


def test_gguf_placed_into_shardings(gguf_path: Path) -> None:
    m = load_model(gguf_path, "bfloat16", shardings=shardings_for("1x2"))
    assert m.dtype == "bfloat16"
    host = leaves(load_model(gguf_path).state)
    for name, leaf in leaves(m.state).items():
        assert isinstance(leaf, jax.Array) and len(leaf.sharding.device_set) == 2, name
        assert leaf.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(host[name]).astype(ml_dtypes.bfloat16))


def test_checkpoint_restored_on_one_device_or_into_shardings(gguf_path: Path, checkpoint: Path) -> None:
    host = leaves(load_model(gguf_path).state)
    stored = load_model(checkpoint, tokenizer=True)
    assert (stored.kind, stored.dtype, stored.cfg) == ("checkpoint", "bfloat16", LlamaConfig.from_gguf(gguf_path))
    for name, leaf in leaves(stored.state).items():
        assert isinstance(leaf, jax.Array) and leaf.sharding.device_set == {jax.devices()[0]}, name
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(host[name]).astype(ml_dtypes.bfloat16))
    assert stored.tokenizer is not None and stored.tokenizer.encode("hello") == load_tokenizer(gguf_path).encode(
        "hello"
    )
    assert num_tensors(checkpoint) == 0

    wide = load_model(checkpoint, "float32", shardings=shardings_for("2x2"))
    assert wide.dtype == "float32"
    for name, leaf in leaves(wide.state).items():
        assert isinstance(leaf, jax.Array) and len(leaf.sharding.device_set) == 4, name
        assert leaf.dtype == np.float32
        np.testing.assert_array_equal(
            np.asarray(leaf), np.asarray(host[name]).astype(ml_dtypes.bfloat16).astype(np.float32)
        )


def test_hugging_face_directory(hf_dir: Path) -> None:
    m = load_model(hf_dir, tokenizer=True)
    cfg, params = load_hf_llama(hf_dir)
    assert (m.kind, m.dtype, m.cfg, read_model_config(hf_dir)) == ("hf", "float32", cfg, cfg)
    assert not cfg.tie_word_embeddings and num_tensors(hf_dir) == 9 * 2 + 3
    got, expected = leaves(m.state), leaves_of(params)
    assert got.keys() == expected.keys() and "['lm_head']" in got
    for name in got:
        np.testing.assert_array_equal(got[name], expected[name])
    assert m.tokenizer is not None and m.tokenizer.vocab_size > 256


def leaves_of(params: dict) -> dict[str, object]:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in flat}


def test_errors_name_the_problem(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(tmp_path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError):
        load_model(bad)
