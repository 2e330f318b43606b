"""Blocks in checkpoints and int8 for float weights (issue 20): ``meshserve convert`` keeps a
GGUF's Q8_0/Q4_0/Q4_1 blocks as they are, float weights quantize to Q8_0 blocks (int8), and a
checkpoint restores its blocks into any layout or dequantizes them.

References: ggml's own Q8_0 quantizer (``gguf.quants.quantize``, which tests/tiny_gguf.py uses
to write a Q8_0 file of the same random weights) for int8; the GGUF's dequantized values
(``load_gguf_params`` without ``stored``, held to Hugging Face by tests/test_golden.py) for a
restored checkpoint; one CPU device's greedy ids for every mesh.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from flax import nnx
from test_stored_weights import greedy
from tiny_gguf import write_tiny_llama_gguf

from model.config import LlamaConfig
from model.weights import block_params, quant_panels
from model.weights.checkpoint import CheckpointError, read_checkpoint_config, save_checkpoint
from model.weights.gguf_weights import load_gguf_params
from model.weights.loader import load_model
from model.weights.quant_panels import QuantPanels
from protos.meshserve.v1 import meshserve_pb2 as pb
from service.engine.config import EngineConfig
from service.engine.runner import Runner
from service.server.app import ServerThread
from service.server.client import Client
from service.server.config import ServerConfig
from sharding.layouts import Layout

MATMULS = ("wqkv", "wo", "w_gate_up", "w_down")
ECFG = EngineConfig(num_slots=4, max_seq_len=64, chunk_size=16, page_size=8, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model's random weights as float32, and as ggml quantized them to Q8_0 and Q4_1."""
    d = tmp_path_factory.mktemp("blocks")
    return {
        q: write_tiny_llama_gguf(d / f"{q}.gguf", quantize=None if q == "F32" else q) for q in ("F32", "Q8_0", "Q4_1")
    }


def pure(path: Path, **kw: object) -> dict:
    return nnx.to_pure_dict(load_model(path, **kw).state)  # type: ignore[arg-type]


def same(a: object, b: object) -> bool:
    """Two param trees hold the same arrays (dtypes, shapes, bits) and the same block formats."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb, strict=True)
    )


def test_int8_of_float_weights_is_ggmls_q8_0_of_them(files: dict[str, Path]) -> None:
    int8 = pure(files["F32"], quantize="int8")
    ggml = pure(files["Q8_0"], stored=True)
    for name in MATMULS:
        got, want = int8["layers"][name], ggml["layers"][name]
        assert isinstance(got, QuantPanels) and got.format == "q8_0", name
        assert same(got, want), name
    # the 264-row embedding is not whole 32-row panels: it stays float, as in the GGUF
    assert np.array_equal(int8["embed"], ggml["embed"])


def test_int8_error_is_within_half_a_step_of_each_block() -> None:
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((96, 3, 64)) * np.array([0.01, 1.0, 30.0])[None, :, None]).astype(np.float32)
    q = block_params.quantize_matrix(w, 1)  # K = 96 inputs, outputs (3, 64)
    assert q is not None and q.out_shape == (3, 64)
    back = np.asarray(quant_panels.dequantize(q)).reshape(w.shape)
    # per output and 32-input block: |w - d q| <= d / 2 with d = max|w| / 127, plus d's float16 rounding
    blocks = np.abs(w).reshape(3, 32, 3, 64).max(axis=1, keepdims=True)
    bound = np.repeat(blocks, 32, axis=1).reshape(w.shape) / 127 * (0.5 + 128 * 2.0**-11)
    assert np.all(np.abs(back - w) <= bound)
    assert block_params.quantize_matrix(w[:40], 1) is None  # 40 inputs: not whole blocks


@pytest.mark.parametrize("source", ["Q4_1", "Q8_0", "F32-int8"])
def test_a_checkpoint_keeps_its_blocks_and_restores_them_or_their_values(
    files: dict[str, Path], tmp_path: Path, source: str
) -> None:
    path = files[source.split("-")[0]]
    held = load_model(path, stored=True, quantize="int8" if source.endswith("int8") else None, tokenizer=True)
    params = nnx.to_pure_dict(held.state)
    assert held.tokenizer is not None
    out = save_checkpoint(tmp_path / "ck", held.cfg, params, held.tokenizer, source=str(path))
    _, meta = read_checkpoint_config(out)
    fmt = "q8_0" if source != "Q4_1" else "q4_1"
    assert meta["format_version"] == 2 and meta["blocks"] == {f"layers/{m}": fmt for m in MATMULS}
    assert same(pure(out, stored=True), params)  # the blocks, bit for bit
    blocks = block_params.block_formats(params)
    stored_bytes = sum(f.stat().st_size for f in (out / "params").rglob("*") if f.is_file() and "codes" in str(f))
    assert stored_bytes < sum(params["layers"][m].codes.nbytes for m in MATMULS) * 1.05  # not widened
    assert blocks
    # Without ``stored``: the values, as the float model holds them (a GGUF's, dequantized)
    floats = pure(out)
    want = pure(path) if source != "F32-int8" else block_params.dequantize_params(params, shapes(held.cfg), np.float32)
    assert same(floats, want)


def shapes(cfg: LlamaConfig) -> dict:
    from model.weights.checkpoint import expected_shapes

    return expected_shapes(cfg)


def test_a_float_checkpoint_is_still_version_1(files: dict[str, Path], tmp_path: Path) -> None:
    held = load_model(files["Q4_1"], tokenizer=True)
    assert held.tokenizer is not None
    out = save_checkpoint(tmp_path / "ck", held.cfg, nnx.to_pure_dict(held.state), held.tokenizer)
    _, meta = read_checkpoint_config(out)
    assert meta["format_version"] == 1 and "blocks" not in meta


@pytest.fixture(scope="module")
def q41_checkpoint(files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Q4_1 tiny model converted by the real CLI (blocks kept: the default)."""
    out = tmp_path_factory.mktemp("cli") / "q41"
    done = subprocess.run(
        [sys.executable, "-m", "service.server.cli", "convert", str(files["Q4_1"]), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "blocks layers/w_down=q4_1" in done.stderr
    return out


def test_convert_quantizes_dequantizes_and_refuses_both(files: dict[str, Path], tmp_path: Path) -> None:
    def convert(src: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "service.server.cli", "convert", str(src), str(out), *flags]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    done = convert(files["F32"], tmp_path / "int8", "--quantize", "int8")
    assert done.returncode == 0, done.stderr
    assert read_checkpoint_config(tmp_path / "int8")[1]["blocks"]["layers/wqkv"] == "q8_0"
    done = convert(files["Q4_1"], tmp_path / "floats", "--dequantize")
    assert done.returncode == 0, done.stderr
    assert "blocks" not in read_checkpoint_config(tmp_path / "floats")[1]
    done = convert(files["Q4_1"], tmp_path / "both", "--dequantize", "--quantize", "int8")
    assert done.returncode != 0 and "contradict" in done.stderr and not (tmp_path / "both").exists()


def test_held_formats_of_a_checkpoint_are_what_it_restores(q41_checkpoint: Path, files: dict[str, Path]) -> None:
    """``model.weights.loader.held_formats`` (what ``meshserve layouts`` and the Admin service price) reads
    a converted checkpoint's blocks from its config alone: the formats the restored state holds."""
    from model.weights.loader import held_formats
    from service.server.startup import stored_formats

    restored = stored_formats(load_model(q41_checkpoint, stored=True).state)
    assert held_formats(q41_checkpoint, True) == restored == held_formats(files["Q4_1"], True)
    assert set(restored) == set(MATMULS) and set(restored.values()) == {"q4_1"}
    assert held_formats(q41_checkpoint, False) == {}


def test_a_block_checkpoint_on_every_mesh_gives_one_devices_ids(q41_checkpoint: Path, files: dict[str, Path]) -> None:
    """Blocks restored straight into a layout's shardings (panels split over the model axis)
    give the GGUF's stored ids; one device's blocks get the native kernel where it is built."""
    from model.native import quant_matmul
    from sharding.mesh import make_mesh
    from sharding.plan import make_plan
    from sharding.rules import param_shardings

    gguf_model = load_model(files["Q4_1"], stored=True)
    want = greedy(Runner(gguf_model.cfg, gguf_model.graphdef, gguf_model.state, Layout("1x1"), ECFG))
    for layout in (Layout("1x1"), Layout("1x2", data=1, model=2), Layout("2x4", data=2, model=4)):
        devices = jax.devices()[: layout.num_devices]

        def shardings(cfg: LlamaConfig, state: nnx.State, layout: Layout = layout, devices: list = devices) -> object:
            return param_shardings(state, make_mesh(layout, devices), make_plan(layout, cfg, ECFG.num_slots).rules)

        restored = load_model(q41_checkpoint, shardings=shardings, stored=True)
        wqkv = restored.state["layers"]["wqkv"].get_value()
        assert isinstance(wqkv, QuantPanels) and len(wqkv.codes.sharding.device_set) == layout.num_devices
        runner = Runner(restored.cfg, restored.graphdef, restored.state, layout, ECFG, devices)
        held = runner.params["layers"]["wqkv"].get_value()
        assert held.kernel == ("native" if layout.num_devices == 1 and quant_matmul.available() else "xla")
        assert greedy(runner) == want, layout.name


def test_a_server_serves_a_block_checkpoint_as_stored_or_as_floats(
    q41_checkpoint: Path, files: dict[str, Path]
) -> None:
    reader = gguf.GGUFReader(str(files["Q4_1"]))
    for weights, formats in (("stored", dict.fromkeys(MATMULS, "q4_1")), ("float32", {})):
        ecfg = EngineConfig(num_slots=2, max_seq_len=64, chunk_size=16, weights=weights)
        srv = ServerThread(ServerConfig(model=str(q41_checkpoint), port=0, metrics_port=0, engine=ecfg)).start()
        try:
            client = Client(srv.address)
            info = client.model_info()
            assert (info.weights, dict(info.weight_formats)) == (weights, formats)
            if weights == "stored":
                assert info.weight_bytes == sum(int(t.n_bytes) for t in reader.tensors)
            result = client.generate(pb.GenerateRequest(prompt="hello", max_tokens=4, temperature=0.0))
            assert len(result.token_ids) == 4
        finally:
            srv.stop()


def test_int8_serving_matches_the_dequantized_int8_model(files: dict[str, Path]) -> None:
    """``weights="int8"``: the engine's ids are the float model's over the int8 blocks' values
    (what the quantization changed is the weights, not the arithmetic), in both layer loops."""
    cfg = LlamaConfig.from_gguf(files["F32"])
    int8 = block_params.quantize_params(load_gguf_params(files["F32"], cfg))
    from model.weights.build import llama_from_params

    graphdef, state = llama_from_params(cfg, int8)
    got = greedy(Runner(cfg, graphdef, state, Layout("1x1"), ECFG))
    floats = block_params.dequantize_params(int8, shapes(cfg), np.float32)
    graphdef, state = llama_from_params(cfg, floats)
    assert got == greedy(Runner(cfg, graphdef, state, Layout("1x1"), ECFG))
    graphdef, state = llama_from_params(cfg, int8)
    unrolled = Runner(cfg, graphdef, state, Layout("1x1"), dataclasses.replace(ECFG, layer_loop="unrolled"))
    assert isinstance(unrolled.params["layers"]["wqkv"].get_value(), tuple)  # per-layer blocks
    assert greedy(unrolled) == got

    ecfg = EngineConfig(num_slots=2, max_seq_len=64, chunk_size=16, weights="int8")
    srv = ServerThread(ServerConfig(model=str(files["F32"]), port=0, metrics_port=0, engine=ecfg)).start()
    try:
        info = Client(srv.address).model_info()
        assert (info.weights, dict(info.weight_formats)) == ("int8", dict.fromkeys(MATMULS, "q8_0"))
    finally:
        srv.stop()


def test_a_truncated_or_mislabelled_block_checkpoint_is_named(q41_checkpoint: Path, tmp_path: Path) -> None:
    broken = tmp_path / "cut"
    shutil.copytree(q41_checkpoint, broken)
    codes = broken / "params" / "layers.w_down.codes"
    chunk = next(p for p in codes.iterdir() if not p.name.startswith("."))
    chunk.unlink()
    with pytest.raises(CheckpointError, match=r"array 'layers/w_down/codes' lacks chunk file"):
        load_model(broken, stored=True)
    relabelled = tmp_path / "relabelled"
    shutil.copytree(q41_checkpoint, relabelled)
    config = json.loads((relabelled / "config.json").read_text())
    config["blocks"]["layers/w_down"] = "q8_0"  # Q4_1's codes are half as wide, and it has mins
    (relabelled / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"layers/w_down/(codes|mins)"):
        load_model(relabelled, stored=True)
    config["blocks"]["layers/w_down"] = "q2_k"
    (relabelled / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"'blocks' gives 'layers/w_down' the format 'q2_k'"):
        load_model(relabelled, stored=True)
    config["blocks"]["layers/w_down"] = "q4_1"
    config["format_version"] = 1  # version 1 readers would take the block arrays for floats
    (relabelled / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"format_version 1 holds no blocks"):
        load_model(relabelled, stored=True)
    config["format_version"] = 2
    del config["blocks"]["layers/w_down"]
    (relabelled / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"holds 'layers/w_down' as blocks .* does not declare"):
        load_model(relabelled, stored=True)


def test_block_arrays_of_the_wrong_dtype_are_named(q41_checkpoint: Path, tmp_path: Path) -> None:
    """Q4_1 codes relabelled int8 in their .zarray kept their shape: without a dtype check the
    XLA path served garbage from them (the native one failed at warm-up, naming no array)."""
    broken = tmp_path / "dtype"
    shutil.copytree(q41_checkpoint, broken)
    zarray = broken / "params" / "layers.wqkv.codes" / ".zarray"
    spec = json.loads(zarray.read_text())
    assert spec["dtype"] == "|u1"
    zarray.write_text(json.dumps({**spec, "dtype": "|i1"}))
    for stored in (True, False):
        with pytest.raises(CheckpointError, match=r"array 'layers/wqkv/codes' has dtype int8, expected uint8"):
            load_model(broken, stored=stored)


def test_info_reports_each_pools_weight_bytes_and_int8_only_when_it_quantized(
    q41_checkpoint: Path, files: dict[str, Path]
) -> None:
    """Pools on other layouts hold other bytes (1x2 splits the QKV panels, replicates the rest):
    each pool's ``weight_bytes`` is its own. ``weights="int8"`` on a model whose matmuls are all
    blocks already quantizes nothing: it reports "stored"."""
    ecfg = EngineConfig(num_slots=2, max_seq_len=64, chunk_size=16, weights="stored")
    srv = ServerThread(
        ServerConfig(model=str(q41_checkpoint), port=0, metrics_port=0, engine=ecfg, pools=["a=1x1", "b=1x2"])
    ).start()
    try:
        client = Client(srv.address)
        a = client.model_info()
        b = client.stub.GetModelInfo(pb.GetModelInfoRequest(layout="b"), timeout=10)
        assert (a.pool, b.pool) == ("a", "b") and a.weights == b.weights == "stored"
        assert srv.running is not None
        runner_b = next(p for p in srv.running.gateway.pools if p.name == "b").loop.runner
        assert b.weight_bytes == sum(runner_b.weight_bytes_per_device().values()) != a.weight_bytes
    finally:
        srv.stop()
    ecfg = EngineConfig(num_slots=2, max_seq_len=64, chunk_size=16, weights="int8")
    srv = ServerThread(ServerConfig(model=str(files["Q4_1"]), port=0, metrics_port=0, engine=ecfg)).start()
    try:
        info = Client(srv.address).model_info()
        assert (info.weights, dict(info.weight_formats)) == ("stored", dict.fromkeys(MATMULS, "q4_1"))
    finally:
        srv.stop()


@pytest.mark.parametrize("source", ["Q4_1", "F32-int8"])
def test_a_bfloat16_kv_cache_works_with_blocks(files: dict[str, Path], source: str) -> None:
    """``kv_dtype`` is independent of how the weights are held: blocks (stored, or int8) with a
    bfloat16 cache give the ids of the float model over the same values with that cache."""
    from model.weights.build import llama_from_params

    path = files[source.split("-")[0]]
    cfg = LlamaConfig.from_gguf(path)
    params = load_gguf_params(path, cfg, stored=True)
    if source.endswith("int8"):
        params = block_params.quantize_params(params)
    floats = block_params.dequantize_params(params, shapes(cfg), np.float32)
    ecfg = EngineConfig(
        num_slots=4, max_seq_len=64, chunk_size=16, page_size=8, max_num_batched_tokens=32, kv_dtype="bfloat16"
    )
    runs = []
    for tree in (params, floats):
        graphdef, state = llama_from_params(cfg, tree)
        runner = Runner(cfg, graphdef, state, Layout("1x1"), ecfg)
        assert runner.ecfg.kv_dtype == "bfloat16"
        runs.append(greedy(runner))
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_smollm2_converts_to_its_files_blocks(smollm2_gguf: Path, tmp_path: Path) -> None:
    """The default model's checkpoint (``convert``'s default) holds the GGUF's Q4_1 and Q8_0
    blocks bit for bit, in about the file's bytes (float32: 538 MB)."""
    from service.server.cli import main

    out = tmp_path / "smollm2-blocks"
    assert main(["convert", str(smollm2_gguf), str(out)]) == 0
    blocks = read_checkpoint_config(out)[1]["blocks"]
    assert blocks == {**{f"layers/{m}": "q4_1" for m in MATMULS}, "embed": "q8_0"}
    assert same(pure(out, stored=True), pure(smollm2_gguf, stored=True))
    stored = sum(f.stat().st_size for f in (out / "params").rglob("*") if f.is_file())
    tensors = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(smollm2_gguf)).tensors)
    assert stored < 1.05 * tensors
