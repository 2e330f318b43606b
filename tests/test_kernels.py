"""The kernel seam (``model.kernels``): where each engine's choice of XLA's or the native CPU
kernels is made, the matmul dispatch by weight form, and that the model file names no kernel."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_quant_matmul import random_blocks

from model import cpu_attention, kernels
from model.native import cpu_matmul, cpu_paged_attention, quant_matmul
from model.weights import quant_panels
from model.config import LlamaConfig
from model.kernels import NATIVE_CPU, XLA, choose_attention, choose_quant_kernel, matmul
from model.weights.loader import random_llama

CFG = LlamaConfig.tiny()


@pytest.mark.parametrize("cache", ["blocked", "paged"])
def test_choose_attention_native_only_on_one_cpu_device_when_asked_and_built(cache: str) -> None:
    module = {"blocked": cpu_attention, "paged": cpu_paged_attention}[cache]
    built = module.available() and module.supports(CFG.q_per_kv, CFG.head_dim, jnp.float32)
    one, two = jax.devices()[:1], jax.devices()[:2]
    assert len(two) == 2, "the suite runs with 8 CPU devices"
    assert choose_attention(cache, one, "auto", CFG, jnp.float32) is (NATIVE_CPU if built else XLA)
    assert choose_attention(cache, one, "xla", CFG, jnp.float32) is XLA
    assert choose_attention(cache, two, "auto", CFG, jnp.float32) is XLA
    # A head size the kernels do not take keeps XLA's path.
    odd = dataclasses.replace(CFG, head_dim=CFG.head_dim + 1)
    assert choose_attention(cache, one, "auto", odd, jnp.float32) is XLA
    assert choose_attention("dense", one, "auto", CFG, jnp.float32) is XLA
    assert NATIVE_CPU.native and not XLA.native and NATIVE_CPU.name != XLA.name


def test_choose_quant_kernel_by_devices() -> None:
    raw = random_blocks(np.random.default_rng(0), "q4_0", 64, 32)
    params = {"w_down": quant_panels.pack_rows(raw, "q4_0", 32, (64,)), "norm": np.ones(4, np.float32)}
    state, kernel = choose_quant_kernel(params, jax.devices()[:1])
    assert kernel == ("native" if quant_matmul.available() else "xla")
    assert state["w_down"].kernel == kernel and state["norm"] is params["norm"]
    state, kernel = choose_quant_kernel(params, jax.devices()[:2])
    assert kernel == "xla" and state["w_down"].kernel == "xla"
    assert kernels.has_stored_blocks(state) and not kernels.has_stored_blocks(random_llama(CFG, seed=0)[1])


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


def test_the_model_file_names_no_kernel() -> None:
    """``model/llama.py`` imports no platform kernel: every kernel call goes through the seam."""
    tree = ast.parse(Path(__file__).resolve().parent.parent.joinpath("model", "llama.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    kernel_modules = {
        f"model.{m}"
        for m in (
            "cpu_attention", "cpu_paged_attention", "cpu_matmul", "cpu_argmax", "quant_matmul",
            "native_kernels", "paged_attention", "quant_panels",
        )
    }  # fmt: skip
    assert not imported & kernel_modules, imported & kernel_modules
    assert "model.kernels" in imported
