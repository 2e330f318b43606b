"""The record formats (Q5_0, Q4_K, Q5_K, Q6_K: ``model.weights.record_panels``) against
``gguf.quants``: the values held equal its dequantization bit for bit, alone and in the formats
that hold mixes (Q4_K/Q5_K/Q6_K as Q6_K, Q4_0/Q5_0 as Q8_0), and the native kernel's products
equal float64 products of them on odd shapes, batch 1 to 512, both of its paths, stacked weights
with a traced layer index; a truncated tensor is a load error naming it."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_gguf import random_rows

from model import native
from model.native import quant_matmul
from model.weights import quant_panels, record_panels
from model.weights.quant_panels import QuantPanels
from model.weights.record_panels import RECORD_FORMATS

TYPES = {name: gguf.GGMLQuantizationType(spec.ggml_type) for name, spec in RECORD_FORMATS.items()}
needs_kernels = pytest.mark.skipif(
    not native.available(), reason="the native kernels are not built here (not x86-64, or no compiler)"
)


def reference(raw: np.ndarray, fmt: str) -> np.ndarray:
    """W [K, N] float32 by gguf.quants from the stored rows."""
    return np.asarray(gguf.quants.dequantize(raw, TYPES[fmt])).T


def panels(raws: list[tuple[np.ndarray, str]], k: int, fmt: str) -> QuantPanels:
    codes = [record_panels.convert(record_panels.decode(raw, src, k), fmt) for raw, src in raws]
    n = sum(c.q.shape[0] for c in codes)
    return quant_panels.pack_records(record_panels.concatenate(codes), (n,))


@pytest.mark.parametrize("fmt", list(RECORD_FORMATS))
@pytest.mark.parametrize("wide", [False, True])
def test_dequantize_equals_gguf_bitwise(fmt: str, wide: bool) -> None:
    raw = random_rows(np.random.default_rng(1), fmt, 96, 512, wide)
    w = jax.tree.map(jnp.asarray, panels([(raw, fmt)], 512, fmt))
    got = np.asarray(quant_panels.dequantize(w))
    want = reference(raw, fmt)
    assert got.shape == want.shape == (512, 96) and w.k == 512 and w.n == 96
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    rows = np.array([0, 95, 33, 33, 64])
    np.testing.assert_array_equal(np.asarray(quant_panels.dequantize_rows(w, jnp.asarray(rows))), want.T[rows])
    rows = np.array([[1, 2, 94], [31, 32, 63]])  # [batch, tokens], as a prefill's lookup
    got_rows = np.asarray(jax.jit(quant_panels.dequantize_rows)(w, jnp.asarray(rows)))
    np.testing.assert_array_equal(got_rows.view(np.uint32), want.T[rows].view(np.uint32))


@pytest.mark.parametrize(
    ("sources", "held"),
    [
        (("q4_k", "q6_k"), "q6_k"),  # Q4_K_M's ffn_down and attn_v
        (("q4_k", "q5_k"), "q5_k"),
        (("q5_k", "q6_k", "q4_k"), "q6_k"),
    ],
)
def test_a_mix_is_held_exactly(sources: tuple[str, ...], held: str) -> None:
    from model.weights.gguf_weights import held_as

    assert held_as(set(sources)) == held
    rng = np.random.default_rng(2)
    raws = [(random_rows(rng, src, 32, 256), src) for src in sources]
    got = np.asarray(quant_panels.dequantize(jax.tree.map(jnp.asarray, panels(raws, 256, held))))
    want = np.concatenate([reference(raw, src) for raw, src in raws], axis=1)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_q5_0_and_q4_0_with_q8_0_are_held_as_q8_0() -> None:
    from model.weights.gguf_weights import held_as

    assert held_as({"q8_0", "q5_0"}) == held_as({"q4_0", "q5_0"}) == "q8_0"
    assert held_as({"q5_0", "q4_k"}) is None and held_as({"q4_1", "q8_0"}) is None
    rng = np.random.default_rng(3)
    q5 = random_rows(rng, "q5_0", 32, 96)
    q4 = rng.integers(0, 256, (32, 3 * 18), dtype=np.uint8)
    q4.reshape(32, 3, 18)[..., 0:2] = (rng.standard_normal((32, 3, 1)) * 1e-2).astype(np.float16).view(np.uint8)
    raw = np.concatenate([quant_panels.as_q8_0(q5, "q5_0", 96), quant_panels.as_q8_0(q4, "q4_0", 96)])
    got = np.asarray(quant_panels.dequantize(jax.tree.map(jnp.asarray, quant_panels.pack_rows(raw, "q8_0", 96, (64,)))))
    want = np.concatenate([reference(q5, "q5_0"), gguf.quants.dequantize(q4, gguf.GGMLQuantizationType.Q4_0).T], 1)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_a_truncated_or_mis_sized_row_is_an_error() -> None:
    raw = random_rows(np.random.default_rng(4), "q4_k", 4, 512)
    with pytest.raises(ValueError, match="need 288 bytes"):
        record_panels.decode(raw[:, :-1], "q4_k", 512)
    with pytest.raises(ValueError, match="not whole 256-weight blocks"):
        record_panels.decode(raw, "q4_k", 500)


def tolerance(x: np.ndarray, want_abs: np.ndarray) -> np.ndarray:
    """A float32 dot of length K against float64: about sqrt(K) roundings of the partial sums,
    bounded by 1e-5 sqrt(K) times sum |x| |w| (the direct path sums x q per half-block and x
    apart before scaling, so its terms are of that size); a weight misread moves an output by
    about |x| |w|, which is far more for these shapes."""
    k = x.shape[1]
    return 1e-5 * np.sqrt(k) * want_abs + 1e-30


@needs_kernels
@pytest.mark.parametrize(
    ("m", "k", "n"),
    [(1, 768, 1536), (2, 256, 32), (3, 512, 160), (7, 256, 96), (8, 768, 32), (16, 256, 160), (17, 512, 96),
     (64, 256, 32), (511, 256, 96), (512, 512, 32)],
)  # fmt: skip
@pytest.mark.parametrize("fmt", list(RECORD_FORMATS))
@pytest.mark.parametrize("path", ["direct", "dequantized"])
def test_native_matmul_matches_float64(fmt: str, m: int, k: int, n: int, path: str) -> None:
    rng = np.random.default_rng(m + k + n)
    raw = random_rows(rng, fmt, n, k)
    w = jax.tree.map(jnp.asarray, panels([(raw, fmt)], k, fmt))
    x = rng.standard_normal((m, k)).astype(np.float32)
    ref = reference(raw, fmt).astype(np.float64)
    want = x.astype(np.float64) @ ref
    y = jax.jit(quant_matmul.matmul, static_argnames="path")(jnp.asarray(x), w, path=path)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    atol = tolerance(x, np.abs(x.astype(np.float64)) @ np.abs(ref))
    assert np.all(np.abs(np.asarray(y, np.float64) - want) <= atol)


@needs_kernels
def test_native_matmul_of_a_mixed_stack_by_traced_layer() -> None:
    """A Q6_K stack whose layers were Q4_K, Q6_K and Q5_K (a Q4_K_M file's ffn_down): each layer
    picked by a traced index inside lax.scan gives its own layer's product."""
    rng = np.random.default_rng(9)
    K, N, M = 512, 96, 3
    raws = [(random_rows(rng, src, N, K), src) for src in ("q4_k", "q6_k", "q5_k")]
    stack = jax.tree.map(jnp.asarray, quant_panels.stack([panels([r], K, "q6_k") for r in raws]))
    x = rng.standard_normal((M, K)).astype(np.float32)

    def body(carry: jax.Array, i: jax.Array) -> tuple[jax.Array, jax.Array]:
        return carry, quant_matmul.matmul(jnp.asarray(x), stack, i)

    _, ys = jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32)))()
    for i, (raw, src) in enumerate(raws):
        ref = reference(raw, src).astype(np.float64)
        atol = tolerance(x, np.abs(x.astype(np.float64)) @ np.abs(ref))
        assert np.all(np.abs(np.asarray(ys[i], np.float64) - x.astype(np.float64) @ ref) <= atol), src


@needs_kernels
@pytest.mark.parametrize("fmt", list(RECORD_FORMATS))
def test_native_agrees_with_xla_on_wide_scales(fmt: str) -> None:
    """Every finite float16 pattern as d and dmin: the kernel's widening is exact, and its
    products are XLA's up to rounding."""
    rng = np.random.default_rng(5)
    raw = random_rows(rng, fmt, 64, 512, wide=True)
    w = jax.tree.map(jnp.asarray, panels([(raw, fmt)], 512, fmt))
    ref = reference(raw, fmt).astype(np.float64)
    for m in (1, 17):
        x = rng.standard_normal((m, 512)).astype(np.float32)
        y = np.asarray(quant_matmul.matmul(jnp.asarray(x), w), np.float64)
        want = np.asarray(quant_panels.xla_matmul(jnp.asarray(x), w), np.float64)
        atol = 2 * tolerance(x, np.abs(x.astype(np.float64)) @ np.abs(ref))
        assert np.all(np.abs(y - want) <= atol)


@needs_kernels
def test_records_of_the_wrong_k_are_an_error_not_a_crash() -> None:
    raw = random_rows(np.random.default_rng(6), "q6_k", 32, 256)
    w = jax.tree.map(jnp.asarray, panels([(raw, "q6_k")], 256, "q6_k"))
    with pytest.raises(Exception, match="x's K differs"):
        jax.block_until_ready(quant_matmul.matmul(jnp.ones((2, 512), jnp.float32), w))
