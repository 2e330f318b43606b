"""Converted checkpoints: GGUF -> ``meshserve convert`` -> restore into a layout serves the same
logits as the GGUF path, and a damaged checkpoint fails with an error that names the damage.

Runs on the 8 CPU devices conftest.py asks for. Float32 throughout, so "the same" is exact.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from test_golden import served

from model.config import LlamaConfig
from model.native import cpu_matmul
from model.text.tokenizer import Tokenizer
from model.weights.checkpoint import CheckpointError, read_checkpoint_config, restore_checkpoint, save_checkpoint
from model.weights.loader import abstract_llama, model_format, random_llama
from service.engine.config import EngineConfig
from service.engine.runner import Runner
from service.server.config import ServerConfig
from service.server.gateway import Gateway
from service.server.startup import load
from sharding.layouts import load_layout
from sharding.mesh import make_mesh
from sharding.plan import make_plan
from sharding.rules import param_shardings

pytestmark = pytest.mark.slow  # every test converts or reads the real SmolLM2 model

ECFG = EngineConfig(num_slots=2, max_seq_len=64, chunk_size=16)
PROMPT = [1, 4093, 198, 504, 3575, 282, 4649, 314]  # "<|im_start|>user\nThe capital of France is"


@pytest.fixture(scope="module")
def converted(smollm2_checkpoint: Path) -> Path:
    """The default model converted with the real CLI (float32; conftest, once per session)."""
    return smollm2_checkpoint


@pytest.fixture(scope="module")
def gguf_model(smollm2_model):  # type: ignore[no-untyped-def]
    """The GGUF path's (config, graphdef, host state), read once per session (conftest)."""
    return smollm2_model


@pytest.fixture(scope="module")
def gguf_logits(gguf_model):  # type: ignore[no-untyped-def]
    """``prefill_logits`` of a fresh ``Runner`` on ``layout_name`` over the GGUF weights: the
    reference a checkpoint path must equal, computed once per layout in this module (both
    service tests compare against 1x4)."""
    cfg, graphdef, gguf_params = gguf_model
    computed: dict[str, np.ndarray] = {}

    def logits(layout_name: str) -> np.ndarray:
        if layout_name not in computed:
            computed[layout_name] = prefill_logits(Runner(cfg, graphdef, gguf_params, load_layout(layout_name), ECFG))
        return computed[layout_name]

    return logits


def restored_state(path: Path, cfg: LlamaConfig, layout_name: str) -> nnx.State:
    layout = load_layout(layout_name)
    _, state = abstract_llama(cfg)
    shardings = param_shardings(state, make_mesh(layout), make_plan(layout, cfg, ECFG.num_slots).rules)
    nnx.replace_by_pure_dict(state, restore_checkpoint(path, shardings, "float32"))
    return state


def prefill_logits(runner: Runner) -> np.ndarray:
    """The logits after PROMPT, served alone by ``runner`` (its loop, if any, stopped)."""
    return served(runner, [PROMPT], 1)[1][0]


def by_path(tree: object) -> dict[str, object]:
    """A state's leaves by path (float32 panels, ``cpu_matmul.Panels``, as one leaf)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(
        nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree,
        is_leaf=lambda x: isinstance(x, cpu_matmul.Panels),
    )
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def test_checkpoint_is_recognised(converted: Path) -> None:
    assert model_format(converted) == "checkpoint"
    cfg, meta = read_checkpoint_config(converted)
    assert meta["dtype"] == "float32" and meta["architecture"] == "llama"
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 9, 3, 49152)


@pytest.mark.parametrize("layout_name", ["1x1", "1x4"])
def test_restored_logits_equal_gguf(converted: Path, gguf_model, gguf_logits, layout_name: str) -> None:  # type: ignore[no-untyped-def]
    cfg, graphdef, _ = gguf_model
    assert read_checkpoint_config(converted)[0] == cfg
    layout = load_layout(layout_name)
    reference = gguf_logits(layout_name)

    state = restored_state(converted, cfg, layout_name)
    restored = by_path(state)
    runner = Runner(cfg, graphdef, state, layout, ECFG)
    # Restored straight into the runner's shardings: it placed nothing again, except the float32
    # matmul weights one CPU device packs into panels for its native kernel (``model.kernels``).
    placed = by_path(runner.params)
    packed = {path for path, leaf in placed.items() if isinstance(leaf, cpu_matmul.Panels)}
    assert bool(packed) == runner.kernels.panels
    assert set(placed) - packed == set(restored) - packed  # a tied model's packed head is new
    for path in set(restored) - packed:
        assert placed[path] is restored[path], path
    if layout.model == 4:
        w_gate_up = runner.params["layers"]["w_gate_up"][...]
        assert {s.data.shape for s in w_gate_up.addressable_shards} == {(30, 576, 2, 1536 // 4)}
    np.testing.assert_array_equal(prefill_logits(runner), reference)


def test_service_serves_a_checkpoint(converted: Path, gguf_logits, smollm2_gguf: Path) -> None:  # type: ignore[no-untyped-def]
    """``startup.load`` picks the checkpoint loader by the path and restores per pool."""
    gateway = Gateway(
        ServerConfig(
            model=str(converted),
            cache_dir=str(smollm2_gguf.parent),
            layout="1x4",
            engine=ECFG,
            metrics_port=0,
        )
    )
    try:
        load(gateway)
    finally:
        for pool in gateway.pools:
            pool.loop.stop(5.0)
    assert gateway.facts is not None and gateway.facts.kind == "checkpoint"
    assert set(gateway.facts.startup_seconds) == {"restore", "place", "compile", "warmup"}
    assert gateway.facts.name == converted.name
    runner = gateway.pools[0].loop.runner
    np.testing.assert_array_equal(prefill_logits(runner), gguf_logits("1x4"))


def test_checkpoint_tokenizer_equals_gguf(converted: Path, tokenizer: Tokenizer) -> None:
    tok = Tokenizer.from_checkpoint(converted)
    for text in ["Hello world", "x  1234 + 56", "<|im_start|>user\nÜber naïve café 🙂<|im_end|>"]:
        assert tok.encode(text) == tokenizer.encode(text)
        ids = tokenizer.encode(text)
        assert tok.decode(ids) == tokenizer.decode(ids)
    assert (tok.bos_id, tok.eos_ids, tok.special_ids, tok.vocab_size) == (
        tokenizer.bos_id,
        tokenizer.eos_ids,
        tokenizer.special_ids,
        tokenizer.vocab_size,
    )
    chat = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(chat) == tokenizer.apply_chat_template(chat)


# ---- damage, on a tiny random model -----------------------------------------------------------
TINY = LlamaConfig.tiny(vocab_size=49152, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny_ckpt(tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    _, state = random_llama(TINY, seed=3)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(state))
    path = save_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", TINY, params, tokenizer, "bfloat16")
    return path, params


@pytest.fixture
def tiny_copy(tiny_ckpt: tuple[Path, dict], tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_ckpt[0], tmp_path / "copy"))


def one_device_shardings(cfg: LlamaConfig) -> nnx.State:
    layout = load_layout("1x2")
    _, state = abstract_llama(cfg)
    return param_shardings(state, make_mesh(layout), make_plan(layout, cfg).rules)


def test_bfloat16_storage_restores_as_requested(tiny_ckpt: tuple[Path, dict]) -> None:
    path, params = tiny_ckpt
    as_f32 = restore_checkpoint(path, one_device_shardings(TINY), "float32")
    as_stored = restore_checkpoint(path, one_device_shardings(TINY))
    assert as_f32["lm_head"].dtype == np.float32 and as_stored["lm_head"].dtype == ml_dtypes.bfloat16
    expected = params["layers"]["w_gate_up"].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(as_stored["layers"]["w_gate_up"]), expected)
    np.testing.assert_array_equal(np.asarray(as_f32["layers"]["w_gate_up"]), expected.astype(np.float32))


def test_missing_array_chunk_is_named(tiny_copy: Path) -> None:
    chunks = sorted(p for p in (tiny_copy / "params" / "layers.wqkv").iterdir() if not p.name.startswith("."))
    chunks[0].unlink()
    with pytest.raises(CheckpointError, match=r"truncated: array 'layers/wqkv' lacks chunk file params/layers\.wqkv/"):
        restore_checkpoint(tiny_copy, one_device_shardings(TINY))


def test_missing_array_directory_is_named(tiny_copy: Path) -> None:
    shutil.rmtree(tiny_copy / "params" / "layers.w_down")
    with pytest.raises(CheckpointError, match=r"truncated: array 'layers/w_down' \(params/layers\.w_down\) is missing"):
        restore_checkpoint(tiny_copy, one_device_shardings(TINY))


def test_damaged_chunk_fails_the_read(tiny_copy: Path) -> None:
    """A chunk that is present but damaged is caught by the read. In a subprocess: orbax leaves
    the other reads of a failed restore pending, and they complain when the interpreter exits."""
    chunk = next(p for p in (tiny_copy / "params" / "embed").iterdir() if not p.name.startswith("."))
    chunk.write_bytes(chunk.read_bytes()[:10])
    script = f"""
import os
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from model.weights.checkpoint import CheckpointError, restore_checkpoint
from model.config import LlamaConfig
from model.weights.loader import abstract_llama
mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
_, state = abstract_llama(LlamaConfig.tiny(vocab_size=49152, tie_word_embeddings=False))
shardings = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), nnx.to_pure_dict(state))
try:
    restore_checkpoint({str(tiny_copy)!r}, shardings)
except CheckpointError as exc:
    print("CheckpointError:", str(exc).splitlines()[0])
"""
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=repo)
    assert re.search(
        r"CheckpointError: checkpoint .* is truncated or corrupt: reading its arrays failed", done.stdout
    ), done.stdout + done.stderr[-2000:]


def test_missing_metadata_or_tokenizer_is_named(tiny_copy: Path) -> None:
    (tiny_copy / "meshserve_tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"incomplete: meshserve_tokenizer\.json is missing"):
        restore_checkpoint(tiny_copy, one_device_shardings(TINY))
    (tiny_copy / "params" / "_METADATA").unlink()
    (tiny_copy / "meshserve_tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="incomplete: params/_METADATA is missing"):
        restore_checkpoint(tiny_copy, one_device_shardings(TINY))


def test_wrong_architecture_is_rejected(tiny_copy: Path) -> None:
    file = tiny_copy / "config.json"
    config = json.loads(file.read_text())
    file.write_text(json.dumps(config | {"architecture": "mistral"}))
    with pytest.raises(
        CheckpointError, match="architecture 'mistral' is not supported; supported: llama, qwen2, qwen3"
    ):
        read_checkpoint_config(tiny_copy)
    with pytest.raises(CheckpointError, match="architecture 'mistral' is not supported"):
        restore_checkpoint(tiny_copy, one_device_shardings(TINY))


def test_config_that_does_not_fit_the_arrays_is_rejected(tiny_copy: Path) -> None:
    file = tiny_copy / "config.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | {"intermediate_size": 256}))
    cfg = read_checkpoint_config(tiny_copy)[0]
    with pytest.raises(
        CheckpointError, match=r"array 'layers/w_down' has shape \(2, 128, 64\), expected \(2, 256, 64\)"
    ):
        restore_checkpoint(tiny_copy, one_device_shardings(cfg))


def test_save_refuses_a_non_empty_directory(tiny_ckpt: tuple[Path, dict], tokenizer: Tokenizer) -> None:
    path, params = tiny_ckpt
    with pytest.raises(FileExistsError, match="already exists"):
        save_checkpoint(path, TINY, params, tokenizer)


def test_save_rejects_params_that_do_not_fit_the_config(tiny_ckpt: tuple[Path, dict], tokenizer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, params = tiny_ckpt
    broken = {k: v for k, v in params.items() if k != "lm_head"}
    with pytest.raises(CheckpointError, match=r"params: array\(s\) \['lm_head'\] are missing"):
        save_checkpoint(tmp_path / "x", TINY, broken, tokenizer)
    assert not (tmp_path / "x").exists()


def test_layout_switch_restores_from_the_checkpoint(converted: Path, gguf_logits, smollm2_gguf: Path) -> None:  # type: ignore[no-untyped-def]
    """Serving a checkpoint, a switch to another layout reads the weights from the checkpoint
    straight into the new shardings (not from the live arrays) and computes the same logits."""
    gateway = Gateway(
        ServerConfig(
            model=str(converted),
            cache_dir=str(smollm2_gguf.parent),
            layout="1x1",
            engine=ECFG,
            metrics_port=0,
        )
    )
    try:
        load(gateway)
        old = gateway.pools[0].loop.runner
        layout = load_layout("1x4")
        restored = gateway.restore(layout, jax.devices())
        assert restored is not None
        w_gate_up = restored["layers"]["w_gate_up"][...]
        assert len(w_gate_up.sharding.device_set) == 4  # born sharded, not placed by the runner
        switched = old.relayout(layout, jax.devices(), restored)
        assert switched.params["layers"]["w_gate_up"][...] is w_gate_up  # used as restored
        np.testing.assert_array_equal(prefill_logits(switched), gguf_logits("1x4"))
    finally:
        for pool in gateway.pools:
            pool.loop.stop(5.0)
