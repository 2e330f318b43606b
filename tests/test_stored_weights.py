"""GGUF weights served as stored (issue 20): Q8_0, Q4_0 and Q4_1 blocks kept, never dequantized
ahead of time, and multiplied at exactly their dequantized values.

The references are ``gguf.quants.dequantize`` (the blocks' values, bit for bit) and the float32
model loaded from the same file (``load_gguf_params`` without ``stored``, itself held to Hugging
Face by tests/test_golden.py): stored weights must give its greedy ids on every engine and
layout, and, on the real model, the golden logits within 1e-3.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from test_engine_penalties import make, run
from tiny_gguf import write_tiny_llama_gguf

from model.weights import quant_panels
from model.weights.build import llama_from_params
from model.config import LlamaConfig
from model.weights.gguf_weights import WeightError, load_gguf_params, stored_matmuls
from model.weights.loader import load_model
from model.weights.quant_panels import QuantPanels
from service.server.client import Client
from service.engine import Engine, EngineConfig
from service.paged_engine import PagedEngine
from service.paged_loop import engine_loop
from service.server import ServerConfig, ServerThread
from sharding.layouts import Layout

FORMATS = ["Q8_0", "Q4_0", "Q4_1"]
MATMULS = ("wqkv", "wo", "w_gate_up", "w_down")
_rng = np.random.default_rng(11)
PROMPTS = [_rng.integers(3, 264, n).tolist() for n in (9, 21)]  # not the specials (ids 0-2)
N = 10


@pytest.fixture(scope="module", params=FORMATS)
def quantized(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with every layer matmul in one block format (its embedding, 264 rows, is
    not whole 32-row panels and stays float32)."""
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("q") / f"{request.param}.gguf", quantize=request.param)


def both(path: Path) -> tuple[LlamaConfig, dict, dict]:
    cfg = LlamaConfig.from_gguf(path)
    return cfg, load_gguf_params(path, cfg), load_gguf_params(path, cfg, stored=True)


def test_stored_blocks_hold_exactly_the_dequantized_values_in_the_files_bytes(quantized: Path) -> None:
    cfg, floats, stored = both(quantized)
    fmt = quantized.stem.lower()
    assert stored_matmuls(quantized, cfg) == dict.fromkeys(MATMULS, fmt)
    reader = gguf.GGUFReader(str(quantized))
    matmul_bytes = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type != gguf.GGMLQuantizationType.F32)
    held = 0
    for name in MATMULS:
        w = stored["layers"][name]
        assert isinstance(w, QuantPanels) and w.format == fmt
        ref = floats["layers"][name]
        assert np.array_equal(np.asarray(quant_panels.dequantize(w)).reshape(ref.shape), ref), name
        held += w.nbytes
    assert held == matmul_bytes  # the blocks' bytes, regrouped: no copy, no widening
    for name in ("attn_norm", "mlp_norm"):
        assert np.array_equal(stored["layers"][name], floats["layers"][name])
    assert np.array_equal(stored["embed"], floats["embed"])  # float32 in the file: as before


def test_the_blocks_are_gguf_quants_values_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    for fmt in FORMATS:
        qtype = gguf.GGMLQuantizationType[fmt]
        rows = gguf.quants.quantize((rng.standard_normal((96, 160)) * 3).astype(np.float32), qtype)
        w = quant_panels.pack_rows(rows, fmt.lower(), 160, (96,))
        assert np.array_equal(np.asarray(quant_panels.dequantize(w)), gguf.quants.dequantize(rows, qtype).T), fmt
        picked = np.array([0, 31, 32, 95])
        want = gguf.quants.dequantize(rows, qtype)[picked]
        assert np.array_equal(np.asarray(quant_panels.dequantize_rows(w, picked)), want), fmt


def test_a_parameter_of_mixed_types_is_dequantized(tmp_path: Path) -> None:
    path = write_tiny_llama_gguf(tmp_path / "mixed.gguf", quantize={"attn_q.weight": "Q4_1", "ffn_down.weight": "Q8_0"})
    cfg, floats, stored = both(path)
    assert stored_matmuls(path, cfg) == {"w_down": "q8_0"}  # Q4_1 q with float32 k and v: no one format
    assert isinstance(stored["layers"]["w_down"], QuantPanels)
    assert np.array_equal(stored["layers"]["wqkv"], floats["layers"]["wqkv"])


def test_a_truncated_tensor_is_a_load_error_naming_it(quantized: Path, tmp_path: Path) -> None:
    reader = gguf.GGUFReader(str(quantized))
    cfg = LlamaConfig.from_gguf(quantized)
    i = next(i for i, t in enumerate(reader.tensors) if t.name == "blk.1.ffn_up.weight")
    reader.tensors[i] = reader.tensors[i]._replace(data=reader.tensors[i].data.reshape(-1)[:-7])  # cut short
    with pytest.raises(WeightError, match=r"blk\.1\.ffn_up\.weight"):
        load_gguf_params(reader, cfg, stored=True)


def engines(path: Path) -> dict[str, object]:
    """Loops of the stored model on the engine forms of one CPU device, and the float one."""
    cfg = LlamaConfig.from_gguf(path)
    ecfg = EngineConfig(num_slots=2, max_seq_len=64, chunk_size=16, page_size=8, max_num_batched_tokens=32)
    out = {}
    for name, stored in (("float", False), ("stored", True)):
        graphdef, state = llama_from_params(cfg, load_gguf_params(path, cfg, stored=stored))
        out[name] = PagedEngine(cfg, graphdef, state, Layout("1x1"), ecfg)
        if stored:
            for layers in ("scan", "unrolled"):
                e = EngineConfig(num_slots=2, max_seq_len=64, chunk_size=16, layers=layers, kv_cache="slots")
                out[f"stored-{layers}"] = Engine(cfg, graphdef, state, Layout("1x1"), e)
    return out


def greedy(engine: object) -> list:
    loop = engine_loop(engine, max_queue=8)  # type: ignore[arg-type]
    loop.start()
    try:
        assert loop.ready.wait(300)
        return run(loop, [make(p, N) for p in PROMPTS])
    finally:
        loop.stop()


@pytest.fixture(scope="module")
def tiny_q41(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("q41") / "q41.gguf", quantize="Q4_1")


def test_every_engine_form_gives_the_float_models_ids(tiny_q41: Path) -> None:
    runs = {name: greedy(e) for name, e in engines(tiny_q41).items()}
    assert all(len(ids) == N for ids, _ in runs["float"])
    for name, got in runs.items():
        assert got == runs["float"], name


def test_logits_of_a_prefill_equal_the_float_models(tiny_q41: Path) -> None:
    cfg = LlamaConfig.from_gguf(tiny_q41)
    ecfg = EngineConfig(num_slots=2, max_seq_len=64, chunk_size=32, kv_cache="slots", layers="scan")
    logits = {}
    for stored in (False, True):
        graphdef, state = llama_from_params(cfg, load_gguf_params(tiny_q41, cfg, stored=stored))
        logits[stored] = np.asarray(Engine(cfg, graphdef, state, Layout("1x1"), ecfg).prefill(0, PROMPTS[1], 0).logits)
    # The same weights' values; only the float32 sums' order differs (a dot of 64 or 128 terms).
    np.testing.assert_allclose(logits[True], logits[False], atol=2e-5, rtol=0)


@pytest.mark.parametrize(("data", "tp"), [(1, 2), (2, 4), (8, 1), (1, 8)], ids=["1x2", "2x4", "8x1", "1x8"])
def test_every_mesh_gives_one_devices_ids(tiny_q41: Path, data: int, tp: int) -> None:
    """Stored blocks shard with the layout's rules (panels over the output heads, blocks over the
    input heads where they divide, else replicated) and give one device's ids."""
    cfg = LlamaConfig.from_gguf(tiny_q41)
    graphdef, state = llama_from_params(cfg, load_gguf_params(tiny_q41, cfg, stored=True))
    ecfg = EngineConfig(num_slots=8, max_seq_len=64, chunk_size=16, page_size=8, max_num_batched_tokens=32)
    one = greedy(PagedEngine(cfg, graphdef, state, Layout("1x1"), ecfg))
    mesh = PagedEngine(cfg, graphdef, state, Layout(f"{data}x{tp}", data=data, model=tp), ecfg)
    wqkv = mesh.params["layers"]["wqkv"].get_value()
    assert isinstance(wqkv, QuantPanels) and wqkv.kernel == "xla"  # the native kernel is one device's
    if tp == 2:  # 2 KV heads over 2 devices: each holds its heads' panels only
        assert {s.data.shape[1] for s in wqkv.codes.addressable_shards} == {wqkv.codes.shape[1] // 2}
    assert greedy(mesh) == one


def test_a_relayout_moves_the_blocks_and_rechooses_their_kernel(tiny_q41: Path) -> None:
    """A live switch's engine (``relayout``) takes the placed blocks to the new mesh, still
    blocks, and back on one device they are the native kernel's again where it is built."""
    from model.native import quant_matmul

    cfg = LlamaConfig.from_gguf(tiny_q41)
    graphdef, state = llama_from_params(cfg, load_gguf_params(tiny_q41, cfg, stored=True))
    ecfg = EngineConfig(num_slots=4, max_seq_len=64, chunk_size=16, page_size=8, max_num_batched_tokens=32)
    one = PagedEngine(cfg, graphdef, state, Layout("1x1"), ecfg)
    native = "native" if quant_matmul.available() else "xla"
    assert one.params["layers"]["w_down"].get_value().kernel == native
    want = greedy(one)
    two = one.relayout(Layout("1x2", data=1, model=2), jax.devices()[:2])
    w_down = two.params["layers"]["w_down"].get_value()
    assert isinstance(w_down, QuantPanels) and w_down.kernel == "xla" and len(w_down.codes.sharding.device_set) == 2
    assert greedy(two) == want
    back = two.relayout(Layout("1x1"), jax.devices()[:1])
    assert back.params["layers"]["w_down"].get_value().kernel == native and greedy(back) == want


def test_a_server_reports_how_it_holds_the_weights(tiny_q41: Path) -> None:
    ecfg = EngineConfig(num_slots=2, max_seq_len=64, chunk_size=16, weights="stored")
    srv = ServerThread(ServerConfig(model=str(tiny_q41), port=0, metrics_port=0, engine=ecfg)).start()
    try:
        info = Client(srv.address).model_info()
        assert info.weights == "stored"
        assert dict(info.weight_formats) == dict.fromkeys(MATMULS, "q4_1")
        reader = gguf.GGUFReader(str(tiny_q41))
        assert info.weight_bytes == sum(int(t.n_bytes) for t in reader.tensors)  # the file's tensors, as they are
    finally:
        srv.stop()
    floats = EngineConfig(num_slots=2, max_seq_len=64, chunk_size=16, weights="float32")
    srv = ServerThread(ServerConfig(model=str(tiny_q41), port=0, metrics_port=0, engine=floats)).start()
    try:
        info = Client(srv.address).model_info()
        assert (info.weights, dict(info.weight_formats), info.dtype) == ("float32", {}, "float32")
    finally:
        srv.stop()


def test_weights_names_a_dtype_or_stored() -> None:
    assert EngineConfig(weights="bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="weights must be one of"):
        EngineConfig(weights="int4")


# ---- the real model -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_stored(smollm2_gguf: Path):  # type: ignore[no-untyped-def]
    loaded = load_model(smollm2_gguf, stored=True)
    return loaded.cfg, loaded.graphdef, loaded.state


@pytest.mark.slow
def test_smollm2_blocks_equal_its_dequantized_weights(smollm2_model, smollm2_stored, smollm2_gguf: Path) -> None:  # type: ignore[no-untyped-def]
    cfg, _, floats = smollm2_model
    _, _, stored = smollm2_stored
    assert stored_matmuls(smollm2_gguf, cfg) == {**dict.fromkeys(MATMULS, "q4_1"), "embed": "q8_0"}
    deq = jax.jit(quant_panels.dequantize)
    for name in MATMULS:
        ref = floats["layers"][name].get_value()
        got = deq(stored["layers"][name].get_value())
        assert np.array_equal(np.asarray(got).reshape(ref.shape), ref), name
    assert np.array_equal(np.asarray(deq(stored["embed"].get_value())).T, floats["embed"].get_value())
    held = sum(leaf.nbytes for leaf in jax.tree.leaves(stored))
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(smollm2_gguf)).tensors)
    assert held == file_bytes  # the GGUF's tensor bytes, 1.0x (float32: 538 MB)


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache", ["paged", "slots"])
def test_smollm2_stored_matches_the_golden_logits_and_ids(smollm2_stored, kv_cache: str) -> None:  # type: ignore[no-untyped-def]
    from test_golden import FIXTURE, greedy_run

    cfg, graphdef, state = smollm2_stored
    with np.load(FIXTURE) as z:
        golden = {k: z[k] for k in z.files}
    if kv_cache == "slots":  # the unrolled form: the native kernels' path where they are built
        ecfg = EngineConfig(num_slots=2, max_seq_len=1024, chunk_size=512, layers="unrolled")
        engine = Engine(cfg, graphdef, state, Layout("single"), ecfg)
        for i in range(3):
            logits, ids = greedy_run(engine, golden[f"prompt_ids_{i}"].tolist(), len(golden[f"greedy_{i}"]))
            err = np.abs(logits - golden[f"last_logits_{i}"]).max()
            assert err < 1e-3, f"prompt {i}: max |logit diff| {err:.2e}"
            assert ids == golden[f"greedy_{i}"].tolist(), i
        return
    ecfg = EngineConfig(num_slots=4, max_seq_len=1024, chunk_size=512)
    loop = engine_loop(PagedEngine(cfg, graphdef, state, Layout("single"), ecfg), max_queue=8)
    loop.start()
    try:
        assert loop.ready.wait(600)
        prompts = [golden[f"prompt_ids_{i}"].tolist() for i in range(3)]
        got = run(loop, [make(p, len(golden[f"greedy_{i}"]), eos=frozenset()) for i, p in enumerate(prompts)])
    finally:
        loop.stop()
    for i, (ids, _) in enumerate(got):
        assert ids == golden[f"greedy_{i}"].tolist(), i
