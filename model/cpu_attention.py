"""A decode step's KV-cache write and attention over a ``BlockedKVCache`` as one native XLA:CPU
custom call; and a first prefill chunk's causal self-attention as another.

XLA:CPU lowers decode attention (one query token per slot) to 2 x S x K tiny batched matmuls
per cache block ([G, H] x [H, n]), bound by per-product overhead rather than by memory, whatever
their orientation or dtype; and each layer's new keys and values go in by four scatters.
``native/decode_attention.cc`` does both as one pass per (slot, KV head), on XLA's intra-op
threads: it writes the slot's new key and value at its position, then reads its keys and
values once, only up to its own length. The blocks are aliased to the results, so the cache is
updated in place. ``python benchmarks/native_decode.py`` compares the step with and without
it (docs/cpu-kernels.md has the figures).

A first prefill chunk (nothing cached) attends causally to its own keys. XLA runs that as
batched dots over 128-query blocks, each computing its whole key range, the masked upper
triangle included, with the scores copied between the dots and the softmax.
``native/prefill_attention.cc`` (``causal``) takes one
(KV head, 16 queries) item at a time: scores against the keys up to the item's last query only,
kept in L1, the softmax of each row over its own causal range, values accumulated in registers.

The library (``model.native_kernels``) is compiled on first use with the machine's C++
compiler; where it cannot be built, ``available()`` is False and the engine keeps the XLA path
(``model.attention.attention_over_blocks``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model import native_kernels

TARGET = native_kernels.DECODE_ATTENTION  # the FFI targets (registered by native_kernels)
CAUSAL_TARGET = native_kernels.CAUSAL_ATTENTION
WRITE_TARGET = native_kernels.CACHE_WRITE
MAX_GROUP = 8  # query heads per KV head the kernel is instantiated for
LANES = 16  # head_dim must be a multiple of this: whole vectors at every build's width (native/vec.h)


available = native_kernels.available  # whether the kernels are built and registered


def supports(q_per_kv: int, head_dim: int, dtype: jnp.dtype) -> bool:
    """Whether the kernels handle G = ``q_per_kv`` query heads per KV head, this head_dim and
    this cache dtype (float32 or bfloat16, 1 <= G <= 8, head_dim a multiple of 16); it says
    nothing of whether they are built."""
    return 1 <= q_per_kv <= MAX_GROUP and head_dim % LANES == 0 and jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16)


def write_and_attend(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    positions: jax.Array,
    k_blocks: tuple[jax.Array, ...],
    v_blocks: tuple[jax.Array, ...],
) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """One decode step's cache write and attention for every slot, by the native kernel (call
    ``available()`` first): slot s's new key and value go in at ``positions[s]``, then its
    query attends to positions [0, positions[s]] (softmax attention, Vaswani et al. 2017,
    §3.2.1, with grouped KV heads). A position at or past the window's end marks an idle slot:
    nothing is written and its output is zeros. The blocks are updated in place
    (``input_output_aliases``) when the caller donates them, as the engine's jitted step does.

    Shapes: q [S, K, G, H] float32, already scaled by 1/sqrt(H); k_new, v_new [S, K, H]
    float32 (rounded to the cache dtype when written); positions [S] int32; key block j
    [S, K, H, n_j] and value block j [S, K, n_j, H], all float32 or all bfloat16.
    Returns (attention [S, K, G, H] float32, key blocks, value blocks).

    Raises:
        XlaRuntimeError (at run time): shapes or dtypes the kernel does not take (see ``supports``).
    """
    blocks = (*k_blocks, *v_blocks)
    first = 4  # operands before the blocks: q, positions, k_new, v_new
    call = jax.ffi.ffi_call(
        TARGET,
        (jax.ShapeDtypeStruct(q.shape, jnp.float32), *(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in blocks)),
        input_output_aliases={first + i: 1 + i for i in range(len(blocks))},
    )
    f32 = jnp.float32
    out, *written = call(q.astype(f32), positions.astype(jnp.int32), k_new.astype(f32), v_new.astype(f32), *blocks)
    n = len(k_blocks)
    return out, tuple(written[:n]), tuple(written[n:])


def write_chunk(
    slot: jax.Array,
    start: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_blocks: tuple[jax.Array, ...],
    v_blocks: tuple[jax.Array, ...],
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """A prefill chunk's cache write by the native kernel (``native/cache_write.cc``; call
    ``available()`` first): the chunk's T keys and values go into ``slot`` at positions
    ``start`` .. ``start + T - 1``, each into its block, rounded to the cache dtype (nearest
    even); positions past the window are dropped, as is everything when ``slot`` is out of
    range. XLA:CPU has no bfloat16 scatter: it converts each bfloat16 block to float32 and
    back around every write (docs/cpu-kernels.md). The blocks are updated in place (``input_output_aliases``) when the caller donates them.

    Shapes: slot, start int32 scalars; k, v [T, K, H] (cast to float32); key block j
    [S, K, H, n_j], value block j [S, K, n_j, H], all float32 or all bfloat16.
    Returns (key blocks, value blocks).

    Raises:
        XlaRuntimeError (at run time): shapes or dtypes the kernel does not take.
    """
    blocks = (*k_blocks, *v_blocks)
    first = 4  # operands before the blocks: slot, start, k, v
    call = jax.ffi.ffi_call(
        WRITE_TARGET,
        tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in blocks),
        input_output_aliases={first + i: i for i in range(len(blocks))},
    )
    i32, f32 = jnp.int32, jnp.float32
    written = call(jnp.asarray(slot, i32), jnp.asarray(start, i32), k.astype(f32), v.astype(f32), *blocks)
    n = len(k_blocks)
    return tuple(written[:n]), tuple(written[n:])


def causal(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal self-attention of one chunk with nothing cached, by the native kernel (call
    ``available()`` first): query t attends keys 0 .. t (softmax attention, Vaswani et al.
    2017, §3.2.1, grouped KV heads). Padding past the prompt's end only ever attends, never is
    attended to by a real token, as with the causal mask of ``model.attention.attention``.

    Shapes: q [1, T, K, G, H] float32, already scaled by 1/sqrt(H); k, v [1, T, K, H] (float32
    or bfloat16, widened exactly to float32). head_dim a multiple of 16 (``supports``).
    Returns [1, T, K, G, H] float32.

    Raises:
        XlaRuntimeError (at run time): shapes the kernel does not take.
    """
    f32 = jnp.float32
    call = jax.ffi.ffi_call(CAUSAL_TARGET, jax.ShapeDtypeStruct(q.shape[1:], f32))
    return call(q[0].astype(f32), k[0].astype(f32), v[0].astype(f32))[None]
