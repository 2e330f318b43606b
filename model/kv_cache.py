"""The KV cache: an explicit pytree argument of the jitted steps, donated on every call."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from model.config import LlamaConfig

# Logical axis names of the cache arrays, in order; sharding/rules.py maps them to mesh axes.
CACHE_AXES = ("layers", "slots", "kv_heads", "cache_len", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer for every decode slot.

    Attributes:
        k: [L, S, K, T, H] keys, already rotated by RoPE (L layers, S slots, K KV heads,
            T = max sequence length in tokens, H head dim), dtype = the cache dtype.
        v: [L, S, K, T, H] values, same shape and dtype.

    Position ``t`` of slot ``s`` holds the token at absolute position ``t`` of the sequence
    in that slot. Entries at or beyond a slot's length are never read (they are masked), so
    stale values from an earlier request are harmless.
    """

    k: jax.Array
    v: jax.Array

    @property
    def num_slots(self) -> int:
        return int(self.k.shape[1])

    @property
    def max_len(self) -> int:
        return int(self.k.shape[3])

    @staticmethod
    def shape(cfg: LlamaConfig, num_slots: int, max_len: int) -> tuple[int, ...]:
        """[L, S, K, T, H] for the given config, slot count and max sequence length."""
        return (cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)

    @classmethod
    def zeros(cls, cfg: LlamaConfig, num_slots: int, max_len: int, dtype: jnp.dtype = jnp.float32) -> KVCache:
        """A zero-filled cache (never ``jnp.empty``: uninitialised memory may hold NaN, and
        0 * NaN = NaN would leak through the attention mask)."""
        shape = cls.shape(cfg, num_slots, max_len)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @classmethod
    def abstract(cls, cfg: LlamaConfig, num_slots: int, max_len: int, dtype: jnp.dtype = jnp.float32) -> KVCache:
        """Shape-and-dtype structs of the cache, for ahead-of-time lowering."""
        shape = cls.shape(cfg, num_slots, max_len)
        struct: Any = jax.ShapeDtypeStruct(shape, dtype)
        return cls(k=struct, v=struct)

    def nbytes(self) -> int:
        """Total bytes of K and V."""
        return int(self.k.size * self.k.dtype.itemsize * 2)


# ---- the blocked form (per-layer weights, unrolled layers) ----------------------------------
BLOCK_LEN = 128  # cache positions per block; decode windows are whole blocks (or all of T)

# Logical axes of one block: keys are stored transposed, head_dim before positions.
BLOCK_K_AXES = ("slots", "kv_heads", "head_dim", "cache_len")
BLOCK_V_AXES = ("slots", "kv_heads", "cache_len", "head_dim")


def block_starts(max_len: int) -> list[tuple[int, int]]:
    """(first position, length) of each block of a ``max_len``-position cache: blocks of
    ``BLOCK_LEN``, the last one shorter when ``max_len`` is not a multiple."""
    return [(s, min(BLOCK_LEN, max_len - s)) for s in range(0, max_len, BLOCK_LEN)]


def index_in_block(positions: jax.Array, start: int, length: int) -> jax.Array:
    """Each position's index in the block [start, start + length), or ``length`` (out of
    range, so a scatter with mode="drop" skips it) when the position is not in the block.
    positions: int32 array of any shape; returns the same shape."""
    idx = positions - start
    return jnp.where((idx >= 0) & (idx < length), idx, length)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BlockedKVCache:
    """The KV cache as separate arrays per layer and per block of positions, for the unrolled
    layer loop (``model.llama.Llama.run_layers_in_place``).

    Attributes:
        k_blocks: L tuples of n blocks, block j [S, K, H, len_j] (keys transposed: positions
            minor), dtype = the cache dtype.
        v_blocks: L tuples of n blocks, block j [S, K, len_j, H].
    Block j holds positions [j * BLOCK_LEN, j * BLOCK_LEN + len_j) (``block_starts``).

    Why blocks: XLA:CPU runs a dot at memory speed only when its operands are whole buffers;
    a window sliced out of a larger cache array (even along its major axis) is first copied by
    a slow fusion, several times slower than the dot over whole buffers; keys are stored
    [H, len] because the scores' dot over them ran faster than over [len, H]
    (docs/cpu-kernels.md has the timings). A decode step
    attends to the first ceil(window / BLOCK_LEN) blocks, each a whole buffer.
    """

    k_blocks: tuple[tuple[jax.Array, ...], ...]
    v_blocks: tuple[tuple[jax.Array, ...], ...]

    @property
    def max_len(self) -> int:
        return sum(int(b.shape[2]) for b in self.v_blocks[0])

    @property
    def k(self) -> jax.Array:
        """All keys as one [L, S, K, T, H] array (a copy, for inspection and tests)."""
        return jnp.stack([jnp.concatenate([jnp.swapaxes(b, 2, 3) for b in layer], axis=2) for layer in self.k_blocks])

    @property
    def v(self) -> jax.Array:
        """All values as one [L, S, K, T, H] array (a copy, for inspection and tests)."""
        return jnp.stack([jnp.concatenate(layer, axis=2) for layer in self.v_blocks])

    @staticmethod
    def block_shapes(cfg: LlamaConfig, num_slots: int, max_len: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(key block shape, value block shape) of each block: [S, K, H, len], [S, K, len, H]."""
        S, K, H = num_slots, cfg.num_kv_heads, cfg.head_dim
        return [((S, K, H, n), (S, K, n, H)) for _, n in block_starts(max_len)]

    @classmethod
    def zeros(cls, cfg: LlamaConfig, num_slots: int, max_len: int, dtype: jnp.dtype = jnp.float32) -> BlockedKVCache:
        """A zero-filled cache (zeros, not uninitialised memory: see ``KVCache.zeros``)."""
        shapes = cls.block_shapes(cfg, num_slots, max_len)
        k = tuple(tuple(jnp.zeros(ks, dtype) for ks, _ in shapes) for _ in range(cfg.num_layers))
        v = tuple(tuple(jnp.zeros(vs, dtype) for _, vs in shapes) for _ in range(cfg.num_layers))
        return cls(k_blocks=k, v_blocks=v)

    @classmethod
    def abstract(cls, cfg: LlamaConfig, num_slots: int, max_len: int, dtype: jnp.dtype = jnp.float32) -> BlockedKVCache:
        """Shape-and-dtype structs of the cache, for ahead-of-time lowering."""
        shapes = cls.block_shapes(cfg, num_slots, max_len)
        k = tuple(tuple(jax.ShapeDtypeStruct(ks, dtype) for ks, _ in shapes) for _ in range(cfg.num_layers))
        v = tuple(tuple(jax.ShapeDtypeStruct(vs, dtype) for _, vs in shapes) for _ in range(cfg.num_layers))
        return cls(k_blocks=k, v_blocks=v)  # type: ignore[arg-type]
