"""XLA's attention over a dense cache window and over ``BlockedKVCache`` blocks: scaled
dot-product attention (Vaswani et al. 2017, §3.2.1) with grouped KV heads (Ainslie et al. 2023).

Every backend runs these; they are the reference the native CPU kernels (``model.cpu_attention``)
are tested against, and what ``model.kernels.XLA`` calls. Einsum letters as in
``model.llama``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.config import LlamaConfig

Blocks = tuple[jax.Array, ...]  # one layer's cache blocks (BlockedKVCache)

NEG_INF = -1e30  # finite, so a fully masked row gives a uniform softmax instead of NaN


def attention(
    cfg: LlamaConfig,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache_k: jax.Array | None,
    cache_v: jax.Array | None,
    cache_mask: jax.Array | None,
    new_mask: jax.Array | None,
) -> jax.Array:
    """Attention over a cache window and/or the new keys (scaled dot-product, Vaswani et al.
    2017, §3.2.1, with grouped KV heads).

    Shapes: q [B, T, K, G, H] f32; k, v [B, T, K, H]; cache_k/v [B, K, S, H]; cache_mask
    [B, T, S] and new_mask [B, T, U] bool (True = may attend). ``new_mask`` None means the
    cache window already holds the new keys; no cache (a first chunk, T > 1) means causal
    self-attention with ``new_mask`` causal (``causal_attention_by_blocks``).
    Returns [B, T, K, G, H] float32.
    """
    B, T = q.shape[:2]
    K, G, H = cfg.num_kv_heads, cfg.q_per_kv, cfg.head_dim
    f32 = jnp.float32
    cdt = k.dtype

    if T == 1:  # decode: tiny per-(slot, head) products; broadcast-multiply-sum is faster on CPU
        scores = []
        if cache_k is not None:
            assert cache_v is not None and cache_mask is not None
            scores_cache = jnp.sum(q[:, 0, :, :, None, :] * cache_k[:, :, None, :, :], axis=-1)[:, :, :, None, :]
            scores.append(jnp.where(cache_mask[:, None, None], scores_cache, NEG_INF))
        if new_mask is not None:
            scores_new = jnp.einsum("BTKGH,BUKH->BKGTU", q, k, preferred_element_type=f32)
            scores.append(jnp.where(new_mask[:, None, None], scores_new, NEG_INF))
        probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0], axis=-1)
        attn = jnp.zeros((B, T, K, G, H), f32)
        if cache_k is not None and cache_v is not None:
            p_cache = probs[..., : cache_k.shape[2]]
            attn = jnp.sum(p_cache[:, :, :, 0, :, None] * cache_v[:, :, None, :, :], axis=-2)[:, None]
        if new_mask is not None:
            p_new = probs[..., probs.shape[-1] - T :]
            attn = attn + jnp.einsum("BKGTU,BUKH->BTKGH", p_new.astype(cdt), v, preferred_element_type=f32)
        return attn

    if cache_k is None:  # a first chunk: only its own keys, causally
        assert new_mask is not None
        return causal_attention_by_blocks(q, k, v, new_mask)

    # A later chunk (a cache window, and the new keys unless the window holds them): heads-major
    # operands ([B, K, G, T, H] queries, [B, K, U, H] keys and values), so both products are
    # plain batched matmuls and only the small q/k/v and output are transposed, never the
    # [T, U] scores (the token-major einsums' score transposes XLA:CPU copies; docs/cpu-kernels.md).
    assert cache_v is not None and cache_mask is not None
    qt = q.transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    scores_cache = jnp.einsum("BKGTH,BKSH->BKGTS", qt, cache_k, preferred_element_type=f32)
    scores = [jnp.where(cache_mask[:, None, None], scores_cache, NEG_INF)]
    if new_mask is not None:
        scores_new = jnp.einsum("BKGTH,BKUH->BKGTU", qt, k.transpose(0, 2, 1, 3), preferred_element_type=f32)
        scores.append(jnp.where(new_mask[:, None, None], scores_new, NEG_INF))
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0], axis=-1)
    p_cache = probs[..., : cache_k.shape[2]].astype(cdt)
    out = jnp.einsum("BKGTS,BKSH->BKGTH", p_cache, cache_v, preferred_element_type=f32)
    if new_mask is not None:
        p_new = probs[..., probs.shape[-1] - T :].astype(cdt)
        out = out + jnp.einsum("BKGTU,BKUH->BKGTH", p_new, v.transpose(0, 2, 1, 3), preferred_element_type=f32)
    return out.transpose(0, 3, 1, 2, 4)  # [B, T, K, G, H]


QUERY_BLOCK = 128  # queries per block of causal_attention_by_blocks


def causal_attention_by_blocks(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Causal self-attention of a chunk with nothing cached, skipping the masked upper triangle
    by query blocks: the queries of block i (``QUERY_BLOCK`` rows, the last block possibly
    shorter) attend only to keys [0, end of block i), the later keys being masked for all of
    them. For a 512-token chunk that is 10 of the 16 (query block, key block) tiles a full
    product computes; a chunk of up to ``QUERY_BLOCK`` tokens is one block. Heads-major
    operands as in ``attention``'s later-chunk path. (The blocking of FlashAttention, Dao et
    al. 2022, §3.1, without its online softmax: each query block's scores fit in memory whole.)

    Shapes: q [B, T, K, G, H] f32 (scaled); k, v [B, T, K, H]; mask [B, T, T] bool, causal
    (False above the diagonal: query t never attends key u > t), any T >= 1.
    Returns [B, T, K, G, H] float32, equal to full softmax attention with the same mask.
    """
    T = q.shape[1]
    f32 = jnp.float32
    cdt = v.dtype
    qt = q.transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, U, H]
    outs = []
    for start in range(0, T, QUERY_BLOCK):
        n = min(start + QUERY_BLOCK, T)  # keys [0, n) cover every row of the block
        rows = slice(start, n)
        s = jnp.einsum("BKGTH,BKUH->BKGTU", qt[:, :, :, rows], kt[:, :, :n], preferred_element_type=f32)
        probs = jax.nn.softmax(jnp.where(mask[:, None, None, rows, :n], s, NEG_INF), axis=-1).astype(cdt)
        outs.append(jnp.einsum("BKGTU,BKUH->BKGTH", probs, vt[:, :, :n], preferred_element_type=f32))
    return jnp.concatenate(outs, axis=3).transpose(0, 3, 1, 2, 4)  # [B, T, K, G, H]


def attention_over_blocks(q: jax.Array, k_blocks: Blocks, v_blocks: Blocks, mask: jax.Array) -> jax.Array:
    """Attention over cache blocks (``BlockedKVCache``) that already hold the new keys.

    Each block enters its own two dots as a whole buffer, which XLA:CPU runs at memory speed
    (see ``BlockedKVCache``); the scores of all blocks share one softmax.

    Shapes: q [B, T, K, G, H] f32 (scaled); key blocks [B, K, H, n_j]; value blocks
    [B, K, n_j, H]; mask [B, T, W] bool with W = sum of n_j (True = may attend).
    Returns [B, T, K, G, H] float32.
    """
    f32 = jnp.float32
    cdt = v_blocks[0].dtype
    if q.shape[1] == 1:  # decode: without the unit T axis XLA:CPU keeps both dots in one orientation (faster)
        qx, mask = q[:, 0], mask[:, :, None]  # q [B, K, G, H]; mask [B, 1, 1, W]
        score_eq, value_eq = "BKGH,BKHW->BKGW", "BKGW,BKWH->BKGH"
    else:
        qx, mask = q.transpose(0, 2, 3, 1, 4), mask[:, None, None]  # [B, K, G, T, H], heads-major
        score_eq, value_eq = "BKGTH,BKHW->BKGTW", "BKGTW,BKWH->BKGTH"
    scores = [jnp.einsum(score_eq, qx, kb, preferred_element_type=f32) for kb in k_blocks]
    s = jnp.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0]
    probs = jax.nn.softmax(jnp.where(mask, s, NEG_INF), axis=-1).astype(cdt)
    parts, start = [], 0
    for vb in v_blocks:
        n = vb.shape[2]
        parts.append(jnp.einsum(value_eq, probs[..., start : start + n], vb, preferred_element_type=f32))
        start += n
    out = sum(parts[1:], parts[0])
    return out[:, None] if q.shape[1] == 1 else out.transpose(0, 3, 1, 2, 4)  # [B, T, K, G, H]
