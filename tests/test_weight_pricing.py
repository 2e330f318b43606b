"""Weight bytes priced as the weights are held (issue 20): float arrays, or GGUF blocks (Q8_0,
Q4_0, Q4_1 as stored; int8 quantized to Q8_0). ``ShardingPlan.weight_bytes_per_device`` must be
what ``service.engine.runner.bytes_per_device`` measures on the placed params of every layout, and
``meshserve layouts``, the Admin service and ``meshserve-bench roofline`` must quote it.

The tiny model (tests/tiny_gguf.py): D 64, F 128, 4 query / 2 KV heads of 16, vocabulary 264
(not whole 32-row panels: its tied embedding stays float32 in every file).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import grpc
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_gguf import write_tiny_llama_gguf

from model.config import LlamaConfig
from model.kernels import choose
from model.weights import block_params
from model.weights.build import llama_from_params
from model.weights.gguf_weights import load_gguf_params
from model.weights.loader import held_formats
from protos.meshserve.v1 import admin_pb2 as apb
from protos.meshserve.v1 import admin_pb2_grpc as apb_grpc
from service.engine.config import EngineConfig
from service.engine.runner import bytes_per_device, place_params
from service.server.app import ServerThread
from service.server.config import ServerConfig
from service.server.startup import stored_formats
from sharding.layouts import Layout, load_layout
from sharding.mesh import make_mesh
from sharding.plan import make_plan

FORMATS = ["Q8_0", "Q4_0", "Q4_1"]
MESHES = [(1, 1), (1, 2), (2, 4), (1, 8)]
TOKEN = "pricing-admin-token"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model with every layer matmul in each block format, and all float32."""
    root = tmp_path_factory.mktemp("pricing")
    out = {fmt: write_tiny_llama_gguf(root / f"{fmt}.gguf", quantize=fmt) for fmt in FORMATS}
    out["F32"] = write_tiny_llama_gguf(root / "F32.gguf")
    return out


def measured(graphdef: object, state: object, cfg: LlamaConfig, layout: Layout, dtype: object = np.float32) -> set[int]:
    """The bytes each device of ``layout`` holds once ``state`` is placed as a ``Runner`` places it
    (in the form the layout's devices' kernels run: ``model.kernels.choose``)."""
    mesh = make_mesh(layout)
    kernels = choose(list(mesh.devices.flat), cfg, dtype, dtype)
    _, params, _ = place_params(graphdef, state, jnp.dtype(dtype), kernels, mesh, make_plan(layout, cfg).rules)
    return set(bytes_per_device(params).values())


@pytest.mark.parametrize("fmt", [*FORMATS, "int8"])
@pytest.mark.parametrize(("data", "tp"), MESHES, ids=[f"{d}x{t}" for d, t in MESHES])
def test_the_prediction_is_what_the_placed_blocks_hold(files: dict[str, Path], fmt: str, data: int, tp: int) -> None:
    """Blocks split as ``quant_shardings`` splits them: on 1x2 (heads split) the QKV panels and
    O's blocks halve; on 2x4 and 1x8 (attention replicated) gate/up's panels and, on 1x8, the
    down blocks (4 per row) stay whole."""
    path = files["F32" if fmt == "int8" else fmt]
    cfg = LlamaConfig.from_gguf(path)
    params = load_gguf_params(path, cfg, stored=True)
    if fmt == "int8":
        params = block_params.quantize_params(params)
    graphdef, state = llama_from_params(cfg, params)
    formats = stored_formats(state)
    assert formats == held_formats(path, True, "int8" if fmt == "int8" else None)  # told without the weights
    assert set(formats) == {"wqkv", "wo", "w_gate_up", "w_down"}
    layout = Layout(f"{data}x{tp}", data=data, model=tp)
    plan = make_plan(layout, cfg)
    predicted = plan.weight_bytes_per_device(cfg, 4, formats)
    assert measured(graphdef, state, cfg, layout) == {predicted}
    if (data, tp) == (1, 1):  # one device holds the file's bytes (the blocks as stored, the rest float32)
        reader = gguf.GGUFReader(str(path))
        assert fmt == "int8" or predicted == sum(int(t.n_bytes) for t in reader.tensors)
    assert predicted < plan.weight_bytes_per_device(cfg, 4)  # fewer than float32's


@pytest.mark.parametrize(("data", "tp"), MESHES, ids=[f"{d}x{t}" for d, t in MESHES])
def test_float_prediction_is_what_the_placed_floats_hold(files: dict[str, Path], data: int, tp: int) -> None:
    cfg = LlamaConfig.from_gguf(files["F32"])
    graphdef, state = llama_from_params(cfg, load_gguf_params(files["F32"], cfg))
    layout = Layout(f"{data}x{tp}", data=data, model=tp)
    plan = make_plan(layout, cfg)
    assert measured(graphdef, state, cfg, layout, jnp.bfloat16 if tp == 2 else np.float32) == {
        plan.weight_bytes_per_device(cfg, 2 if tp == 2 else 4)
    }


def test_block_bytes_per_32_weights(files: dict[str, Path]) -> None:
    """Q8_0 34, Q4_0 18, Q4_1 20 bytes per 32 weights: the matmul weights of one device."""
    cfg = LlamaConfig.from_gguf(files["Q8_0"])
    plan = make_plan(Layout("1x1"), cfg)
    L, D, N, K, H, F, _ = cfg.dims
    weights = L * (D * H * (2 * N + 2 * K) + 3 * D * F)
    for fmt, per_32 in (("q8_0", 34), ("q4_0", 18), ("q4_1", 20)):
        held = plan.param_bytes(cfg, 4, dict.fromkeys(("wqkv", "wo", "w_gate_up", "w_down"), fmt))
        assert held["wqkv"] + held["wo"] + held["w_gate_up"] + held["w_down"] == weights // 32 * per_32
    with pytest.raises(ValueError, match="not whole blocks"):  # 264 rows are not whole 32-row panels
        plan.param_bytes(cfg, 4, {"embed": "q8_0"})
    with pytest.raises(ValueError, match="does not have"):
        plan.param_bytes(cfg, 4, {"w_gate": "q8_0"})


def test_admin_reports_the_stored_bytes(files: dict[str, Path]) -> None:
    """ListLayouts on a server holding Q4_1 blocks: each preset's and the pool's weight bytes are
    the blocks' (what those layouts' devices hold once placed), not float32's."""
    path = files["Q4_1"]
    cfg = ServerConfig(
        model=str(path), port=0, metrics_port=0, pools=["p=1x2"], admin_token=TOKEN, admin_port=0,
        engine=EngineConfig(num_slots=2, max_seq_len=64, chunk_size=16, weights="stored", kv_cache_tokens=128),
    )  # fmt: skip
    srv = ServerThread(cfg).start()
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{srv.running.admin_port}")
        resp = apb_grpc.AdminStub(channel).ListLayouts(
            apb.ListLayoutsRequest(), metadata=[("authorization", f"Bearer {TOKEN}")]
        )
        channel.close()
        runner = srv.running.gateway.pools[0].loop.runner
        (pool,) = resp.pools
        assert set(runner.weight_bytes_per_device().values()) == {pool.layout.weight_bytes_per_device}
        model_cfg = LlamaConfig.from_gguf(path)
        graphdef, state = llama_from_params(model_cfg, load_gguf_params(path, model_cfg, stored=True))
        assert {p.name for p in resp.presets} >= {"single", "latency", "hybrid"}
        for preset in resp.presets:
            if preset.unusable:  # e.g. "throughput": data 8 does not divide 2 slots
                continue
            layout = load_layout(preset.name)
            plan = make_plan(layout, model_cfg)
            assert measured(graphdef, state, model_cfg, layout) == {preset.weight_bytes_per_device}, preset.name
            assert preset.weight_bytes_per_device < plan.weight_bytes_per_device(model_cfg, 4)
    finally:
        srv.stop()


def test_layouts_prints_the_stored_bytes(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from service.server.cli import main

    path = files["Q4_1"]
    cfg = LlamaConfig.from_gguf(path)
    assert main(["layouts", "--model", str(path), "--slots", "8", "--weights", "stored"]) == 0
    text = capsys.readouterr().out
    assert "weights (--weights stored): blocks as stored (q4_1: w_down, w_gate_up, wo, wqkv; the rest float32)" in text
    formats = held_formats(path, True)
    for name in ("single", "latency", "hybrid"):
        layout = load_layout(name)
        mb = make_plan(layout, cfg).weight_bytes_per_device(cfg, 4, formats) / 1e6
        (row,) = [line for line in text.splitlines() if line.startswith(f"{name} ")]
        assert f"{mb:.1f} MB   stored" in row, row
    assert main(["layouts", "--model", str(path), "--slots", "8", "--weights", "float32"]) == 0
    text = capsys.readouterr().out
    single = make_plan(load_layout("single"), cfg).weight_bytes_per_device(cfg, 4) / 1e6
    assert "weights (--weights float32): float32" in text and f"{single:.1f} MB  float32" in text


def test_roofline_streams_the_blocks_bytes(files: dict[str, Path], tmp_path: Path) -> None:
    """A decode step on 1x1 reads every weight once: with the blocks as stored, the file's bytes
    (tied embedding: no rows looked up apart); float32, 4 bytes per parameter. Same FLOPs."""
    from benchmarks.cli import main  # meshserve-bench roofline

    path = files["Q4_1"]
    cfg = LlamaConfig.from_gguf(path)
    runs = {}
    for weights in ("stored", "float32", "auto"):
        out = tmp_path / f"{weights}.json"
        args = ["roofline", "--model", str(path), "--hardware", "h200", "--layout", "1x1", "1x2", "--context", "256"]
        dtype = [] if weights == "float32" else ["--dtype", "float32"]  # the float rest, as --weights float32's
        assert main([*args, *dtype, "--weights", weights, "--json", str(out)]) == 0
        runs[weights] = {r["tp"]: r for r in json.loads(out.read_text())}
    reader = gguf.GGUFReader(str(path))
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    stored, floats = runs["stored"][1], runs["float32"][1]
    assert stored["decode"]["weight_bytes"] == stored["weights_stored_bytes"] == file_bytes
    assert floats["decode"]["weight_bytes"] == cfg.param_count() * 4
    assert stored["decode"]["flops"] == floats["decode"]["flops"]
    # Q4_1: 20 bytes per 32 matmul weights instead of 4 bytes each; the embedding and norms float32.
    L, D, N, K, H, F, _ = cfg.dims
    matmul = L * (D * H * (2 * N + 2 * K) + 3 * D * F)
    ratio = stored["decode"]["weight_bytes"] / floats["decode"]["weight_bytes"]
    assert ratio == (matmul * 20 / 32 + (cfg.param_count() - matmul) * 4) / (cfg.param_count() * 4)
    assert runs["auto"] == runs["stored"]  # a GGUF with blocks: priced as stored by default
    plan = make_plan(Layout("1x2", data=1, model=2), cfg)
    assert runs["stored"][2]["decode"]["weight_bytes"] == plan.weight_bytes_per_device(cfg, 4, held_formats(path, True))
    assert "held_weights" not in floats and runs["stored"][2]["held_weights"]["label"].startswith("blocks as stored")


def test_roofline_weights_and_dtype_must_agree(files: dict[str, Path]) -> None:
    from benchmarks.cli import main  # meshserve-bench roofline

    with pytest.raises(SystemExit, match="--weights float32 and --dtype bfloat16 contradict"):
        main(
            [
                "roofline",
                "--model",
                str(files["F32"]),
                "--hardware",
                "h200",
                "--weights",
                "float32",
                "--dtype",
                "bfloat16",
            ]
        )
