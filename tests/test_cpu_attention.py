"""The native CPU attention kernels (``model.cpu_attention``): decode write + attention, a
prefill chunk's cache write and a first prefill chunk's causal attention, against softmax attention in numpy float64 and XLA's
path, and the engine's choice of them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import cpu_attention
from model.native import cpu_argmax
from model.config import LlamaConfig
from model.kernels import NATIVE_CPU, XLA
from model.kv_cache import BlockedKVCache
from model.llama import prefill, unstack_layers
from model.weights.loader import random_llama
from model.sampling import first_argmax
from service.engine import Engine, EngineConfig
from service.engine.request import SamplingOptions
from sharding.layouts import Layout


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu_attention.available(), "the kernel must build on a machine with g++ (CI has it)"


def reference(q: np.ndarray, positions: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Softmax attention in float64: q [S, K, G, H]; keys, values [S, K, W, H]; slot s attends
    to positions [0, positions[s]]; an idle slot (position outside [0, W)) gives zeros."""
    S, K, G, H = q.shape
    out = np.zeros((S, K, G, H))
    for s in range(S):
        p = int(positions[s])
        if not 0 <= p < keys.shape[2]:
            continue
        scores = np.einsum("kgh,kwh->kgw", q[s], keys[s, :, : p + 1])
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[s] = np.einsum("kgw,kwh->kgh", probs, values[s, :, : p + 1])
    return out


def blocks_of(keys: np.ndarray, values: np.ndarray, lengths: list[int], dtype: jnp.dtype) -> tuple[tuple, tuple]:
    """[S, K, W, H] keys and values cut into the BlockedKVCache layout: key blocks
    [S, K, H, n], value blocks [S, K, n, H]."""
    kb, vb, start = [], [], 0
    for n in lengths:
        kb.append(jnp.asarray(keys[:, :, start : start + n].transpose(0, 1, 3, 2), dtype))
        vb.append(jnp.asarray(values[:, :, start : start + n], dtype))
        start += n
    return tuple(kb), tuple(vb)


def unblocked(kb: tuple, vb: tuple) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of ``blocks_of``: [S, K, W, H] keys and values as float64."""
    keys = np.concatenate([np.asarray(b.astype(jnp.float32), np.float64).transpose(0, 1, 3, 2) for b in kb], axis=2)
    values = np.concatenate([np.asarray(b.astype(jnp.float32), np.float64) for b in vb], axis=2)
    return keys, values


@pytest.mark.parametrize(
    ("S", "K", "G", "H", "lengths", "dtype"),
    [
        (5, 3, 3, 64, [128, 128], jnp.float32),  # SmolLM2's heads; ragged lengths across both blocks
        (4, 2, 1, 16, [128, 44], jnp.float32),  # a short last block (its tail one position at a time)
        (3, 1, 8, 128, [37], jnp.float32),  # one block shorter than a vector multiple; G = 8
        (4, 2, 4, 32, [128, 128, 128], jnp.bfloat16),  # a bfloat16 cache
        (8, 1, 2, 16, [128, 32], jnp.float32),  # every position below, a block's first one too
        (8, 1, 2, 16, [128, 32], jnp.bfloat16),
    ],
)
def test_kernel_writes_then_matches_softmax_attention(
    S: int, K: int, G: int, H: int, lengths: list[int], dtype: jnp.dtype
) -> None:
    W = sum(lengths)
    rng = np.random.default_rng(S * 100 + H)
    q = rng.standard_normal((S, K, G, H)).astype(np.float32) / np.sqrt(H)
    keys = rng.standard_normal((S, K, W, H)).astype(np.float32) * 2
    values = rng.standard_normal((S, K, W, H)).astype(np.float32)
    k_new = rng.standard_normal((S, K, H)).astype(np.float32) * 2
    v_new = rng.standard_normal((S, K, H)).astype(np.float32)
    # Positions: the first, ones either side of a block edge and of a vector edge, the last,
    # and an idle slot (position W, as the engine passes T_max).
    choices = [0, 15, 16, 17, lengths[0] - 1, min(lengths[0], W - 1), W - 1, W]
    positions = np.array([choices[(i * 3) % len(choices)] for i in range(S)], np.int32)
    positions[-1] = W  # always one idle slot
    kb, vb = blocks_of(keys, values, lengths, dtype)

    # What the kernel should leave in the cache: the new entries at each active position,
    # rounded to the cache dtype as XLA's convert rounds them; the idle slot untouched.
    want_k, want_v = unblocked(kb, vb)
    for s, p in enumerate(positions):
        if p < W:
            want_k[s, :, p] = np.asarray(jnp.asarray(k_new[s], dtype).astype(jnp.float32))
            want_v[s, :, p] = np.asarray(jnp.asarray(v_new[s], dtype).astype(jnp.float32))
    want = reference(q.astype(np.float64), positions, want_k, want_v)

    step = jax.jit(cpu_attention.write_and_attend, donate_argnums=(4, 5))
    out, kb, vb = step(jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(positions), kb, vb)
    assert out.shape == (S, K, G, H) and out.dtype == jnp.float32
    assert [b.shape[-1] for b in kb] == lengths and all(b.dtype == dtype for b in kb + vb)
    got_k, got_v = unblocked(kb, vb)
    np.testing.assert_array_equal(got_k, want_k)
    np.testing.assert_array_equal(got_v, want_v)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=1e-4)
    assert not np.asarray(out)[-1].any()  # the idle slot


def test_kernel_without_donation_leaves_its_operands_alone() -> None:
    """Blocks that are not donated are copied into the results before the write, so the
    caller's arrays keep their old contents."""
    rng = np.random.default_rng(0)
    kb = (jnp.asarray(rng.standard_normal((1, 1, 16, 128)), jnp.float32),)
    vb = (jnp.asarray(rng.standard_normal((1, 1, 128, 16)), jnp.float32),)
    before = np.asarray(kb[0]).copy()
    q, new = jnp.ones((1, 1, 1, 16)), jnp.full((1, 1, 16), 7.0)
    _, kw, _ = jax.jit(cpu_attention.write_and_attend)(q, new, new, jnp.array([5], jnp.int32), kb, vb)
    np.testing.assert_array_equal(np.asarray(kb[0]), before)
    assert (np.asarray(kw[0])[0, 0, :, 5] == 7.0).all()


def test_kernel_rejects_mismatched_blocks() -> None:
    q = jnp.zeros((2, 1, 1, 16), jnp.float32)
    new = jnp.zeros((2, 1, 16), jnp.float32)
    k = (jnp.zeros((2, 1, 16, 32), jnp.float32),)
    v = (jnp.zeros((2, 1, 16, 16), jnp.float32),)  # 16 positions where the key block has 32
    with pytest.raises(Exception, match="value block j must be"):
        jax.block_until_ready(cpu_attention.write_and_attend(q, new, new, jnp.zeros(2, jnp.int32), k, v))


def causal_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal softmax attention in float64: q [T, K, G, H]; k, v [T, K, H]; query t attends
    keys 0..t."""
    T = q.shape[0]
    scores = np.einsum("tkgh,ukh->kgtu", q, k)
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("kgtu,ukh->tkgh", probs, v)


@pytest.mark.parametrize(
    ("T", "K", "G", "H"),
    [
        (1, 1, 1, 16),  # one token
        (5, 2, 3, 16),  # a partial 16-query item
        (37, 3, 3, 64),  # SmolLM2's heads; 16 + 16 + 5 queries
        (130, 2, 4, 128),  # rows past 128 keys; value passes of 4 + 4 vectors
        (33, 1, 8, 48),  # 8 query heads per KV head; head_dim 48: 1-vector value passes
    ],
)
def test_causal_kernel_matches_float64(T: int, K: int, G: int, H: int) -> None:
    rng = np.random.default_rng(T * 7 + H)
    q = rng.standard_normal((T, K, G, H)).astype(np.float32) * np.float32(H**-0.5)
    k = rng.standard_normal((T, K, H)).astype(np.float32)
    v = rng.standard_normal((T, K, H)).astype(np.float32)
    got = jax.jit(cpu_attention.causal)(q[None], k[None], v[None])
    assert got.shape == (1, T, K, G, H) and got.dtype == jnp.float32
    want = causal_reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    np.testing.assert_allclose(np.asarray(got)[0], want, atol=2e-6, rtol=1e-5)


def test_causal_kernel_rejects_a_head_dim_it_does_not_take() -> None:
    q = jnp.zeros((1, 4, 1, 1, 24), jnp.float32)
    kv = jnp.zeros((1, 4, 1, 24), jnp.float32)
    with pytest.raises(Exception, match="head_dim must be a multiple of 16"):
        jax.block_until_ready(jax.jit(cpu_attention.causal)(q, kv, kv))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    ("slot", "start", "T"),
    [
        (1, 0, 64),  # a first chunk inside block 0
        (0, 100, 64),  # straddles blocks 0 and 1
        (2, 150, 64),  # runs past the window's end (176): the tail is dropped
        (3, 0, 176),  # the whole window
        (4, 0, 8),  # a slot out of range: nothing written
    ],
)
def test_chunk_write_matches_xla_scatters(slot: int, start: int, T: int, dtype: jnp.dtype) -> None:
    """cpu_attention.write_chunk leaves the cache exactly as XLA's scatters (with mode="drop")
    do, entries rounded to the cache dtype as XLA's convert rounds them; the blocks are written
    in place when donated."""
    S, K, H, lengths = 4, 3, 16, [128, 48]
    rng = np.random.default_rng(start + T)
    keys = rng.standard_normal((S, K, sum(lengths), H)).astype(np.float32)
    values = rng.standard_normal((S, K, sum(lengths), H)).astype(np.float32)
    k = jnp.asarray(rng.standard_normal((T, K, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((T, K, H)), jnp.float32)
    kb, vb = blocks_of(keys, values, lengths, dtype)
    want_k, want_v = unblocked(kb, vb)
    W = sum(lengths)
    if slot < S:
        n = min(T, W - start)
        want_k[slot, :, start : start + n] = np.asarray(k[:n].astype(dtype).astype(jnp.float32)).transpose(1, 0, 2)
        want_v[slot, :, start : start + n] = np.asarray(v[:n].astype(dtype).astype(jnp.float32)).transpose(1, 0, 2)
    write = jax.jit(cpu_attention.write_chunk, donate_argnums=(4, 5))
    kb, vb = write(jnp.int32(slot), jnp.int32(start), k, v, kb, vb)
    assert all(b.dtype == dtype for b in kb + vb)
    got_k, got_v = unblocked(kb, vb)
    np.testing.assert_array_equal(got_k, want_k)
    np.testing.assert_array_equal(got_v, want_v)


def test_first_prefill_chunk_with_the_causal_kernel_matches_xla() -> None:
    """model.llama.prefill of a first chunk (a padded bucket) through the causal kernel gives
    XLA's logits and writes the same keys and values."""
    cfg = LlamaConfig.tiny()
    graphdef, params = random_llama(cfg, seed=11)
    params = unstack_layers(params)
    tokens = jnp.asarray(np.random.default_rng(11).integers(0, cfg.vocab_size, 64), jnp.int32)

    def run(native: bool):  # type: ignore[no-untyped-def]
        cache = BlockedKVCache.zeros(cfg, 2, 128)
        step = jax.jit(
            lambda p, c: prefill(
                nnx.merge(graphdef, p), c, tokens, jnp.int32(0), jnp.int32(50), jnp.int32(1),
                kv_len=0, kernels=NATIVE_CPU if native else XLA,
            )
        )  # fmt: skip
        return step(params, cache)

    (ln, cn), (lx, cx) = run(True), run(False)
    np.testing.assert_allclose(np.asarray(ln), np.asarray(lx), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(cn), jax.tree.leaves(cx), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_supports() -> None:
    assert cpu_attention.supports(3, 64, jnp.float32)
    assert cpu_attention.supports(4, 128, jnp.bfloat16)
    assert not cpu_attention.supports(3, 60, jnp.float32)  # head_dim not a multiple of 16
    assert not cpu_attention.supports(9, 64, jnp.float32)  # more than 8 query heads per KV head
    assert not cpu_attention.supports(3, 64, jnp.float16)


def test_engine_uses_the_kernel_where_it_applies_and_agrees_with_xla() -> None:
    """One device, unrolled layers: "auto" takes the kernel; its greedy decode and logits
    agree with the same engine on XLA's dots. A multi-device mesh and the scan form keep XLA's."""
    cfg = LlamaConfig.tiny()
    graphdef, params = random_llama(cfg, seed=3)
    ecfg = EngineConfig(num_slots=3, max_seq_len=300, chunk_size=128, layers="unrolled")
    one = jax.devices()[:1]
    native = Engine(cfg, graphdef, params, Layout("single"), ecfg, devices=one)
    xla = Engine(
        cfg, graphdef, params, Layout("single"), dataclasses.replace(ecfg, decode_attention="xla"), devices=one
    )
    assert native.kernels.native and not xla.kernels.native
    scan = Engine(cfg, graphdef, params, Layout("single"), dataclasses.replace(ecfg, layers="scan"))
    two = Engine(cfg, graphdef, params, Layout("1x2", model=2), ecfg, devices=jax.devices()[:2])
    assert not scan.kernels.native and not two.kernels.native
    # The greedy argmax's kernel goes with them (model.native.cpu_argmax; tested in test_sampling).
    assert native.argmax is cpu_argmax.first_argmax
    assert scan.argmax is first_argmax and two.argmax is first_argmax

    prompt = list(np.random.default_rng(3).integers(0, cfg.vocab_size, 140))
    runs = []
    for engine in (native, xla):
        engine.set_sampling(1, SamplingOptions(temperature=0.0))
        first = engine.prefill(1, prompt[:128], 0)
        first = engine.prefill(1, prompt[128:], 128)
        ids, logits = [int(first.host().ids[0])], []
        for i in range(20):  # positions 140..159: across no block edge, but a 256 window
            tokens = np.zeros(3, np.int32)
            positions = np.array([300, len(prompt) + i, 300], np.int32)
            tokens[1] = ids[-1]
            out = engine.decode(tokens, positions)
            ids.append(int(out.host().ids[1]))
            logits.append(np.asarray(out.logits)[1])
        runs.append((ids, np.stack(logits)))
    assert runs[0][0] == runs[1][0]
    np.testing.assert_allclose(runs[0][1], runs[1][1], atol=1e-4, rtol=1e-4)
