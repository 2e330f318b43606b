"""The native CPU panel matmul (``model.native.cpu_matmul``) against numpy float64, the packing of the
model's weights for it, prefill and decode over the packed weights against XLA's matmuls, and
the engine's choice of it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import native
from model.native import cpu_matmul
from model.config import LlamaConfig
from model.kv_cache import BlockedKVCache
from model.llama import decode_step, prefill, unstack_layers
from model.weights.loader import random_llama
from model.weights.packed_weights import panel_weights
from service.engine import Engine, EngineConfig
from service.engine.request import SamplingOptions
from sharding.layouts import Layout


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu_matmul.available(), "the kernels must build on a machine with g++ (CI has it)"


@pytest.mark.parametrize(
    ("m", "k", "n"),
    [
        (1, 576, 960),  # one row: a 1-row tile
        (3, 64, 32),  # one panel; one full 3-row tile (AVX2)
        (16, 100, 96),  # one full 16-row tile (AVX-512); K not a multiple of anything
        (17, 1536, 576),  # a full tile and a 1-row tile (AVX-512); 5 x 3 + 2 rows (AVX2)
        (64, 576, 3072),  # four full tiles (AVX-512), 96 panels over the threads
        (45, 7, 64),  # 16 + 16 + 13 rows (AVX-512), 15 x 3 (AVX2)
    ],
)
def test_matmul_matches_numpy(m: int, k: int, n: int) -> None:
    y, want, _, _ = kernel_against_float64(m, k, n, cpu_matmul.pack)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * np.sqrt(k))


def kernel_against_float64(
    m: int, k: int, n: int, pack: Callable[[jax.Array, int], cpu_matmul.Panels]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x [m, k] @ w [k, n] (standard normal float32, seeded by the shape) through the kernel
    of ``pack``'s format, checked for shape and dtype; returns (the kernel's y, x @ w in
    float64, x and w as float64)."""
    rng = np.random.default_rng(m * 1000 + k)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((k, n), np.float32)
    y = jax.jit(cpu_matmul.matmul)(x, pack(jnp.asarray(w), 1))
    assert y.shape == (m, n) and y.dtype == jnp.float32
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    return np.asarray(y), x64 @ w64, x64, w64


def test_pack_layout_and_out_shape() -> None:
    """Panel p holds columns 32p..32p+31 of every row; the outputs take the weight's trailing
    axes; leading axes beyond the first are contracted too (wo [N, H, D] with in_dims 2)."""
    w = np.arange(2 * 3 * 4 * 16, dtype=np.float32).reshape(2, 3, 4, 16)  # [N=2, H=3, 4, 16]: K=6, N=64
    packed = cpu_matmul.pack(jnp.asarray(w), 2)
    assert packed.out_shape == (4, 16) and packed.data.shape == (2, 6, 32)
    flat = w.reshape(6, 64)
    for p in range(2):
        np.testing.assert_array_equal(np.asarray(packed.data[p]), flat[:, 32 * p : 32 * p + 32])
    x = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    y = cpu_matmul.matmul(jnp.asarray(x), packed)
    assert y.shape == (5, 4, 16)
    np.testing.assert_allclose(np.asarray(y).reshape(5, 64), x @ flat, rtol=1e-5, atol=1e-4)


def test_pack_rejects_what_the_kernel_does_not_take() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_matmul.pack(jnp.zeros((8, 48), jnp.float32), 1)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_matmul.pack(jnp.zeros((8, 64), jnp.bfloat16), 1)
    assert cpu_matmul.supports(960, jnp.float32)
    assert not cpu_matmul.supports(960, jnp.bfloat16)


def test_stacked_panels_multiply_by_the_layer_they_are_given_inside_a_scan() -> None:
    """``pack_stacked``: L matrices in one array; inside ``lax.scan`` the traced layer index picks
    the matrix, read in place, and each product equals numpy float64's of that matrix."""
    rng = np.random.default_rng(0)
    L, M, K, N = 3, 5, 96, 64
    w = rng.standard_normal((L, K, 2, N // 2)).astype(np.float32)  # out_shape (2, N/2), as fused weights
    x = rng.standard_normal((M, K)).astype(np.float32)
    stack = cpu_matmul.pack_stacked(jnp.asarray(w), 1)
    assert stack.data.shape == (L, N // 32, K, 32) and stack.out_shape == (2, N // 2)

    def body(_: None, layer: jax.Array) -> tuple[None, jax.Array]:
        return None, cpu_matmul.matmul(jnp.asarray(x), dataclasses.replace(stack, layer=layer))

    _, ys = jax.jit(lambda: jax.lax.scan(body, None, jnp.arange(L, dtype=jnp.int32)))()
    for i in range(L):
        want = (x.astype(np.float64) @ w[i].reshape(K, N).astype(np.float64)).reshape(M, 2, N // 2)
        np.testing.assert_allclose(np.asarray(ys[i]), want, rtol=1e-4, atol=1e-4 * np.sqrt(K))
    with pytest.raises(ValueError, match="need a layer index"):
        cpu_matmul.matmul(jnp.asarray(x), stack)
    outside = dataclasses.replace(stack, layer=jnp.int32(L))
    with pytest.raises(Exception, match="layer index outside"):
        np.asarray(jax.jit(cpu_matmul.matmul)(jnp.asarray(x), outside))


def test_mismatched_k_is_an_error_not_a_crash() -> None:
    packed = cpu_matmul.pack(jnp.zeros((8, 32), jnp.float32), 1)
    with pytest.raises(Exception, match="panels must be"):
        jax.block_until_ready(cpu_matmul.matmul(jnp.zeros((2, 9), jnp.float32), packed))


@pytest.mark.parametrize("tied", [True, False])
def test_decode_step_with_panels_matches_xla(tied: bool) -> None:
    """decode_step over the packed weights (every layer projection and the LM head) gives the
    logits and the cache of XLA's matmuls, for a tied and an untied LM head."""
    cfg = LlamaConfig.tiny(tie_word_embeddings=tied)
    graphdef, params = random_llama(cfg, seed=5)
    params = unstack_layers(params)
    model = nnx.merge(graphdef, params)
    panels = panel_weights(model)
    assert set(panels) == {"wqkv", "wo", "w_gate_up", "w_down", "lm_head"}
    assert len(panels["wqkv"]) == cfg.num_layers
    S, T = 4, 256
    tokens = jnp.array([3, 17, 200, 9], jnp.int32)
    positions = jnp.array([0, 5, 130, T], jnp.int32)  # the last slot idle

    def run(w):  # type: ignore[no-untyped-def]
        cache = BlockedKVCache.zeros(cfg, S, T)
        step = jax.jit(lambda p, w, c: decode_step(nnx.merge(graphdef, p), c, tokens, positions, kv_len=T, panels=w))
        return step(params, w, cache)

    (lx, cx), (ln, cn) = run(None), run(panels)
    np.testing.assert_allclose(np.asarray(ln)[:3], np.asarray(lx)[:3], rtol=1e-4, atol=1e-4)
    for a, b in zip(jax.tree.leaves(cn), jax.tree.leaves(cx), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("start", [0, 100])
def test_prefill_with_panels_matches_xla(start: int) -> None:
    """A first chunk (start 0) and a later one (start 100, attending to the cached prefix)
    over the packed layer weights give XLA's logits and cache."""
    cfg = LlamaConfig.tiny()
    graphdef, params = random_llama(cfg, seed=9)
    params = unstack_layers(params)
    panels = panel_weights(nnx.merge(graphdef, params))
    tokens = jnp.asarray(np.random.default_rng(9).integers(0, cfg.vocab_size, 64), jnp.int32)
    kv_len = 0 if start == 0 else 256

    def run(w):  # type: ignore[no-untyped-def]
        cache = BlockedKVCache.zeros(cfg, 2, 256)
        fn = jax.jit(
            lambda p, w, c: prefill(
                nnx.merge(graphdef, p),
                c,
                tokens,
                jnp.int32(start),
                jnp.int32(50),
                jnp.int32(1),
                kv_len=kv_len,
                panels=w,
            )
        )
        return fn(params, w, cache)

    (lx, cx), (ln, cn) = run(None), run(panels)
    np.testing.assert_allclose(np.asarray(ln), np.asarray(lx), rtol=1e-4, atol=1e-4)
    for a, b in zip(jax.tree.leaves(cn), jax.tree.leaves(cx), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_engine_uses_panels_where_they_apply_and_agrees_with_xla() -> None:
    """One CPU device, unrolled layers: "auto" packs the weights (prefill and decode use them,
    a one-slot engine's decode too); greedy ids and logits match an all-XLA engine. "xla", the
    scan form and a 2-device mesh keep XLA's matmuls."""
    cfg = LlamaConfig.tiny()
    graphdef, params = random_llama(cfg, seed=7)
    ecfg = EngineConfig(num_slots=3, max_seq_len=256, chunk_size=64, layers="unrolled")
    one = jax.devices()[:1]
    native = Engine(cfg, graphdef, params, Layout("single"), ecfg, devices=one)
    plain = dataclasses.replace(ecfg, decode_attention="xla", matmul="xla")
    xla = Engine(cfg, graphdef, params, Layout("single"), plain, devices=one)
    # 3 slots: rows where every build measured (AVX-512, AVX2) is faster; 64-token chunks: AVX-512 only
    assert cpu_matmul.faster_than_xla(3)
    prefill_native = cpu_matmul.faster_than_xla(64)
    assert native.panels is not None and native.panel_bytes() > 0
    assert xla.panels is None and xla.panel_bytes() == 0
    # A live switch's prediction of the packed copy, before building: the same weights, so
    # native's exactly (every weight and the LM head packed); 0 where the new engine cannot pack.
    assert native.packed_bytes_on(one) == native.panel_bytes()
    assert xla.packed_bytes_on(one) == 0  # matmul="xla" never packs
    assert native.packed_bytes_on(jax.devices()[:2]) == 0
    assert (
        Engine(cfg, graphdef, params, Layout("single"), dataclasses.replace(ecfg, layers="scan"), one).packed_bytes_on(
            one
        )
        == 0
    )
    assert native._decode_panels is native.panels and "lm_head" in native.panels
    assert native._prefill_panels is (native.panels if prefill_native else None)
    single = Engine(cfg, graphdef, params, Layout("single"), dataclasses.replace(ecfg, num_slots=1), devices=one)
    if prefill_native or cpu_matmul.faster_than_xla(1):
        assert single.panels is not None
    else:  # neither step takes the kernel: nothing packed
        assert single.panels is None and single.panel_bytes() == 0
    assert single._prefill_panels is (single.panels if prefill_native else None)
    if cpu_matmul.faster_than_xla(1):  # one slot's one-row products (AVX-512 builds)
        assert single._decode_panels is single.panels and "lm_head" in single.panels
    else:  # XLA's matrix-vector products (AVX2 builds)
        assert single._decode_panels is None
    scan = dataclasses.replace(ecfg, layers="scan")
    assert Engine(cfg, graphdef, params, Layout("single"), scan, devices=one).panels is None
    assert Engine(cfg, graphdef, params, Layout("1x2", model=2), ecfg, devices=jax.devices()[:2]).panels is None

    prompt = [int(t) for t in np.random.default_rng(7).integers(0, cfg.vocab_size, 40)]
    runs = []
    for engine in (native, xla):
        engine.set_sampling(2, SamplingOptions(temperature=0.0))
        ids, logits = [int(engine.prefill(2, prompt, 0).host().ids[0])], []
        for i in range(12):
            tokens = np.zeros(3, np.int32)
            tokens[2] = ids[-1]
            out = engine.decode(tokens, np.array([256, 256, len(prompt) + i], np.int32))
            ids.append(int(out.host().ids[2]))
            logits.append(np.asarray(out.logits)[2])
        runs.append((ids, np.stack(logits)))
    assert runs[0][0] == runs[1][0]
    np.testing.assert_allclose(runs[0][1], runs[1][1], rtol=1e-4, atol=1e-4)

    # One slot: the kernel's one-row products against XLA's matrix-vector ones.
    single_xla = Engine(cfg, graphdef, params, Layout("single"), dataclasses.replace(plain, num_slots=1), devices=one)
    singles = []
    for engine in (single, single_xla):
        engine.set_sampling(0, SamplingOptions(temperature=0.0))
        ids, logits = [int(engine.prefill(0, prompt, 0).host().ids[0])], []
        for i in range(12):
            out = engine.decode(np.array([ids[-1]], np.int32), np.array([len(prompt) + i], np.int32))
            ids.append(int(out.host().ids[0]))
            logits.append(np.asarray(out.logits)[0])
        singles.append((ids, np.stack(logits)))
    assert singles[0][0] == singles[1][0] == runs[0][0]
    np.testing.assert_allclose(singles[0][1], singles[1][1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("isa", "faster"),
    [
        ("avx512", {1: True, 2: True, 64: True, 512: True}),
        ("avx2", {1: False, 2: True, 8: True, 32: True, 64: False, 128: False, 512: False}),
        ("other", {1: False, 8: False, 512: False}),
    ],
)
def test_faster_than_xla_follows_the_builds_isa(
    monkeypatch: pytest.MonkeyPatch, isa: str, faster: dict[int, bool]
) -> None:
    monkeypatch.setattr(native_kernels, "isa", lambda: isa)
    assert {rows: cpu_matmul.faster_than_xla(rows) for rows in faster} == faster


def test_engine_rejects_unknown_matmul() -> None:
    with pytest.raises(ValueError, match="matmul must be one of"):
        EngineConfig(matmul="fast")
