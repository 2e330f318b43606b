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
