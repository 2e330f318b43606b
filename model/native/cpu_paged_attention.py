"""Ragged tokens' attention over the paged KV cache as native XLA:CPU custom calls: decode tokens
one at a time (``paged_attention``) and prefill chunks a block of tokens at a time
(``paged_prefill``).

XLA:CPU runs ``model.attention.xla.ragged_paged_attention`` as a gather of each token's whole
window followed by 2 x N x K tiny batched matmuls ([G, H] x [H, window]), bound by per-product
overhead rather than by memory (docs/cpu-kernels.md). ``native/paged_attention.cc`` takes one (token, KV head) pair at
a time: it reads the token's pages in place, only up to its own position, scores each key by one
vectorised dot product, takes an exact softmax and accumulates the weighted values in registers,
on XLA's intra-op threads.

``ragged_paged_attention_blocks`` (the prefill region) gathers one window per block of tokens
and scores every token against all of it, the masked future included. ``native/paged_prefill.cc``
takes one (block, KV head) at a time (split into parts of query rows when there are too few to
keep every thread busy): the block's tokens sorted by position, the keys up to its last position
packed once, then register-tiled scores of a tile of query rows (tokens x the G query heads)
against a few keys at a time, each row only up to its own position, an exact softmax across the
rows in vector lanes, and the values read in place from the pages, each shared by several rows.

Both only read: the ragged step has written every token's key and value before attention
(``model.llama.Llama.forward``). Built and registered with the other kernels by
``model.native`` (``available()``); where they cannot be built the engine keeps
XLA's path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from model import native

TARGET = native.PAGED_ATTENTION
PREFILL_TARGET = native.PAGED_PREFILL
MAX_GROUP = 8  # query heads per KV head the kernels are instantiated for
LANES = 16  # head_dim must be a multiple of this: whole vectors at every build's width (native/vec.h)

available = native.available  # whether the kernels are built and registered


def supports(q_per_kv: int, head_dim: int, dtype: jnp.dtype) -> bool:
    """Whether the kernels handle G = ``q_per_kv`` query heads per KV head, this head_dim and
    this cache dtype (float32, bfloat16 or an 8-bit cache's int8; 1 <= G <= 8, head_dim a
    multiple of 16); it says nothing of whether they are built."""
    return (
        1 <= q_per_kv <= MAX_GROUP
        and head_dim % LANES == 0
        and jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16, jnp.int8)
    )


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    rows: jax.Array,
    positions: jax.Array,
    layer: jax.Array | int,
    window: jax.Array | int = 0,
) -> jax.Array:
    """Softmax attention (Vaswani et al. 2017, §3.2.1; grouped KV heads, Ainslie et al. 2023)
    of N tokens, each on its own, over layer ``layer`` of the stacked pages, by the native
    kernel (call ``available()`` first): token n attends positions 0 .. positions[n] of row
    rows[n], whose pages are ``page_tables[rows[n]]`` in order (their ids clipped into [0, P));
    with ``window`` > 0 (a local layer's sliding window) only positions[n] - window + 1 ..
    positions[n], and only their pages are read.

    Shapes: q [N, K, G, H] (cast to float32), already scaled by 1/sqrt(H); k_pages, v_pages
    [L, P, K, page_size, H], both float32 or both bfloat16 (or its bits, uint16: widened exactly), or both int8
    [L, P, K, page_size, H + 2] (an 8-bit cache's rows: ``model.attention.pages.to_stored``);
    page_tables [R, M] int32; rows, positions [N] int32; layer an int32 scalar in [0, L); window an int32
    scalar >= 0 (may be traced). A token whose row
    is outside [0, R) or whose position is outside [0, M x page_size) is padding: zeros.
    ``supports`` gives the G, head_dim and dtype limits.

    Returns:
        [N, K, G, H] float32, as ``ragged_paged_attention`` (up to float32 rounding: the sums
        run in another order).

    Raises:
        XlaRuntimeError (at run time): shapes or dtypes the kernel does not take.
    """
    i32 = jnp.int32
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q.astype(jnp.float32),
        k_pages,
        v_pages,
        page_tables.astype(i32),
        rows.astype(i32),
        positions.astype(i32),
        jnp.asarray(layer, i32),
        jnp.asarray(window, i32),
    )


def paged_prefill(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    rows: jax.Array,
    positions: jax.Array,
    layer: jax.Array | int,
    block: int,
    window: jax.Array | int = 0,
) -> jax.Array:
    """Softmax attention (Vaswani et al. 2017, §3.2.1; grouped KV heads, Ainslie et al. 2023)
    of N query tokens in blocks of ``block`` consecutive tokens of one sequence each (prefill
    chunks) over layer ``layer`` of the stacked pages, by the native kernel (call
    ``available()`` first): ``ragged_paged_attention_blocks``' semantics without its window.

    Each block (tokens [i x block, (i + 1) x block), the last one possibly short) belongs to the
    sequence rows[n] of its first real token n (a real token: rows[n] in [0, R) and positions[n]
    >= 0). Each real token of that sequence attends positions 0 .. positions[n] of it, whose
    pages are ``page_tables[rows[n]]`` in order (their ids clipped into [0, P)); positions in a
    block may come in any order. Padding tokens, and real tokens of another sequence than their
    block's (a broken promise), get zeros; so does a real token whose position is at or past
    M x page_size (beyond its table, which ``ragged_paged_attention_blocks`` forbids). With
    ``window`` > 0 (a local layer's sliding window) a token attends only positions[n] - window
    + 1 .. positions[n], and no key below its block's lowest such position is read.

    Shapes: q [N, K, G, H] (cast to float32), already scaled by 1/sqrt(H); k_pages, v_pages
    [L, P, K, page_size, H], both float32 or both bfloat16 (or its bits, uint16: widened exactly), or both int8
    [L, P, K, page_size, H + 2] (``model.attention.pages.to_stored``'s rows); page_tables
    [R, M] int32 with M x page_size <= 2^24; rows, positions [N] int32; layer an int32 scalar
    in [0, L); ``block`` a static Python int >= 1, passed to the kernel as its int64 attribute
    ``block``; window an int32 scalar >= 0 (may be traced). ``supports`` gives the G, head_dim and dtype limits.

    Returns:
        [N, K, G, H] float32, as ``ragged_paged_attention_blocks`` with ``block`` and a window
        of all M pages (up to float32 rounding: the sums run in another order).

    Raises:
        ValueError: ``block`` below 1.
        jax.errors.JaxRuntimeError (at run time; a ValueError from a call whose executable jax
            has cached): shapes, dtypes or a layer the kernel does not take, the message saying
            which.
    """
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    i32 = jnp.int32
    call = jax.ffi.ffi_call(PREFILL_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q.astype(jnp.float32),
        k_pages,
        v_pages,
        page_tables.astype(i32),
        rows.astype(i32),
        positions.astype(i32),
        jnp.asarray(layer, i32),
        jnp.asarray(window, i32),
        block=np.int64(block),
    )
