"""The paged KV cache: per layer one key and one value array of fixed-size pages, and the write
of a flat batch of new tokens' keys and values into it.

Building blocks of the paged engine (issue 19), not yet used by the engine.

A sequence's page table lists its pages in order, so its position ``i`` lives in page
``page_table[i // page_size]`` at offset ``i % page_size``: the flat *slot*
``page * page_size + offset`` (Kwon et al. 2023, "PagedAttention", §4.2; the same numbering as
``service/block_manager.py``). Page tables are step inputs, never part of the cache, so a jitted
step's cache arguments are 2 x L arrays whatever the number of pages or the longest sequence.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from model.config import LlamaConfig

# Logical axes of one layer's page array, in order. sharding/plan.py's rules map "kv_heads" to
# the ``model`` mesh axis (with attention="heads") and name neither "pages" nor "page_len", which
# ``sharding.rules.spec_for`` then leaves unsplit: every device holds every page of its KV heads,
# so one page table serves all devices.
PAGE_AXES = ("pages", "kv_heads", "page_len", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    """Keys and values of every layer, in pages shared by all sequences.

    Attributes:
        k: L arrays [P, K, page_size, H] (P pages, K KV heads, H head dim), keys already
            rotated by RoPE, dtype = the cache dtype.
        v: L arrays [P, K, page_size, H], values, same shapes and dtype.

    Layout, [pages, kv_heads, page_len, head_dim]: one (page, KV head) is a contiguous
    [page_size, H] tile, so attention for one KV head walks a sequence's pages tile by tile,
    each a whole contiguous read that the G query heads of the group share (the grouping of
    jax-llm-examples' ``PagedKVCache``, [kv_heads, pages, page_size, head_dim], whose tiles are
    the same); pages lead, rather than heads, so a page's K heads are one contiguous block and
    writing a token touches one [K, H] slice of one page (vLLM's original PagedAttention
    kernel orders its blocks the same way, heads right after blocks: keys [blocks, K, H/x,
    block_size, x], values [blocks, K, H, block_size]). tpu-inference's ragged paged attention
    interleaves K and V in one [pages, page_size, 2K, H] array (packed into 32-bit words) and
    vLLM's FlashAttention backend is token-major ([2, blocks, block_size, K, H]): positions
    before heads, which suits kernels reading all heads of a position at once, not this
    per-head walk. Separate K and V
    arrays per layer (not one stacked [L, ...] array) keep each a whole buffer, as
    ``model.kv_cache.BlockedKVCache`` does for XLA:CPU, and give the jit signature 2 x L cache
    leaves. Pages hold stale values until overwritten; attention masks every position past a
    token's own, so they are never read.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_pages(self) -> int:
        return int(self.k[0].shape[0])

    @property
    def page_size(self) -> int:
        """Token positions per page."""
        return int(self.k[0].shape[2])

    @property
    def num_slots(self) -> int:
        """Token positions in the whole pool: num_pages x page_size."""
        return self.num_pages * self.page_size

    @staticmethod
    def shape(cfg: LlamaConfig, num_pages: int, page_size: int) -> tuple[int, int, int, int]:
        """[P, K, page_size, H] of one layer's key (or value) array.

        Raises:
            ValueError: num_pages or page_size below 1.
        """
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages} and {page_size}")
        return (num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)

    @classmethod
    def zeros(cls, cfg: LlamaConfig, num_pages: int, page_size: int, dtype: jnp.dtype = jnp.float32) -> PagedKVCache:
        """A zero-filled cache (zeros, not uninitialised memory: see ``KVCache.zeros``).

        Raises:
            ValueError: num_pages or page_size below 1.
        """
        shape = cls.shape(cfg, num_pages, page_size)
        L = cfg.num_layers
        return cls(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(L)), v=tuple(jnp.zeros(shape, dtype) for _ in range(L))
        )

    @classmethod
    def abstract(cls, cfg: LlamaConfig, num_pages: int, page_size: int, dtype: jnp.dtype = jnp.float32) -> PagedKVCache:
        """Shape-and-dtype structs of the cache, for ahead-of-time lowering and shardings.

        Raises:
            ValueError: num_pages or page_size below 1.
        """
        struct: Any = jax.ShapeDtypeStruct(cls.shape(cfg, num_pages, page_size), dtype)
        return cls(k=(struct,) * cfg.num_layers, v=(struct,) * cfg.num_layers)

    def nbytes(self) -> int:
        """Total bytes of K and V over all layers: 2 x L x P x K x page_size x H x itemsize."""
        return sum(int(a.size) * jnp.dtype(a.dtype).itemsize for a in (*self.k, *self.v))


def slot_mapping(page_tables: jax.Array, seq_of_token: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Each token's flat cache slot, ``page_tables[s, p // page_size] * page_size + p % page_size``
    for token n of sequence s = ``seq_of_token[n]`` at position p = ``positions[n]``; -1 for a
    padding token (``seq_of_token`` outside [0, B), or a negative position), which
    ``write_kv`` drops.

    Shapes: page_tables [B, max_pages] int32; seq_of_token, positions [N] int32. Returns [N]
    int32. A position at or past ``max_pages * page_size`` is the caller's error (its page
    index is clipped to the last column, as JAX clips out-of-range gathers).
    """
    B = page_tables.shape[0]
    pad = (seq_of_token < 0) | (seq_of_token >= B) | (positions < 0)
    s = jnp.clip(seq_of_token, 0, B - 1)
    p = jnp.maximum(positions, 0)
    page = page_tables[s, p // page_size]
    return jnp.where(pad, -1, page * page_size + p % page_size).astype(jnp.int32)


def write_kv(
    k_pages: jax.Array, v_pages: jax.Array, slots: jax.Array, k_new: jax.Array, v_new: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Scatter N new tokens' keys and values into one layer's pages at flat slots.

    Args:
        k_pages, v_pages: [P, K, page_size, H], the layer's pages (donate them in the jitted
            step and XLA updates them in place).
        slots: [N] int32, token n's slot ``page * page_size + offset`` (``slot_mapping``). A
            slot outside [0, P * page_size), e.g. -1 or P * page_size, marks a padding token:
            its write is dropped, never clamped onto a real slot (negative slots are mapped past
            the end first, since a scatter would otherwise wrap -1 onto the last page). Real
            slots must be distinct: which of two writes to one slot lands is unspecified.
        k_new, v_new: [N, K, H], rounded to the pages' dtype (nearest even) when written.

    Returns:
        (k_pages, v_pages) with the N tokens written.
    """
    P, _, page_size, _ = k_pages.shape
    valid = (slots >= 0) & (slots < P * page_size)
    page = jnp.where(valid, slots // page_size, P)  # P: out of range, dropped by mode="drop"
    offset = jnp.where(valid, slots % page_size, 0)
    # pages[page, :, offset, :] has shape [N, K, H] (the two advanced indices go first).
    k_pages = k_pages.at[page, :, offset, :].set(k_new.astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[page, :, offset, :].set(v_new.astype(v_pages.dtype), mode="drop")
    return k_pages, v_pages
