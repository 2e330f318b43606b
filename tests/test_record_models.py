"""A model whose GGUF mixes the record formats as llama.cpp's Q4_K_M files do (Q4_K, Q5_K,
Q6_K and Q5_0 tensors, attn_v and ffn_down changing type from layer to layer), loaded with its
blocks as stored: each parameter is held in the one format that holds its tensors exactly, the
engine's logits equal the dequantized model's, a checkpoint keeps the records bit for bit, and a
truncated tensor is a load error naming it; placed on meshes, the records serve one device's ids."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from flax import nnx
from test_block_checkpoints import same
from test_qwen2_gguf import step_logits
from tiny_gguf import write_tiny_llama_gguf

from model import native
from model.config import LlamaConfig
from model.weights.checkpoint import read_checkpoint_config, save_checkpoint
from model.weights.gguf_file import open_gguf
from model.weights.gguf_weights import WeightError, load_gguf_params, stored_matmuls
from model.weights.loader import load_model
from model.weights.quant_panels import QuantPanels
from service.engine.runner import Runner
from sharding.layouts import Layout

TYPES = {
    "attn_q.weight": "Q4_K",
    "attn_k.weight": "Q4_K",
    "blk.0.attn_v.weight": "Q6_K",
    "blk.1.attn_v.weight": "Q4_K",
    "blk.2.attn_v.weight": "Q5_K",
    "attn_output.weight": "Q4_K",
    "ffn_gate.weight": "Q5_0",
    "ffn_up.weight": "Q5_0",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.ffn_down.weight": "Q4_K",
    "blk.2.ffn_down.weight": "Q4_K",
}
HELD = {"wqkv": "q6_k", "wo": "q4_k", "w_gate_up": "q5_0", "w_down": "q6_k"}


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("records") / "mixed.gguf"
    return write_tiny_llama_gguf(path, hidden_size=256, intermediate_size=512, num_layers=3, quantize=TYPES)


def test_each_parameter_is_held_in_the_format_that_holds_its_mix(mixed_file: Path) -> None:
    loaded = load_model(mixed_file, stored=True)
    assert stored_matmuls(open_gguf(mixed_file), loaded.cfg) == HELD
    layers = nnx.to_pure_dict(loaded.state)["layers"]
    assert {name: layers[name].format for name in HELD} == HELD
    assert all(isinstance(layers[name], QuantPanels) and layers[name].scales is None for name in HELD)


@pytest.mark.skipif(not native.available(), reason="the native kernels are not built here")
def test_the_engine_on_records_gives_the_dequantized_models_logits(mixed_file: Path) -> None:
    stored, floats = load_model(mixed_file, stored=True), load_model(mixed_file)
    prompt, then = list(range(3, 40)), [7, 9, 11]
    got = step_logits(stored, prompt, then, chunk=16)
    want = step_logits(floats, prompt, then, chunk=16)
    assert np.abs(want).max() > 0.5  # not a model of zeros
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_a_checkpoint_keeps_the_records_bit_for_bit(mixed_file: Path, tmp_path: Path) -> None:
    held = load_model(mixed_file, stored=True, tokenizer=True)
    params = nnx.to_pure_dict(held.state)
    assert held.tokenizer is not None
    out = save_checkpoint(tmp_path / "ck", held.cfg, params, held.tokenizer, source=str(mixed_file))
    _, meta = read_checkpoint_config(out)
    assert meta["blocks"] == {f"layers/{name}": fmt for name, fmt in HELD.items()}
    restored = nnx.to_pure_dict(load_model(out, stored=True).state)
    assert same(restored, params)
    floats = jax.tree.map(np.asarray, nnx.to_pure_dict(load_model(out).state))
    assert same(floats, nnx.to_pure_dict(load_model(mixed_file).state))  # the values, dequantized


@pytest.mark.parametrize("name", ["blk.1.attn_v.weight", "blk.2.ffn_gate.weight"])  # Q4_K in a mix; Q5_0
def test_a_truncated_record_tensor_is_a_load_error_naming_it(mixed_file: Path, name: str) -> None:
    reader = gguf.GGUFReader(str(mixed_file))
    cfg = LlamaConfig.from_gguf(mixed_file)
    i = next(i for i, t in enumerate(reader.tensors) if t.name == name)
    reader.tensors[i] = reader.tensors[i]._replace(data=reader.tensors[i].data.reshape(-1)[:-5])  # cut short
    with pytest.raises(WeightError, match=re.escape(name)):
        load_gguf_params(reader, cfg, stored=True)


def test_records_on_every_mesh_give_one_devices_ids(mixed_file: Path) -> None:
    """Records placed in a layout's shardings (panels over the model axis, or replicated where
    the units do not divide) serve one device's greedy ids through XLA's dequantization."""
    from test_block_checkpoints import ECFG
    from test_stored_weights import greedy

    from sharding.mesh import make_mesh
    from sharding.plan import make_plan
    from sharding.rules import param_shardings

    one = load_model(mixed_file, stored=True)
    want = greedy(Runner(one.cfg, one.graphdef, one.state, Layout("1x1"), ECFG))
    for layout in (Layout("1x2", data=1, model=2), Layout("2x4", data=2, model=4)):
        devices = jax.devices()[: layout.num_devices]

        def shardings(cfg: LlamaConfig, state: nnx.State, layout: Layout = layout, devices: list = devices) -> object:
            return param_shardings(state, make_mesh(layout, devices), make_plan(layout, cfg, ECFG.num_slots).rules)

        placed = load_model(mixed_file, shardings=shardings, stored=True)
        w_down = placed.state["layers"]["w_down"].get_value()
        assert isinstance(w_down, QuantPanels) and w_down.format == "q6_k"
        assert len(w_down.codes.sharding.device_set) == layout.num_devices
        runner = Runner(placed.cfg, placed.graphdef, placed.state, layout, ECFG, devices)
        assert greedy(runner) == want, layout.name
