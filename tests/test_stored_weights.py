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
from reference import make, run
from test_golden import FIXTURE, first_difference, served
from tiny_gguf import write_tiny_llama_gguf

from model.config import LlamaConfig
from model.weights import quant_panels
from model.weights.build import llama_from_params
from model.weights.gguf_weights import WeightError, load_gguf_params, stored_matmuls
from model.weights.loader import load_model
from model.weights.quant_panels import QuantPanels
from service.engine.config import EngineConfig
from service.engine.loop import make_loop
from service.engine.runner import Runner
from service.server.app import ServerThread
from service.server.client import Client
from service.server.config import ServerConfig
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


# The engine's forms on one CPU device: the default (native attention, scanned layers; blocks by
# the native quantized kernel where built), the unrolled layer loop, and XLA's attention (and
# XLA's dots for the float weights).
FORMS = {"auto": {}, "unrolled": dict(layer_loop="unrolled"), "xla": dict(attention="xla", matmul="xla")}


def engines(path: Path) -> dict[str, Runner]:
    """Runners of the float model and of the stored one in each engine form, on one CPU device."""
    cfg = LlamaConfig.from_gguf(path)
    out = {}
    for name, stored in (("float", False), ("stored", True)):
        graphdef, state = llama_from_params(cfg, load_gguf_params(path, cfg, stored=stored))
        for form, modes in FORMS.items():
            ecfg = EngineConfig(num_slots=2, max_seq_len=64, chunk_size=16, page_size=8, max_num_batched_tokens=32,
                                **modes)  # fmt: skip
            out[f"{name}-{form}"] = Runner(cfg, graphdef, state, Layout("1x1"), ecfg)
    return out


def greedy(runner: Runner) -> list:
    """PROMPTS' greedy ids (N each) and finish reasons, served by ``runner`` behind its loop."""
    loop = make_loop(runner, max_queue=8)
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
    want = runs["float-auto"]
    assert all(len(ids) == N for ids, _ in want)
    for name, got in runs.items():
        assert got == want, name


def test_logits_of_a_prefill_equal_the_float_models(tiny_q41: Path) -> None:
    """The last prompt token's logits, and the greedy ids, of the stored model equal the float
    model's in every engine form."""
    logits = {name: served(runner, [PROMPTS[1]], N) for name, runner in engines(tiny_q41).items()}
    for form in FORMS:
        (ids,), (got,) = logits[f"stored-{form}"]
        (want_ids,), (want,) = logits[f"float-{form}"]
        # The same weights' values; only the float32 sums' order differs (a dot of 64 or 128 terms).
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0, err_msg=form)
        assert ids == want_ids, form


@pytest.mark.parametrize(("data", "tp"), [(1, 2), (2, 4), (8, 1), (1, 8)], ids=["1x2", "2x4", "8x1", "1x8"])
def test_every_mesh_gives_one_devices_ids(tiny_q41: Path, data: int, tp: int) -> None:
    """Stored blocks shard with the layout's rules (panels over the output heads, blocks over the
    input heads where they divide, else replicated) and give one device's ids."""
    cfg = LlamaConfig.from_gguf(tiny_q41)
    graphdef, state = llama_from_params(cfg, load_gguf_params(tiny_q41, cfg, stored=True))
    ecfg = EngineConfig(num_slots=8, max_seq_len=64, chunk_size=16, page_size=8, max_num_batched_tokens=32)
    one = greedy(Runner(cfg, graphdef, state, Layout("1x1"), ecfg))
    mesh = Runner(cfg, graphdef, state, Layout(f"{data}x{tp}", data=data, model=tp), ecfg)
    wqkv = mesh.params["layers"]["wqkv"].get_value()
    assert isinstance(wqkv, QuantPanels) and wqkv.kernel == "xla"  # the native kernel is one device's
    if tp == 2:  # 2 KV heads over 2 devices: each holds its heads' panels only
        assert {s.data.shape[1] for s in wqkv.codes.addressable_shards} == {wqkv.codes.shape[1] // 2}
    assert greedy(mesh) == one


def test_a_relayout_moves_the_blocks_and_rechooses_their_kernel(tiny_q41: Path) -> None:
    """A live switch's runner (``relayout``) takes the placed blocks to the new mesh, still
    blocks, and back on one device they are the native kernel's again where it is built."""
    from model.native import quant_matmul

    cfg = LlamaConfig.from_gguf(tiny_q41)
    graphdef, state = llama_from_params(cfg, load_gguf_params(tiny_q41, cfg, stored=True))
    ecfg = EngineConfig(num_slots=4, max_seq_len=64, chunk_size=16, page_size=8, max_num_batched_tokens=32)
    one = Runner(cfg, graphdef, state, Layout("1x1"), ecfg)
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
@pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])
def test_smollm2_stored_matches_the_golden_logits_and_ids(smollm2_stored, layer_loop: str) -> None:  # type: ignore[no-untyped-def]
    """The three golden prompts served together (the long one's two chunks beside the others'
    decode tokens), the blocks multiplied by the native kernel where it is built: transformers'
    last-token logits within 1e-3 and its 32 greedy ids."""
    cfg, graphdef, state = smollm2_stored
    with np.load(FIXTURE) as z:
        golden = {k: z[k] for k in z.files}
    ecfg = EngineConfig(num_slots=4, max_seq_len=1024, chunk_size=512, layer_loop=layer_loop)
    runner = Runner(cfg, graphdef, state, Layout("single"), ecfg)
    assert isinstance(runner.params["embed"].get_value(), QuantPanels)  # the Q8_0 table, as stored
    prompts = [golden[f"prompt_ids_{i}"].tolist() for i in range(3)]
    n = len(golden["greedy_0"])
    ids, logits = served(runner, prompts, n)
    for i in range(3):
        err = np.abs(logits[i] - golden[f"last_logits_{i}"]).max()
        assert err < 1e-3, f"prompt {i}: max |logit diff| {err:.2e}"
        want = golden[f"greedy_{i}"].tolist()
        assert ids[i] == want, f"prompt {i}: first difference at step {first_difference(ids[i], want)}"
