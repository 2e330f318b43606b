"""The native matmul over GGUF-quantized weights (``model.native.quant_matmul``) against float64 products
of the dequantized weights, for Q8_0, Q4_0 and Q4_1 (the record formats: tests/test_record_matmul.py), both of the kernel's paths, odd shapes and
batch sizes, stacked weights with a traced layer index (jit and lax.scan), and its errors."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import native
from model.native import quant_matmul
from model.weights import quant_panels
from model.weights.quant_panels import BLOCK_BYTES, GGML_TYPES, QuantPanels
from model.weights.quant_panels import BLOCK_FORMATS as FORMATS

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the native kernels are not built here (not x86-64, or no compiler)"
)


def random_blocks(rng: np.random.Generator, fmt: str, n: int, k: int, wide: bool = False) -> np.ndarray:
    """GGUF rows uint8 [n, k/32 * block bytes] with random codes and random finite float16
    scales (and Q4_1 minimums): standard normal values, or with ``wide`` any finite float16 bit
    pattern (subnormals, zeros, both signs, up to 65504)."""
    kb = k // 32
    blocks = np.empty((n, kb, BLOCK_BYTES[fmt]), np.uint8)

    def halves() -> np.ndarray:
        if wide:
            bits = rng.integers(0, 1 << 16, (n, kb), dtype=np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] ^= 0x4000  # no infinities or NaNs: exponent 31 -> 15
            return bits.view(np.float16)
        return rng.standard_normal((n, kb)).astype(np.float16)

    blocks[..., 0:2] = halves()[..., None].view(np.uint8)
    if fmt == "q4_1":
        blocks[..., 2:4] = halves()[..., None].view(np.uint8)
    start = 2 if fmt != "q4_1" else 4
    blocks[..., start:] = rng.integers(0, 256, (n, kb, BLOCK_BYTES[fmt] - start), dtype=np.uint8)
    return blocks.reshape(n, -1)


def reference(raw: np.ndarray, fmt: str) -> np.ndarray:
    """W [K, N] float32 by gguf.quants from the stored rows."""
    return np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(GGML_TYPES[fmt]))).T


def tolerance(x: np.ndarray, w: QuantPanels) -> float:
    """The absolute error a float32 dot of length K may have against float64: the rounding of a
    sum of K products grows about like sqrt(K) unit roundoffs (2^-24 ~ 6e-8) of the largest
    partial sums, themselves at most a few sqrt(K) |x| |w| for random signs; 1e-5 sqrt(K) max|x|
    times a bound on |d q| + |m| (the direct path sums x q and x separately before scaling, so
    its terms are those two, not their sum) leaves margin for that and for the last ulps, while
    one weight misread (a wrong code, scale or column) moves an output by ~|x||w|, far more."""
    qmax = 128.0 if w.format == "q8_0" else 15.0
    d = np.abs(np.asarray(w.scales, np.float64)).max()
    m = 0.0 if w.mins is None else np.abs(np.asarray(w.mins, np.float64)).max()
    return 1e-5 * np.sqrt(w.k) * float(np.abs(x).max()) * (qmax * d + m)


def case(fmt: str, m: int, k: int, n: int, seed: int = 0, wide: bool = False):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    raw = random_blocks(rng, fmt, n, k, wide)
    w = quant_panels.pack_rows(raw, fmt, k, (n,))
    x = rng.standard_normal((m, k)).astype(np.float32)
    return x, w, raw


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("wide", [False, True])
def test_dequantize_equals_gguf_bitwise(fmt: str, wide: bool) -> None:
    _, w, raw = case(fmt, 1, 96, 160, seed=7, wide=wide)
    got = np.asarray(quant_panels.dequantize(jax.tree.map(jnp.asarray, w)))
    want = reference(raw, fmt)
    assert got.dtype == np.float32 and got.shape == want.shape == (96, 160)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize(
    ("m", "k", "n"),
    [
        (1, 576, 1536),  # one row, many panels over the threads
        (2, 32, 32),  # one block, one panel
        (3, 96, 160),  # one full AVX2 tile of the dequantized path
        (5, 576, 32),  # 2 + 2 + 1 rows (direct path on AVX2), 3 + 2 (dequantized)
        (16, 96, 160),  # 8 x 2 rows (direct, AVX2); the last size "auto" takes direct
        (17, 576, 160),  # 5 x 3 + 2 rows (dequantized, AVX2)
        (64, 32, 1536),
        (65, 96, 32),
        (511, 96, 160),  # prefill sizes: a last tile of 1 row (AVX2)
        (512, 576, 32),
    ],
)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", ["direct", "dequantized"])
def test_matmul_matches_float64(fmt: str, m: int, k: int, n: int, path: str) -> None:
    x, w, raw = case(fmt, m, k, n, seed=m + k + n)
    want = x.astype(np.float64) @ reference(raw, fmt).astype(np.float64)
    y = jax.jit(quant_matmul.matmul, static_argnames="path")(jnp.asarray(x), jax.tree.map(jnp.asarray, w), path=path)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=0, atol=tolerance(x, w))


@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_path_agrees_with_xla_on_wide_scales(fmt: str) -> None:
    """Every float16 pattern as scales (subnormals, zeros, 65504): the kernel's widening of the
    scales and minimums is exact, and its result is XLA's up to rounding."""
    for m in (1, 17):
        x, w, _ = case(fmt, m, 576, 160, seed=m, wide=True)
        wj = jax.tree.map(jnp.asarray, w)
        y = np.asarray(quant_matmul.matmul(jnp.asarray(x), wj), np.float64)
        want = np.asarray(quant_panels.xla_matmul(jnp.asarray(x), wj), np.float64)
        np.testing.assert_allclose(y, want, rtol=0, atol=2 * tolerance(x, w))


def test_out_shape_and_input_dtype() -> None:
    rng = np.random.default_rng(3)
    raw = random_blocks(rng, "q4_1", 64, 64)
    w = jax.tree.map(jnp.asarray, quant_panels.pack_rows(raw, "q4_1", 64, (4, 16)))
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.bfloat16)
    y = quant_matmul.matmul(x, w)
    assert y.shape == (3, 4, 16) and y.dtype == jnp.float32
    want = quant_panels.xla_matmul(x, w)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_stacked_layers_by_traced_index_in_jit_and_scan(fmt: str) -> None:
    """Matrix ``layer`` of a stack, the index traced: under jit, and as a lax.scan over layers
    whose body calls the kernel with the loop counter, each step gives its own layer's product."""
    rng = np.random.default_rng(11)
    L, M, K, N = 3, 5, 96, 160
    raws = [random_blocks(rng, fmt, N, K) for _ in range(L)]
    stack = jax.tree.map(jnp.asarray, quant_panels.stack([quant_panels.pack_rows(r, fmt, K, (N,)) for r in raws]))
    x = rng.standard_normal((M, K)).astype(np.float32)
    wants = [x.astype(np.float64) @ reference(r, fmt).astype(np.float64) for r in raws]
    atol = max(tolerance(x, quant_panels.layer(stack, i)) for i in range(L))
    by_index = jax.jit(quant_matmul.matmul)
    for i in range(L):
        np.testing.assert_allclose(np.asarray(by_index(x, stack, jnp.int32(i))), wants[i], rtol=0, atol=atol)

    def body(carry: jax.Array, i: jax.Array) -> tuple[jax.Array, jax.Array]:
        return carry + 1, quant_matmul.matmul(jnp.asarray(x), stack, i)

    _, ys = jax.jit(lambda: jax.lax.scan(body, jnp.int32(0), jnp.arange(L, dtype=jnp.int32)))()
    assert ys.shape == (L, M, N)
    for i in range(L):
        np.testing.assert_allclose(np.asarray(ys[i]), wants[i], rtol=0, atol=atol)


def test_layer_out_of_range_is_an_error_not_a_crash() -> None:
    rng = np.random.default_rng(2)
    raws = [random_blocks(rng, "q8_0", 32, 64) for _ in range(2)]
    stack = jax.tree.map(jnp.asarray, quant_panels.stack([quant_panels.pack_rows(r, "q8_0", 64, (32,)) for r in raws]))
    x = jnp.ones((2, 64), jnp.float32)
    call = jax.jit(quant_matmul.matmul)
    for bad in (2, -1, 1 << 30):
        with pytest.raises(Exception, match="layer index outside"):
            jax.block_until_ready(call(x, stack, jnp.int32(bad)))
    jax.block_until_ready(call(x, stack, jnp.int32(1)))  # and the kernel still runs


@pytest.mark.parametrize("fmt", FORMATS)
def test_mismatched_k_is_an_error_not_a_crash(fmt: str) -> None:
    rng = np.random.default_rng(4)
    w = jax.tree.map(jnp.asarray, quant_panels.pack_rows(random_blocks(rng, fmt, 32, 64), fmt, 64, (32,)))
    with pytest.raises(Exception, match="x's K differs"):
        jax.block_until_ready(quant_matmul.matmul(jnp.ones((2, 96), jnp.float32), w))


def test_mismatched_scales_are_an_error_not_a_crash() -> None:
    rng = np.random.default_rng(5)
    w = jax.tree.map(jnp.asarray, quant_panels.pack_rows(random_blocks(rng, "q4_1", 64, 64), "q4_1", 64, (64,)))
    bad = QuantPanels(w.codes, w.scales[:1], w.mins, w.out_shape, w.format)  # one panel's scales for two
    with pytest.raises(Exception, match="scales must be"):
        jax.block_until_ready(quant_matmul.matmul(jnp.ones((1, 64), jnp.float32), bad))


def test_trace_time_errors() -> None:
    rng = np.random.default_rng(6)
    w = jax.tree.map(jnp.asarray, quant_panels.pack_rows(random_blocks(rng, "q4_0", 32, 32), "q4_0", 32, (32,)))
    x = jnp.ones((1, 32), jnp.float32)
    with pytest.raises(ValueError, match="one matrix"):
        quant_matmul.matmul(x, w, 0)
    with pytest.raises(ValueError, match="need a layer index"):
        quant_matmul.matmul(x, quant_panels.stack([w, w]))
    with pytest.raises(ValueError, match="unknown path"):
        quant_matmul.matmul(x, w, path="fast")
