"""Every mesh serves the same tokens as one device; bytes and collectives are as planned.

Runs on 8 CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set in
conftest.py before JAX is imported). Float32 throughout.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from test_golden import served

from model.config import LlamaConfig
from model.weights.loader import abstract_llama, load_gguf_model
from service.engine import kv_pool
from service.engine.config import EngineConfig
from service.engine.runner import Runner
from sharding.layouts import Layout, LayoutError, load_layout, preset_names
from sharding.plan import make_plan

MESHES = [(1, 1), (1, 2), (1, 3), (1, 4), (1, 8), (2, 4), (4, 2), (8, 1)]
ECFG = EngineConfig(num_slots=8, max_seq_len=128, chunk_size=64)
STEPS = 6
# Two prompts decoded side by side (token ids of SmolLM2's tokenizer): the scheduler gives them
# rows of two data replicas where the layout has several.
PROMPTS = [
    [504, 3575, 282, 4649, 314],  # "The capital of France is"
    [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
]


@pytest.fixture(scope="module")
def model(smollm2_gguf: Path):  # type: ignore[no-untyped-def]
    return load_gguf_model(smollm2_gguf)


def run_greedy(runner: Runner) -> tuple[list[list[int]], list[np.ndarray]]:
    """Both prompts served together, STEPS greedy ids each; ids and the logits of each one's
    last prompt token."""
    return served(runner, PROMPTS, STEPS)


@pytest.fixture(scope="module")
def reference(model):  # type: ignore[no-untyped-def]
    """One device's ids and logits (the native kernels where they are built)."""
    cfg, graphdef, params = model
    return run_greedy(Runner(cfg, graphdef, params, Layout("1x1"), ECFG, jax.devices()[:1]))


def kv_bytes(runner: Runner) -> dict[str, int]:
    """Bytes of the KV pool held by each device."""
    kv: dict[str, int] = {}
    for leaf in jax.tree.leaves(runner.cache):
        for shard in leaf.addressable_shards:
            kv[str(shard.device.id)] = kv.get(str(shard.device.id), 0) + shard.data.nbytes
    return kv


# Every mesh in the default layer loop (scanned, on CPU), and the unrolled loop (per-layer weights)
# on two (heads split; both axes).
CASES = [(d, m, "scan") for d, m in MESHES[1:]] + [(1, 3, "unrolled"), (2, 4, "unrolled")]


@pytest.mark.parametrize(("data", "tp", "layer_loop"), CASES, ids=[f"{d}x{m}-{loop}" for d, m, loop in CASES])
@pytest.mark.slow
def test_mesh_matches_one_device(model, reference, data: int, tp: int, layer_loop: str) -> None:  # type: ignore[no-untyped-def]
    """One device's ids and logits on every mesh (XLA's kernels there); each device holds the
    weight and KV bytes the plan predicts (split weights / TP, attention replicated when TP does
    not divide the 9/3 heads; pages over ``data``, KV heads over ``model`` where heads split)."""
    cfg, graphdef, params = model
    layout = Layout(f"{data}x{tp}", data=data, model=tp)
    runner = Runner(cfg, graphdef, params, layout, dataclasses.replace(ECFG, layer_loop=layer_loop))
    assert runner.kernels.layer_loop == layer_loop and not runner.kernels.attention.native
    ids, logits = run_greedy(runner)
    ref_ids, ref_logits = reference
    assert ids == ref_ids
    for got, want in zip(logits, ref_logits, strict=True):  # float32 sums in another order
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
    predicted = runner.plan.weight_bytes_per_device(cfg, 4)
    held = runner.weight_bytes_per_device()
    assert len(held) == data * tp and set(held.values()) == {predicted}
    assert runner.plan.attention == ("heads" if tp in (1, 3) else "replicated")
    split = tp if runner.plan.attention == "heads" else 1
    per_token = kv_pool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "float32", split)
    per_device = per_token * runner.ecfg.kv_cache_tokens // data  # each data replica its own pages
    kv = kv_bytes(runner)
    assert len(kv) == data * tp
    assert set(kv.values()) == {per_device} == {runner.pool_bytes_per_device}
    assert per_device == runner.plan.kv_bytes_per_device(cfg, runner.ecfg.kv_cache_tokens, "float32")


def test_weight_bytes_prediction_by_hand() -> None:
    """The numbers the layout presets quote, from the formula."""
    cfg = LlamaConfig(49152, 576, 1536, 30, 9, 3, 64, 1e5, 1e-5, 8192, True)
    total = cfg.param_count() * 4
    assert make_plan(Layout("1x1"), cfg).weight_bytes_per_device(cfg, 4) == total
    tp3 = make_plan(Layout("1x3", model=3, attention="heads"), cfg).weight_bytes_per_device(cfg, 4)
    norms = (2 * 30 + 1) * 576 * 4
    assert tp3 == (total - norms) // 3 + norms
    tp8 = make_plan(Layout("1x8", model=8), cfg)
    attention = 30 * 576 * 64 * (2 * 9 + 2 * 3) * 4
    assert tp8.attention == "replicated"
    assert tp8.weight_bytes_per_device(cfg, 4) == attention + (total - attention - norms) // 8 + norms


# ---- compiled decode step: collectives ------------------------------------------------------
def _computation(hlo: str, name: str) -> str:
    start = re.search(rf"^\s*%?{re.escape(name)} \(.*\{{\s*$", hlo, re.M)
    assert start, name
    end = hlo.index("\n}", start.end())
    return hlo[start.end() : end]


def _ops(text: str, op: str) -> list[str]:
    return re.findall(rf"= (\S+) {op}(?:-start)?\(", text)


def _compiled_decode(cfg: LlamaConfig, layout: Layout, layer_loop: str) -> tuple[Runner, str, Any]:
    """(runner, optimised HLO text of its decode-only step, the weights) for zero weights, with
    XLA's dots (float32 panels, one CPU device's form, would hide the stacked weights' shapes)."""
    graphdef, abstract = abstract_llama(cfg)  # only shapes matter here: zero weights
    params = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract)
    ecfg = dataclasses.replace(ECFG, layer_loop=layer_loop, matmul="xla")
    runner = Runner(cfg, graphdef, params, layout, ecfg, jax.devices()[: layout.num_devices])
    g = runner.geometry
    program = (g.decode_buckets[-1], 0, g.window_buckets[0])  # every row decoding
    b = runner.idle_batch(program)
    hlo = runner._jit(*program).lower(*runner._arguments(b, None))  # the step's arguments, as a step passes them
    return runner, hlo.compile().as_text(), params


def _assert_no_weight_all_gather(hlo: str, weight_shapes: set[tuple[int, ...]]) -> None:
    """No all-gather in ``hlo`` has the shape of a parameter."""
    for shape in _ops(hlo, "all-gather"):
        dims = tuple(int(d) for d in re.match(r"\w+\[([\d,]*)\]", shape).group(1).split(",") if d)  # type: ignore[union-attr]
        assert dims not in weight_shapes, f"all-gather of a weight-shaped array {shape}"


@pytest.mark.parametrize(
    ("data", "tp"), [(1, 1), (1, 3), (1, 4), (2, 4), (8, 1)], ids=["1x1", "1x3", "1x4", "2x4", "8x1"]
)
def test_decode_step_collectives(data: int, tp: int) -> None:
    # SmolLM2-135M's shapes with 4 layers (the collectives per layer do not depend on L).
    L = 4
    cfg = LlamaConfig(49152, 576, 1536, L, 9, 3, 64, 1e5, 1e-5, 8192, True)
    layout = Layout(f"{data}x{tp}", data=data, model=tp)
    runner, text, params = _compiled_decode(cfg, layout, "scan")

    # No weight is ever all-gathered: no all-gather result has the shape of a parameter.
    weight_shapes = {tuple(leaf.shape) for leaf in jax.tree.leaves(params)}
    weight_shapes |= {shape[1:] for shape in weight_shapes}  # per-layer weights (unrolled form)
    _assert_no_weight_all_gather(text, weight_shapes)

    # The layer loop is the while whose carry holds the stacked [L, ...] weights.
    loops = re.findall(r"while\([^)]*\), condition=%?[\w.\-]+, body=%?([\w.\-]+)", text)
    layer_bodies = [b for b in loops if re.search(rf"f32\[{L},576,", _computation(text, b))]
    assert len(layer_bodies) == 1
    per_layer = len(_ops(_computation(text, layer_bodies[0]), "all-reduce"))
    assert per_layer == runner.plan.all_reduces_per_layer == {1: 0, 3: 2, 4: 1}[tp]
    outside_layers = len(_ops(text, "all-reduce")) - per_layer

    # The unrolled form (the default on accelerators) has the same collectives: L times the loop body's.
    _, unrolled, _ = _compiled_decode(cfg, layout, "unrolled")
    assert not re.search(rf"f32\[{L},576,", unrolled)  # no stacked weights left
    assert len(_ops(unrolled, "all-reduce")) == outside_layers + L * per_layer
    _assert_no_weight_all_gather(unrolled, weight_shapes)


# ---- head counts that do not divide (case C17) ------------------------------------------------
@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.slow
def test_heads_layout_that_cannot_split_fails_at_startup_with_the_valid_sizes(model, tp: int) -> None:  # type: ignore[no-untyped-def]
    cfg, graphdef, params = model
    with pytest.raises(LayoutError) as err:
        Runner(cfg, graphdef, params, Layout(f"heads{tp}", model=tp, attention="heads"), ECFG)
    message = str(err.value)
    assert "9 query heads" in message and "3 KV heads" in message and "{1, 3}" in message


@pytest.mark.slow
def test_serve_with_heads_at_tp2_exits_at_startup_naming_the_head_counts(smollm2_gguf: Path, tmp_path: Path) -> None:
    """C17 through the real command: the process ends
    with status 1 and the message before it serves anything, not on the first request."""
    import os
    import subprocess
    import sys

    layout = tmp_path / "heads2.yaml"
    layout.write_text("name: heads2\ndata: 1\nmodel: 2\nattention: heads\n")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    cmd = [sys.executable, "-m", "service.server.cli", "serve", "--model", str(smollm2_gguf), "--layout", str(layout),
           "--port", "0", "--metrics-port", "0"]  # fmt: skip
    r = subprocess.run(
        cmd, cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 1, r.stderr[-2000:]
    assert "9 query heads and 3 KV heads" in r.stderr and "{1, 3}" in r.stderr, r.stderr[-2000:]
    assert "SERVING on" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
def test_data_axis_must_divide_slots(model) -> None:  # type: ignore[no-untyped-def]
    cfg, graphdef, params = model
    with pytest.raises(LayoutError, match="data axis"):
        Runner(cfg, graphdef, params, Layout("3x1", data=3), ECFG)


@pytest.mark.slow
def test_too_few_devices_is_a_clear_error(model) -> None:  # type: ignore[no-untyped-def]
    cfg, graphdef, params = model
    with pytest.raises(LayoutError, match="needs 16 devices"):
        Runner(cfg, graphdef, params, Layout("2x8", data=2, model=8), ECFG)


@pytest.mark.slow
def test_presets_load_and_resolve(model) -> None:  # type: ignore[no-untyped-def]
    cfg = model[0]
    names = preset_names()
    assert {"single", "latency", "throughput", "hybrid", "tp3"} <= set(names)
    resolved = {n: make_plan(load_layout(n), cfg).attention for n in names}
    assert resolved["latency"] == "replicated" and resolved["tp3"] == "heads"
    assert load_layout("latency").model == 8 and load_layout("throughput").data == 8
    # test_mesh_matches_one_device serves every preset's mesh (their attention: "auto", or
    # "heads" where it divides, which "auto" resolves to as well).
    assert {(load_layout(n).data, load_layout(n).model) for n in names} <= set(MESHES)
    with pytest.raises(LayoutError, match="presets: "):
        load_layout("no-such-layout")
