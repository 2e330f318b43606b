"""The model against itself on a tiny random config: the cache paths must agree exactly, for
both forms of the weights (stacked and scanned; per layer and unrolled, see
``model.llama.unstack_layers``), and the two forms must agree with each other."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from model import cpu_attention
from model.config import LlamaConfig
from model.kernels import NATIVE_CPU, XLA
from model.kv_cache import BlockedKVCache, KVCache
from model.llama import decode_step, prefill, unstack_layers
from model.weights.loader import random_llama

CFG = LlamaConfig.tiny()
SLOTS, MAX_LEN = 4, 64


@pytest.fixture(scope="module", params=["scan", "unrolled"])
def fns(request):  # type: ignore[no-untyped-def]
    graphdef, params = random_llama(CFG, seed=0)
    cache_cls = KVCache
    if request.param == "unrolled":
        params, cache_cls = unstack_layers(params), BlockedKVCache

    def pf(params, cache, tokens, start, n, slot, kv_len):  # type: ignore[no-untyped-def]
        return prefill(nnx.merge(graphdef, params), cache, tokens, start, n, slot, kv_len=kv_len)

    def dec(params, cache, tokens, positions, kv_len):  # type: ignore[no-untyped-def]
        return decode_step(nnx.merge(graphdef, params), cache, tokens, positions, kv_len=kv_len)

    return (
        params,
        jax.jit(pf, static_argnames="kv_len", donate_argnums=1),
        jax.jit(dec, static_argnames="kv_len", donate_argnums=1),
        lambda: cache_cls.zeros(CFG, SLOTS, MAX_LEN),  # the cache form that goes with the weights
    )


def _padded(ids: np.ndarray, bucket: int) -> np.ndarray:
    out = np.zeros(bucket, np.int32)
    out[: len(ids)] = ids
    return out


def test_prefill_n_equals_prefill_1_then_decode(fns) -> None:  # type: ignore[no-untyped-def]
    params, pf, dec, new_cache = fns
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, 13).astype(np.int32)
    slot = 2
    full_logits, full_cache = pf(params, new_cache(), _padded(ids, 16), 0, 13, slot, 0)

    cache = new_cache()
    logits, cache = pf(params, cache, _padded(ids[:1], 16), 0, 1, slot, 0)
    for i in range(1, len(ids)):
        tokens = np.full(SLOTS, 5, np.int32)
        positions = np.full(SLOTS, MAX_LEN, np.int32)  # idle slots: writes dropped
        tokens[slot], positions[slot] = ids[i], i
        step_logits, cache = dec(params, cache, tokens, positions, 32)
        logits = step_logits[slot]
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full_logits), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(cache.k[:, slot, :, :13]), np.asarray(full_cache.k[:, slot, :, :13]), atol=1e-5
    )
    # Idle slots' writes were dropped: their rows are still all zero.
    assert not np.asarray(cache.k[:, 0]).any() and not np.asarray(cache.v[:, 0]).any()


def test_chunked_prefill_equals_whole_prefill(fns) -> None:  # type: ignore[no-untyped-def]
    params, pf, _, new_cache = fns
    ids = np.random.default_rng(1).integers(0, CFG.vocab_size, 29).astype(np.int32)
    whole, _ = pf(params, new_cache(), _padded(ids, 32), 0, 29, 1, 0)
    cache = new_cache()
    _, cache = pf(params, cache, _padded(ids[:16], 16), 0, 16, 1, 0)
    chunked, _ = pf(params, cache, _padded(ids[16:], 16), 16, 13, 1, MAX_LEN)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), atol=1e-5, rtol=1e-5)


def test_padding_bucket_does_not_change_logits(fns) -> None:  # type: ignore[no-untyped-def]
    params, pf, _, new_cache = fns
    ids = np.random.default_rng(2).integers(0, CFG.vocab_size, 9).astype(np.int32)
    a, _ = pf(params, new_cache(), _padded(ids, 16), 0, 9, 0, 0)
    b, _ = pf(params, new_cache(), _padded(ids, 64), 0, 9, 0, 0)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_decode_is_batch_invariant(fns) -> None:  # type: ignore[no-untyped-def]
    """A slot's logits do not depend on what the other slots hold."""
    params, pf, dec, new_cache = fns
    rng = np.random.default_rng(3)
    ids = rng.integers(0, CFG.vocab_size, 7).astype(np.int32)
    results = []
    for others in (False, True):
        cache = new_cache()
        _, cache = pf(params, cache, _padded(ids, 16), 0, 7, 0, 0)
        tokens = np.zeros(SLOTS, np.int32)
        positions = np.full(SLOTS, MAX_LEN, np.int32)
        if others:
            for s in (1, 2, 3):
                other = rng.integers(0, CFG.vocab_size, 5 * s).astype(np.int32)
                _, cache = pf(params, cache, _padded(other, 16), 0, len(other), s, 0)
                tokens[s], positions[s] = 3, len(other)
        tokens[0], positions[0] = 11, 7
        logits, _ = dec(params, cache, tokens, positions, 32)
        results.append(np.asarray(logits[0]))
    np.testing.assert_allclose(results[0], results[1], atol=1e-5, rtol=1e-5)


def test_write_past_the_cache_is_dropped_not_clamped(fns) -> None:  # type: ignore[no-untyped-def]
    """A padded chunk ending beyond T_max must not overwrite the last position (JAX clamps
    dynamic_update_slice indices; the scatter here drops them instead)."""
    params, pf, _, new_cache = fns
    ids = np.random.default_rng(4).integers(0, CFG.vocab_size, 60).astype(np.int32)
    cache = new_cache()
    _, cache = pf(params, cache, _padded(ids, 64), 0, 60, 0, 0)
    before = np.asarray(cache.k[:, 0, :, :60]).copy()
    _, cache = pf(params, cache, _padded(ids[:2], 16), 60, 2, 0, MAX_LEN)  # positions 60..75, T_max 64
    np.testing.assert_array_equal(np.asarray(cache.k[:, 0, :, :60]), before)


def test_unrolled_equals_scanned() -> None:
    """The per-layer (unrolled, write-then-read) form computes what the scanned form does:
    prefill, a second chunk, and decode steps with idle slots, on several slots."""
    graphdef, stacked = random_llama(CFG, seed=5)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, CFG.vocab_size, n).astype(np.int32) for n in (11, 20, 5)]
    outputs = {}
    forms = (("scan", stacked, KVCache), ("unrolled", unstack_layers(stacked), BlockedKVCache))
    for form, params, cache_cls in forms:
        model = nnx.merge(graphdef, params)
        cache = cache_cls.zeros(CFG, SLOTS, MAX_LEN)
        logits = []
        for slot, ids in enumerate(prompts):
            out, cache = prefill(model, cache, _padded(ids[:16], 16), 0, min(16, len(ids)), slot, kv_len=0)
            if len(ids) > 16:
                out, cache = prefill(model, cache, _padded(ids[16:], 16), 16, len(ids) - 16, slot, kv_len=MAX_LEN)
            logits.append(np.asarray(out))
        tokens = np.array([1, 2, 3, 4], np.int32)
        positions = np.array([len(p) for p in prompts] + [MAX_LEN], np.int32)  # slot 3 idle
        for _ in range(3):
            step, cache = decode_step(model, cache, tokens, positions, kv_len=32)
            logits.append(np.asarray(step[:3]))
            tokens = np.argmax(np.asarray(step), axis=-1).astype(np.int32)
            positions[:3] += 1
        outputs[form] = (logits, np.asarray(cache.k[:, :3, :, :30]), np.asarray(cache.v[:, :3, :, :30]))
    for a, b in zip(outputs["scan"][0], outputs["unrolled"][0], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(outputs["scan"][1], outputs["unrolled"][1], atol=1e-6)
    np.testing.assert_allclose(outputs["scan"][2], outputs["unrolled"][2], atol=1e-6)


def test_blocked_cache_across_block_boundaries() -> None:
    """The blocked cache (``BlockedKVCache``: 128-position blocks, the last one shorter) gives
    what the stacked cache gives when a chunked prefill and decode steps cross block
    boundaries: T_max 300 (blocks of 128, 128, 44), a 250-token prompt in chunks of 128 and
    122, decode steps from position 250 to 259 over windows of 256 and then all 300 positions.
    The unrolled decode runs both through XLA's dots and through the native CPU kernel
    (``model.cpu_attention``; the 44-position block takes its scalar tail)."""
    assert cpu_attention.available()
    max_len = 300
    graphdef, stacked = random_llama(CFG, seed=6)
    rng = np.random.default_rng(6)
    prompt = rng.integers(0, CFG.vocab_size, 250).astype(np.int32)
    short = rng.integers(0, CFG.vocab_size, 40).astype(np.int32)
    outputs = {}
    unrolled = unstack_layers(stacked)
    forms = (("scan", stacked, KVCache), ("unrolled", unrolled, BlockedKVCache), ("native", unrolled, BlockedKVCache))
    for form, params, cache_cls in forms:
        model = nnx.merge(graphdef, params)
        cache = cache_cls.zeros(CFG, 3, max_len)
        logits = []
        out, cache = prefill(model, cache, _padded(prompt[:128], 128), 0, 128, 1, kv_len=0)
        out, cache = prefill(model, cache, _padded(prompt[128:], 128), 128, 122, 1, kv_len=max_len)
        logits.append(np.asarray(out))
        out, cache = prefill(model, cache, _padded(short, 64), 0, 40, 2, kv_len=0)
        logits.append(np.asarray(out))
        tokens = np.array([0, 7, 9], np.int32)
        positions = np.array([max_len, 250, 40], np.int32)  # slot 0 idle
        for _ in range(10):
            window = 256 if positions[1] < 256 else max_len
            step, cache = decode_step(
                model, cache, tokens, positions, kv_len=window, kernels=NATIVE_CPU if form == "native" else XLA
            )
            logits.append(np.asarray(step[1:]))
            tokens = np.argmax(np.asarray(step), axis=-1).astype(np.int32)
            positions[1:] += 1
        outputs[form] = (logits, np.asarray(cache.k), np.asarray(cache.v))
    assert isinstance(cache, BlockedKVCache) and [b.shape[-1] for b in cache.k_blocks[0]] == [128, 128, 44]
    for form in ("unrolled", "native"):
        for a, b in zip(outputs["scan"][0], outputs[form][0], strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(outputs["scan"][1], outputs[form][1], atol=1e-6)
        np.testing.assert_allclose(outputs["scan"][2], outputs[form][2], atol=1e-6)
        assert not outputs[form][1][:, 0].any()  # the idle slot's writes were dropped


def test_unrolled_steps_compute_the_rope_tables_once() -> None:
    """XLA:CPU fused the RoPE tables' cos/sin into every layer's RoPE of the unrolled loop,
    evaluating them per (token, head, dim) element in each layer (~100 ms of a 512-token
    prefill); ``model.llama.materialised`` makes it compute each table once per step. Checked on
    the compiled HLO of both steps: one cosine and one sine op in the whole program."""
    graphdef, stacked = random_llama(CFG, seed=0)
    params = unstack_layers(stacked)

    def pf(params, cache, tokens):  # type: ignore[no-untyped-def]
        return prefill(nnx.merge(graphdef, params), cache, tokens, 0, 16, 0, kv_len=0)

    def dec(params, cache, tokens, positions):  # type: ignore[no-untyped-def]
        return decode_step(nnx.merge(graphdef, params), cache, tokens, positions, kv_len=32)

    cache = BlockedKVCache.zeros(CFG, SLOTS, MAX_LEN)
    tokens, positions = np.zeros(SLOTS, np.int32), np.arange(SLOTS, dtype=np.int32)
    programs = {
        "prefill": jax.jit(pf).lower(params, cache, np.zeros(16, np.int32)).compile().as_text(),
        "decode": jax.jit(dec).lower(params, cache, tokens, positions).compile().as_text(),
    }
    assert CFG.num_layers > 1
    for name, hlo in programs.items():
        assert hlo.count(" cosine(") == 1 and hlo.count(" sine(") == 1, name


@pytest.mark.parametrize("T", [256, 384])
def test_causal_attention_by_blocks_equals_softmax_attention(T: int) -> None:
    """The query-blocked causal attention of a long first chunk (``QUERY_BLOCK`` rows per block,
    each attending only to the keys up to its last row) against causal softmax attention
    written out in numpy (float64) on random inputs with grouped KV heads."""
    from model.attention import QUERY_BLOCK, causal_attention_by_blocks

    assert T > QUERY_BLOCK and T % QUERY_BLOCK == 0
    B, K, G, H = 2, 3, 2, 8
    rng = np.random.default_rng(T)
    q = rng.standard_normal((B, T, K, G, H)).astype(np.float32)
    k = rng.standard_normal((B, T, K, H)).astype(np.float32)
    v = rng.standard_normal((B, T, K, H)).astype(np.float32)
    causal = np.tril(np.ones((T, T), bool))
    got = np.asarray(causal_attention_by_blocks(q, k, v, np.broadcast_to(causal, (B, T, T))))

    scores = np.einsum("btkgh,bukh->bkgtu", q.astype(np.float64), k.astype(np.float64))
    scores = np.where(causal, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.einsum("bkgtu,bukh->btkgh", probs, v.astype(np.float64))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_long_first_chunk_equals_chunked_prefill() -> None:
    """A 250-token prompt prefilled as one 256-token chunk (query-blocked causal attention)
    gives the logits and cache of the same prompt in chunks of 128 and 122 (the second
    attending to the cache), in both weight forms."""
    max_len = 300
    graphdef, stacked = random_llama(CFG, seed=7)
    prompt = np.random.default_rng(7).integers(0, CFG.vocab_size, 250).astype(np.int32)
    forms = (("scan", stacked, KVCache), ("unrolled", unstack_layers(stacked), BlockedKVCache))
    for form, params, cache_cls in forms:
        model = nnx.merge(graphdef, params)
        whole, whole_cache = prefill(model, cache_cls.zeros(CFG, 2, max_len), _padded(prompt, 256), 0, 250, 1, kv_len=0)
        cache = cache_cls.zeros(CFG, 2, max_len)
        _, cache = prefill(model, cache, _padded(prompt[:128], 128), 0, 128, 1, kv_len=0)
        chunked, cache = prefill(model, cache, _padded(prompt[128:], 128), 128, 122, 1, kv_len=max_len)
        np.testing.assert_allclose(np.asarray(whole), np.asarray(chunked), atol=1e-5, rtol=1e-5, err_msg=form)
        np.testing.assert_allclose(
            np.asarray(whole_cache.k)[:, 1, :, :250], np.asarray(cache.k)[:, 1, :, :250], atol=1e-5, err_msg=form
        )


def test_fuse_projections_groups_query_heads_by_kv_head() -> None:
    """``fuse_projections`` puts query head k*G + g at ``wqkv[..., k, g, :]`` (the head that
    Hugging Face's ``repeat_kv`` pairs with KV head k), the key and value of KV head k at
    ``wqkv[..., k, G, :]`` and ``[..., k, G + 1, :]``, gate and up at ``w_gate_up[..., 0/1, :]``,
    and passes the other weights through."""
    from model.llama import fuse_projections

    L, D, N, K, H, F = 2, 5, 6, 2, 4, 7
    G = N // K
    rng = np.random.default_rng(0)
    sep = {
        "wq": rng.standard_normal((L, D, N, H)),
        "wk": rng.standard_normal((L, D, K, H)),
        "wv": rng.standard_normal((L, D, K, H)),
        "w_gate": rng.standard_normal((L, D, F)),
        "w_up": rng.standard_normal((L, D, F)),
        "wo": rng.standard_normal((L, N, H, D)),
    }
    fused = fuse_projections(sep, K)
    assert set(fused) == {"wqkv", "w_gate_up", "wo"}
    assert fused["wqkv"].shape == (L, D, K, G + 2, H) and fused["w_gate_up"].shape == (L, D, 2, F)
    for k in range(K):
        for g in range(G):
            np.testing.assert_array_equal(fused["wqkv"][:, :, k, g], sep["wq"][:, :, k * G + g])
        np.testing.assert_array_equal(fused["wqkv"][:, :, k, G], sep["wk"][:, :, k])
        np.testing.assert_array_equal(fused["wqkv"][:, :, k, G + 1], sep["wv"][:, :, k])
    np.testing.assert_array_equal(fused["w_gate_up"][:, :, 0], sep["w_gate"])
    np.testing.assert_array_equal(fused["w_gate_up"][:, :, 1], sep["w_up"])
    assert fused["wo"] is sep["wo"]
