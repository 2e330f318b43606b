"""Decode tokens' attention over the paged KV cache as one native XLA:CPU custom call.

XLA:CPU runs ``model.paged_attention.ragged_paged_attention`` as a gather of each token's whole
window followed by 2 x N x K tiny batched matmuls ([G, H] x [H, window]), bound by per-product
overhead rather than by memory (64 tokens over a 256-position window: about 18 ms a layer for
25 MB of keys and values here). ``native/paged_attention.cc`` takes one (token, KV head) pair at
a time: it reads the token's pages in place, only up to its own position, scores each key by one
vectorised dot product, takes an exact softmax and accumulates the weighted values in registers,
on XLA's intra-op threads. It only reads: the ragged step has written every token's key and
value before attention (``model.llama.Llama.run_layers_paged``).

Built and registered with the other kernels by ``model.native_kernels`` (``available()``); where
they cannot be built the paged engine keeps XLA's path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model import cpu_attention, native_kernels

TARGET = native_kernels.PAGED_ATTENTION

available = native_kernels.available  # whether the kernels are built and registered
supports = cpu_attention.supports  # the same G, head_dim and dtype limits as the slots kernels


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    rows: jax.Array,
    positions: jax.Array,
    layer: jax.Array | int,
) -> jax.Array:
    """Softmax attention (Vaswani et al. 2017, §3.2.1; grouped KV heads, Ainslie et al. 2023)
    of N tokens, each on its own, over layer ``layer`` of the stacked pages, by the native
    kernel (call ``available()`` first): token n attends positions 0 .. positions[n] of row
    rows[n], whose pages are ``page_tables[rows[n]]`` in order (their ids clipped into [0, P)).

    Shapes: q [N, K, G, H] (cast to float32), already scaled by 1/sqrt(H); k_pages, v_pages
    [L, P, K, page_size, H], both float32 or both bfloat16 (widened exactly); page_tables
    [R, M] int32; rows, positions [N] int32; layer an int32 scalar in [0, L). A token whose row
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
    )
