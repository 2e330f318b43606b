"""The kernel seam: where an engine's choice of XLA's paths or the native CPU kernels is made
(``model.kernels.choose``), the form it puts the weights in (``to_form``), the matmul dispatch by
weight form (``model.matmul``), and that the model file names no kernel and no platform."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_quant_matmul import random_blocks

from model import kernels, sampling
from model.attention import cpu as cpu_attention
from model.attention.xla import XlaAttention
from model.config import LlamaConfig
from model.kernels import Kernels, choose, keeps_blocks, one_cpu, to_form
from model.matmul import embedding_rows, has_packed, matmul, split_stacked, with_stacked
from model.native import cpu_argmax, cpu_matmul, quant_matmul
from model.weights import quant_panels
from model.weights.build import random_block_llama, random_llama
from model.weights.quant_panels import QuantPanels

CFG = LlamaConfig.tiny()
F32, BF16 = jnp.float32, jnp.bfloat16
ONE, TWO = jax.devices()[:1], jax.devices()[:2]
ON_CPU = ONE[0].platform == "cpu"
ATTENTION_BUILT = ON_CPU and cpu_attention.available() and cpu_attention.supports(CFG.q_per_kv, CFG.head_dim, F32)
PANELS_BUILT = ON_CPU and cpu_matmul.available()


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """An accelerator as ``choose`` sees one: only its platform is read."""

    platform: str
    id: int = 0


def native_attention(k: Kernels) -> bool:
    return isinstance(k.attention, cpu_attention.NativeCpuAttention)


# ---- choose ----------------------------------------------------------------------------------
def test_one_cpu_device_runs_the_native_kernels_where_they_are_built() -> None:
    assert len(TWO) == 2, "the suite runs with 8 CPU devices"
    assert one_cpu(ONE) == ON_CPU and not one_cpu(TWO)
    k = choose(ONE, CFG, F32, F32)
    assert native_attention(k) == ATTENTION_BUILT and k.attention.native == ATTENTION_BUILT
    assert k.panels == PANELS_BUILT
    assert k.quant_kernel == ("native" if ON_CPU and quant_matmul.available() else "xla")
    assert k.argmax is (cpu_argmax.first_argmax if ON_CPU and cpu_argmax.available() else sampling.first_argmax)
    assert k.layer_loop == ("scan" if ON_CPU else "unrolled")
    assert k.attention.name in k.describe() and k.layer_loop in k.describe()


def test_several_devices_run_xlas_paths() -> None:
    k = choose(TWO, CFG, F32, F32)
    assert isinstance(k.attention, XlaAttention) and not k.attention.native
    assert not k.panels and k.quant_kernel == "xla" and k.argmax is sampling.first_argmax
    assert k.layer_loop == "scan"  # auto: scan on CPU devices, however many


def test_asking_for_xla_keeps_xlas_paths_on_one_cpu_device() -> None:
    k = choose(ONE, CFG, F32, F32, attention="xla")
    assert isinstance(k.attention, XlaAttention)
    assert k.panels == PANELS_BUILT  # the matmuls' mode is its own
    k = choose(ONE, CFG, F32, F32, matmul="xla")
    assert not k.panels and native_attention(k) == ATTENTION_BUILT


def test_attention_the_kernels_do_not_take_keeps_xlas_path() -> None:
    odd_head = dataclasses.replace(CFG, head_dim=CFG.head_dim + 8)  # not a multiple of 16
    assert isinstance(choose(ONE, odd_head, F32, F32).attention, XlaAttention)
    wide_group = LlamaConfig.tiny(num_heads=18, num_kv_heads=2)  # 9 query heads per KV head
    assert isinstance(choose(ONE, wide_group, F32, F32).attention, XlaAttention)
    assert isinstance(choose(ONE, CFG, F32, jnp.float16).attention, XlaAttention)
    assert native_attention(choose(ONE, CFG, F32, BF16)) == ATTENTION_BUILT  # a bfloat16 cache is read


@pytest.mark.parametrize(
    ("dtype", "layer_loop", "matmul", "devices", "panels"),
    [
        (F32, "auto", "auto", ONE, True),
        (F32, "scan", "auto", ONE, True),
        (F32, "unrolled", "auto", ONE, False),  # the kernels read a stack in place at the scan's index
        (BF16, "auto", "auto", ONE, False),
        (F32, "auto", "xla", ONE, False),
        (F32, "auto", "auto", TWO, False),
    ],
)
def test_panels_only_with_float32_the_scan_and_matmul_auto_on_one_cpu_device(
    dtype: jnp.dtype, layer_loop: str, matmul: str, devices: list, panels: bool
) -> None:
    k = choose(devices, CFG, dtype, dtype, matmul=matmul, layer_loop=layer_loop)
    assert k.panels == (panels and PANELS_BUILT)
    assert k.layer_loop == ("unrolled" if layer_loop == "unrolled" or not ON_CPU else "scan")


def test_layer_loop_auto_is_unrolled_on_accelerators_and_explicit_modes_are_kept() -> None:
    gpu = [FakeDevice("gpu")]
    k = choose(gpu, CFG, F32, F32)
    assert k.layer_loop == "unrolled" and isinstance(k.attention, XlaAttention)
    assert not k.panels and k.quant_kernel == "xla" and k.argmax is sampling.first_argmax
    assert choose(gpu, CFG, F32, F32, layer_loop="scan").layer_loop == "scan"
    assert choose(ONE, CFG, F32, F32, layer_loop="unrolled").layer_loop == "unrolled"
    assert choose([FakeDevice("tpu")], CFG, BF16, BF16).layer_loop == "unrolled"


@pytest.mark.parametrize("field", ["attention", "matmul", "layer_loop"])
def test_unknown_modes_are_refused_naming_the_field(field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be one of .*got 'fast'"):
        choose(ONE, CFG, F32, F32, **{field: "fast"})


def test_keeps_blocks_only_on_one_cpu_device_per_pool_where_the_kernel_is_built() -> None:
    assert keeps_blocks("cpu", [1]) == quant_matmul.available()
    assert keeps_blocks("cpu", [1, 1]) == quant_matmul.available()
    assert not keeps_blocks("cpu", [1, 2])
    assert not keeps_blocks("gpu", [1])


# ---- to_form ---------------------------------------------------------------------------------
def form(kernels_: Kernels, panels: bool, layer_loop: str, quant_kernel: str = "xla") -> Kernels:
    return dataclasses.replace(kernels_, panels=panels, layer_loop=layer_loop, quant_kernel=quant_kernel)


BASE = choose(TWO, CFG, F32, F32)  # XLA's paths; ``form`` sets the fields to_form reads


def leaves(state: nnx.State, packed_head: bool = False) -> dict[str, np.ndarray]:
    """The state's arrays by path, as numpy (a per-layer tuple stacked back, Panels unpacked):
    the values a form holds, whatever the form; ``packed_head``: leave out the packed head a tied
    model gains (the table's transpose, checked by test_cpu_matmul.py)."""
    out: dict[str, np.ndarray] = {}
    flat = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, cpu_matmul.Panels | tuple)
    )[0]  # fmt: skip
    for path, value in flat:
        name = jax.tree_util.keystr(path)
        if packed_head and "lm_head" in name:
            continue
        if isinstance(value, tuple):
            value = np.stack([np.asarray(v) for v in value])
        elif isinstance(value, cpu_matmul.Panels):
            value = cpu_matmul.unpack(value)
        out[name] = np.asarray(value)
    return out


def param_types(graphdef: nnx.GraphDef, state: nnx.State) -> dict[str, type]:
    model = nnx.merge(graphdef, state)
    out = {n: type(v) for n, v in model.layers.weights().items()}
    if hasattr(model, "lm_head"):
        out["lm_head"] = type(model.lm_head.get_value())
    return out


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_to_form_round_trips_between_stacked_unrolled_and_panels(tied: bool) -> None:
    """Stacked -> panels -> unrolled -> stacked -> unrolled -> panels -> stacked: every form
    holds exactly the weights it started with; the panels form packs the four matmul weights and
    the head (a tied model gains ``lm_head`` and loses it again), the unrolled one holds
    per-layer tuples."""
    cfg = LlamaConfig.tiny(tie_word_embeddings=tied)
    graphdef, state = random_llama(cfg, seed=2)
    want = leaves(state)

    g, s = to_form(graphdef, state, form(BASE, True, "scan"))
    types = param_types(g, s)
    assert all(types[n] is cpu_matmul.Panels for n in ("wqkv", "wo", "w_gate_up", "w_down", "lm_head"))
    assert types["attn_norm"] is not cpu_matmul.Panels and (g != graphdef) == tied
    assert has_packed(s, cpu_matmul.Panels) and not has_packed(s)
    got = leaves(s, packed_head=tied)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)

    for kernels_ in (form(BASE, False, "unrolled"), form(BASE, False, "scan"), form(BASE, False, "unrolled"),
                     form(BASE, True, "scan"), form(BASE, False, "scan")):  # fmt: skip
        g, s = to_form(g, s, kernels_)
        unrolled = kernels_.layer_loop == "unrolled"
        assert nnx.merge(g, s).layers.per_layer() == unrolled
        assert has_packed(s, cpu_matmul.Panels) == kernels_.panels
        assert (g == graphdef) == (not kernels_.panels or not tied)
        got = leaves(s, packed_head=kernels_.panels and tied)
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    if unrolled:
        assert len(nnx.merge(g, s).layers.wqkv.get_value()) == cfg.num_layers


def test_to_form_marks_stored_blocks_with_their_kernel_and_never_packs_them() -> None:
    graphdef, state = random_block_llama(CFG, seed=4, fmt="q4_0")
    for quant_kernel in ("native", "xla"):
        g, s = to_form(graphdef, state, form(BASE, True, "scan", quant_kernel))
        blocks = [
            v for v in jax.tree.leaves(s, is_leaf=lambda x: isinstance(x, QuantPanels)) if isinstance(v, QuantPanels)
        ]
        assert blocks and all(b.kernel == quant_kernel for b in blocks)
        assert has_packed(s) and not has_packed(s, cpu_matmul.Panels) and g == graphdef
    g, s = to_form(graphdef, state, form(BASE, False, "unrolled", "xla"))
    assert nnx.merge(g, s).layers.per_layer() and has_packed(s)


# ---- model.matmul: dispatch by weight form ------------------------------------------------------
def test_matmul_dispatches_by_weight_form() -> None:
    """An array, float32 panels and stored blocks (either kernel) give the same product, each
    against float64 on the weight's float values."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    want = x.astype(np.float64) @ w
    np.testing.assert_allclose(np.asarray(matmul(jnp.asarray(x), jnp.asarray(w), "MK,KN->MN")), want, atol=1e-4)
    if cpu_matmul.available():
        panels = cpu_matmul.pack(jnp.asarray(w.reshape(64, 3, 32)), 1)  # outputs take out_shape (3, 32)
        got = np.asarray(matmul(jnp.asarray(x[None]), panels, "unused"))
        assert got.shape == (1, 5, 3, 32)
        np.testing.assert_allclose(got.reshape(5, 96), want, atol=1e-4)
    raw = random_blocks(rng, "q8_0", 96, 64)
    q = jax.tree.map(jnp.asarray, quant_panels.pack_rows(raw, "q8_0", 64, (96,)))
    wq = np.asarray(quant_panels.dequantize(q), np.float64)
    for kernel in ["xla", "native"] if quant_matmul.available() else ["xla"]:
        got = np.asarray(matmul(jnp.asarray(x), dataclasses.replace(q, kernel=kernel), "unused"))
        np.testing.assert_allclose(got, x.astype(np.float64) @ wq, rtol=1e-5, atol=1e-3)


def test_stacked_packed_weights_pass_a_scan_whole_with_their_layer() -> None:
    """``split_stacked`` keeps packed stacks out of the scan's slices; ``with_stacked`` hands one
    layer's weights back: each layer's product is that layer's matrix's."""
    rng = np.random.default_rng(8)
    L, K, N = 3, 32, 64
    w = rng.standard_normal((L, K, N)).astype(np.float32)
    norm = rng.standard_normal((L, K)).astype(np.float32)
    x = rng.standard_normal((2, K)).astype(np.float32)
    stacked_w = cpu_matmul.pack_stacked(jnp.asarray(w), 1) if cpu_matmul.available() else jnp.asarray(w)
    sliced, stacked = split_stacked({"w": stacked_w, "norm": jnp.asarray(norm)})
    assert set(sliced) == ({"norm"} if cpu_matmul.available() else {"norm", "w"})

    def body(_: None, xs: tuple) -> tuple[None, jax.Array]:
        p, layer = xs
        p = with_stacked(p, stacked, layer)
        return None, matmul(jnp.asarray(x) * p["norm"], p["w"], "MK,KN->MN")

    _, ys = jax.jit(lambda: jax.lax.scan(body, None, (sliced, jnp.arange(L, dtype=jnp.int32))))()
    for i in range(L):
        want = (x * norm[i]).astype(np.float64) @ w[i]
        np.testing.assert_allclose(np.asarray(ys[i]), want, rtol=1e-5, atol=1e-4)


def test_embedding_rows_of_a_float_table_and_of_stored_blocks() -> None:
    rng = np.random.default_rng(9)
    table = rng.standard_normal((50, 64)).astype(np.float32)
    tokens = jnp.asarray([3, 0, 49, 3], jnp.int32)
    np.testing.assert_array_equal(np.asarray(embedding_rows(jnp.asarray(table), tokens)), table[[3, 0, 49, 3]])
    raw = random_blocks(rng, "q8_0", 64, 64)  # a table of 64 rows of 64, stored transposed as [D, V]
    q = jax.tree.map(jnp.asarray, quant_panels.pack_rows(raw, "q8_0", 64, (64,)))
    dense = np.asarray(quant_panels.dequantize(q))  # [D=64, V=64]
    np.testing.assert_array_equal(np.asarray(embedding_rows(q, tokens)), dense.T[[3, 0, 49, 3]])


# ---- the model file -----------------------------------------------------------------------------
KERNEL_MODULES = {
    "model.kernels",  # the platform choice: the engine reads it, the model does not
    "model.native",
    "model.attention.cpu",
    "model.attention.xla",
    "model.weights.quant_panels",
    "model.weights.packed_weights",
}
PLATFORM_NAMES = {"platform", "devices", "local_devices", "default_backend", "one_cpu"}


def test_the_model_file_names_no_kernel_and_no_platform() -> None:
    """``model/llama.py`` imports no kernel module (every matmul goes through ``model.matmul``,
    attention through the backend it is passed) and asks nothing of the platform."""
    path = Path(__file__).resolve().parent.parent / "model" / "llama.py"
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    kernel_imports = {m for m in imported if any(m == k or m.startswith(k + ".") for k in KERNEL_MODULES)}
    assert not kernel_imports, kernel_imports
    assert {"model.matmul", "model.attention.base"} <= imported  # the two seams
    named = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    named |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not named & PLATFORM_NAMES, named & PLATFORM_NAMES
    assert kernels.__name__ == "model.kernels"  # the seam's module exists where the list says
