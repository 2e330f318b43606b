"""The XLA attention backend (``XlaAttention``): ragged attention over the paged KV cache
(``model.attention.pages``) as XLA gathers and dots, on every backend and mesh; the reference
the native kernels are tested against.

``ragged_paged_attention`` has each query token gather its sequence's whole window
(``window_pages`` pages) and compute scores against all of it, masked (see its cost): the decode
region. ``ragged_paged_attention_blocks`` gathers one window per block of consecutive tokens of
one sequence (a prefill chunk), which the caller promises: the prefill region. Both take the
metadata of ``model.attention.base.StepMeta`` as loose arrays (rows, positions, page tables) so
that tests can call them on any layout of tokens.

Both read one layer's pages [P, K, page_size, H], or, given ``layer``, layer ``layer`` of the
stacked pages [L, P, K, page_size, H] (``PagedKVCache.k``/``v``) gathered straight out of the
stacked array: ``k[layer, pages]`` copies only the window, where slicing out the layer first
(``k[layer]``, a dynamic slice inside the scan over layers) copies the layer's whole pool on
XLA:CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp

from model.attention.base import AttentionBackend, StepMeta, power_of_two_buckets
from model.attention.pages import from_stored, head_dim_of

NEG_INF = -1e30  # finite, as in model.llama: a fully masked (padding) row gives no NaN


def padding_mask(seq_of_token: jax.Array, positions: jax.Array, num_seqs: int) -> jax.Array:
    """[N] bool, True for a real token: ``seq_of_token`` in [0, num_seqs) and a position >= 0."""
    return (seq_of_token >= 0) & (seq_of_token < num_seqs) & (positions >= 0)


def _window(
    k_pages: jax.Array, v_pages: jax.Array, page_tables: jax.Array, window_pages: int, layer: jax.Array | int | None
) -> tuple[jax.Array, Callable[[jax.Array], tuple[jax.Array, jax.Array]]]:
    """The window's page tables [B, W] (W = ``window_pages``; entries clipped into [0, P), so
    filler stays in range) and a gather: pages [n, W] int32 -> keys, values [n, K, W *
    page_size, H] float32 (window position w * page_size + o = offset o of the w-th page),
    read from one layer's pages or from layer ``layer`` of the stacked pages (an 8-bit cache's
    rows decoded: ``pages.from_stored``).

    Raises:
        ValueError: ``window_pages`` outside [1, max_pages].
    """
    max_pages = page_tables.shape[1]
    if not 1 <= window_pages <= max_pages:
        raise ValueError(f"window_pages must be in [1, {max_pages}], got {window_pages}")
    P, K, page_size = k_pages.shape[-4:-1]
    H = head_dim_of(k_pages)
    width = window_pages * page_size
    tables = jnp.clip(page_tables[:, :window_pages], 0, P - 1)

    def gather(pages: jax.Array) -> tuple[jax.Array, jax.Array]:
        n = pages.shape[0]
        # One gather of the window's pages, [n, W, K, page_size, H], straight from the (stacked)
        # array; then [n, K, W * page_size, H].
        kw = k_pages[pages] if layer is None else k_pages[layer, pages]
        vw = v_pages[pages] if layer is None else v_pages[layer, pages]
        kw = from_stored(kw).transpose(0, 2, 1, 3, 4).reshape(n, K, width, H)
        vw = from_stored(vw).transpose(0, 2, 1, 3, 4).reshape(n, K, width, H)
        return kw, vw

    return tables, gather


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    seq_of_token: jax.Array,
    positions: jax.Array,
    *,
    window_pages: int,
    query_block: int | None = None,
    layer: jax.Array | int | None = None,
    sliding_window: jax.Array | int = 0,
) -> jax.Array:
    """Softmax attention (Vaswani et al. 2017, §3.2.1; grouped KV heads, Ainslie et al. 2023)
    of N ragged query tokens over one layer's pages.

    Args:
        q: [N, K, G, H] queries, already scaled by 1/sqrt(H) (cast to float32).
        k_pages, v_pages: [P, K, page_size, H], the layer's pages (float32, bfloat16 or its bits
            as uint16; int8 rows [.., H + 2]: ``pages.from_stored`` decodes them), with
            every real token's own key and value already written (``paged_kv.write_kv``); or,
            with ``layer``, the stacked pages [L, P, K, page_size, H] of every layer.
        page_tables: [B, max_pages] int32. The entries covering positions 0 .. positions[n]
            of token n's sequence must be its pages; the rest (unused columns, any filler such
            as -1) are clipped into [0, P) and then masked, so never read into a result.
        seq_of_token: [N] int32, each token's sequence; outside [0, B) = padding.
        positions: [N] int32, each token's absolute position; negative = padding. A real
            token's position must be below ``window_pages * page_size``: keys past the window
            are not read (inside jit this cannot be checked; the caller's bucket guarantees it).
        window_pages: static, 1 <= window_pages <= max_pages: the leading pages of each table
            that are gathered.
        query_block: static; None gathers for all N tokens at once, else tokens go through in
            blocks of this many (``lax.map``; N padded to a multiple with padding tokens), which
            bounds the gathered copy to ``query_block`` windows.
        layer: None, or an int32 scalar in [0, L) (static or traced): the layer of the stacked
            pages that is read.
        sliding_window: an int32 scalar (static or traced): token n attends only positions
            above positions[n] - sliding_window; 0 = all of 0 .. positions[n].

    Returns:
        [N, K, G, H] float32; zeros for padding tokens.

    Keys and values are widened exactly to float32 and both products run in float32 at
    ``Precision.HIGHEST`` (TPUs and GPUs would otherwise multiply float32 in bfloat16 or
    TF32 passes), so a bfloat16 cache changes the result only by its rounding of the stored
    keys and values.

    Cost, per call (one layer): each token gathers its sequence's window, 2 x window_pages x
    page_size x K x H elements (keys and values), and computes K x G x window_pages x page_size
    scores, masked past its position. A decode token thus reads what it needs once (rounded up
    to the window); a prefill chunk of n tokens copies its sequence's window n times, and the
    peak memory is N (or ``query_block``) windows. Gathering per token rather than per
    sequence keeps the products batched over tokens with none wasted on other sequences' keys
    (a per-sequence gather would need N x B windows of scores to reach every token's own).

    Raises:
        ValueError: ``window_pages`` outside [1, max_pages], or ``query_block`` below 1.
    """
    N, K, G, H = q.shape
    if query_block is not None and query_block < 1:
        raise ValueError(f"query_block must be >= 1, got {query_block}")

    def attend(qb: jax.Array, sb: jax.Array, pb: jax.Array) -> jax.Array:
        # Blocks of one token: each token gathers its own sequence's window.
        return ragged_paged_attention_blocks(
            qb, k_pages, v_pages, page_tables, sb, pb, window_pages=window_pages, block=1, layer=layer,
            sliding_window=sliding_window,
        )  # fmt: skip

    if query_block is None or query_block >= N:
        return attend(q, seq_of_token, positions)
    blocks = -(-N // query_block)
    pad = blocks * query_block - N
    qp = jnp.pad(q, ((0, pad), (0, 0), (0, 0), (0, 0)))
    sp = jnp.pad(seq_of_token, (0, pad), constant_values=-1)  # padding tokens
    pp = jnp.pad(positions, (0, pad), constant_values=-1)
    out = jax.lax.map(
        lambda xs: attend(*xs),
        (qp.reshape(blocks, query_block, K, G, H), sp.reshape(blocks, query_block), pp.reshape(blocks, query_block)),
    )
    return out.reshape(blocks * query_block, K, G, H)[:N]


def ragged_paged_attention_blocks(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    seq_of_token: jax.Array,
    positions: jax.Array,
    *,
    window_pages: int,
    block: int,
    layer: jax.Array | int | None = None,
    sliding_window: jax.Array | int = 0,
) -> jax.Array:
    """``ragged_paged_attention`` for query tokens that come in blocks of one sequence each
    (prefill chunks): each block of ``block`` consecutive tokens gathers one window, that of
    the sequence of its first real token, and all its tokens attend to it.

    The caller's promise: within each block (tokens [i * block, (i + 1) * block); N is padded
    to a multiple with padding tokens) every real token belongs to one sequence, e.g. a prefill
    chunk that starts at a block boundary and is padded to whole blocks, in any order of
    positions. A real token of another sequence than its block's first is attended as padding:
    its output is zeros, so a broken promise gives wrong results for those tokens only, never
    reads another sequence's keys, and never NaN.

    Args:
        q, k_pages, v_pages, page_tables, seq_of_token, positions, window_pages, layer,
            sliding_window: as for ``ragged_paged_attention``.
        block: static, >= 1, tokens per block. 1 is ``ragged_paged_attention`` (each token its
            own window), which runs through here.

    Returns:
        [N, K, G, H] float32; zeros for padding tokens (and for tokens that break the promise).

    Cost, per call (one layer): N / block windows gathered, 2 x window_pages x page_size x K x
    H elements each, where the per-token path gathers N; scores K x G x window_pages x page_size
    per token, as there, and as much memory as all N tokens' scores at once.

    Raises:
        ValueError: ``window_pages`` outside [1, max_pages], or ``block`` below 1.
    """
    N, K, G, H = q.shape
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    B = page_tables.shape[0]
    tables, gather = _window(k_pages, v_pages, page_tables, window_pages, layer)
    f32 = jnp.float32
    hi = jax.lax.Precision.HIGHEST
    keys_at = jnp.arange(tables.shape[1] * k_pages.shape[-2], dtype=jnp.int32)

    nb = -(-N // block)
    pad = nb * block - N
    qb = jnp.pad(q, ((0, pad), (0, 0), (0, 0), (0, 0))).reshape(nb, block, K, G, H).astype(f32)
    sb = jnp.pad(seq_of_token, (0, pad), constant_values=-1).reshape(nb, block)  # padding tokens
    pb = jnp.pad(positions, (0, pad), constant_values=-1).reshape(nb, block)
    real = padding_mask(sb, pb, B)  # [nb, block]
    first = jnp.argmax(real, axis=1)  # the first real token (0 in an all-padding block)
    seq = jnp.clip(jnp.take_along_axis(sb, first[:, None], axis=1)[:, 0], 0, B - 1)  # [nb]
    member = real & (sb == seq[:, None])  # the promise: every real token of the block
    kw, vw = gather(tables[seq])  # [nb, K, S, H]
    # Heads-major queries [nb, K, G, block, H], so both products are batched matmuls.
    qt = qb.transpose(0, 2, 3, 1, 4)
    scores = jnp.einsum("bKGqH,bKSH->bKGqS", qt, kw, precision=hi, preferred_element_type=f32)
    mask = member[:, :, None] & (keys_at[None, None, :] <= pb[:, :, None])  # [nb, block, S]
    lowest = jnp.where(jnp.asarray(sliding_window) > 0, pb - sliding_window, -1)  # keys at or below: out
    mask &= keys_at[None, None, :] > lowest[:, :, None]
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, NEG_INF), axis=-1)
    out = jnp.einsum("bKGqS,bKSH->bqKGH", probs, vw, precision=hi, preferred_element_type=f32)
    out = jnp.where(member[:, :, None, None, None], out, 0.0)
    return out.reshape(nb * block, K, G, H)[:N]


class XlaAttention(AttentionBackend):
    """Decode tokens through ``ragged_paged_attention`` (each gathers its own window), the
    prefill region through ``ragged_paged_attention_blocks`` (one window per block). The window
    is a bucket: powers of two from ``min_pages`` to ``max_pages``."""

    name: ClassVar[str] = "XLA gathers and dots"

    def attend(
        self,
        q: jax.Array,
        k_pages: jax.Array,
        v_pages: jax.Array,
        layer: jax.Array | int,
        meta: StepMeta,
        window: jax.Array | int = 0,
    ) -> jax.Array:
        D, N = meta.decode_tokens, q.shape[0]
        parts = []
        if D > 0:
            rows, positions = meta.decode_region()
            parts.append(
                ragged_paged_attention(
                    q[:D], k_pages, v_pages, meta.page_tables, rows, positions, window_pages=meta.window_pages,
                    layer=layer, sliding_window=window,
                )
            )  # fmt: skip
        if D < N:
            rows, positions = meta.prefill_region()
            parts.append(
                ragged_paged_attention_blocks(
                    q[D:], k_pages, v_pages, meta.page_tables, rows, positions, window_pages=meta.window_pages,
                    block=meta.seq_block, layer=layer, sliding_window=window,
                )
            )  # fmt: skip
        return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

    def window_buckets(self, max_pages: int, min_pages: int) -> list[int]:
        return power_of_two_buckets(min(min_pages, max_pages), max_pages)
