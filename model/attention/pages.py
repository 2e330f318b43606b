"""The paged KV cache: one key and one value array of fixed-size pages for all layers, and the
write of a flat batch of new tokens' keys and values into it.

A sequence's page table lists its pages in order, so its position ``i`` lives in page
``page_table[i // page_size]`` at offset ``i % page_size``: the flat *slot*
``page * page_size + offset`` (Kwon et al. 2023, "PagedAttention", §4.2; the same numbering as
``service/engine/block_manager.py``). Page tables are step inputs, never part of the cache, so a jitted
step's cache arguments are 2 arrays whatever the number of layers, of pages or the longest
sequence.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from model.config import KV_SCALE_BYTES, LlamaConfig

# Logical axes of the stacked page arrays, in order. sharding/plan.py's rules map "layers" to
# no mesh axis (the scan over layers indexes it), "kv_heads" to the ``model`` mesh axis (with
# attention="heads") and "pages" to the ``data`` axis (each data replica holds its own range of
# pages, which only its own rows' page tables name), and leave "page_len" and "head_dim" whole.
PAGE_AXES = ("layers", "pages", "kv_heads", "page_len", "head_dim")


# An 8-bit cache (``--kv-dtype int8``) holds each (token, KV head) row of H values as H int8
# codes followed by its scale, a float16 bitcast into 2 more int8s (llama.cpp's Q8_0 rule, one
# block per row: ``to_stored``): H + 2 bytes where bfloat16 takes 2 H.
QUANTIZED = jnp.dtype(jnp.int8)
_CODE_MAX = 127.0
_SCALE_MAX = float(jnp.finfo(jnp.float16).max)


# A bfloat16 cache's pages hold the values' bits as uint16: XLA:CPU runs a bfloat16 scatter into
# the scanned pool (``write_kv``) by widening the whole pool to float32 and back each layer (4.4 s
# a step for SmolLM2 at a 65k-token pool; the same scatter of uint16: under a millisecond), and a
# bitcast of the whole pool inside the step copies it. The kernels read the bits as bfloat16.
BF16_BITS = jnp.dtype(jnp.uint16)


def storage_dtype(kv_dtype: Any) -> jnp.dtype:
    """The dtype of the page arrays of a cache of ``kv_dtype``: uint16 for bfloat16 (its bits),
    else ``kv_dtype`` itself."""
    kv_dtype = jnp.dtype(kv_dtype)
    return BF16_BITS if kv_dtype == jnp.bfloat16 else kv_dtype


def value_dtype(pages_dtype: Any) -> jnp.dtype:
    """The dtype new keys and values should come in for pages of ``pages_dtype`` (what
    ``to_stored`` keeps exactly): bfloat16 for its bits, float32 for 8-bit codes, else the
    pages' own."""
    pages_dtype = jnp.dtype(pages_dtype)
    if pages_dtype == BF16_BITS:
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(jnp.float32) if pages_dtype == QUANTIZED else pages_dtype


def stored_head_dim(head_dim: int, dtype: Any) -> int:
    """The last axis of the page arrays in ``dtype``: ``head_dim``, plus the scale's
    ``KV_SCALE_BYTES`` in an 8-bit cache."""
    return head_dim + KV_SCALE_BYTES if jnp.dtype(dtype) == QUANTIZED else head_dim


def head_dim_of(pages: jax.Array) -> int:
    """H, the head dim, of page arrays [..., H'] (``stored_head_dim``'s inverse)."""
    return int(pages.shape[-1]) - (KV_SCALE_BYTES if pages.dtype == QUANTIZED else 0)


def to_stored(x: jax.Array, dtype: Any) -> jax.Array:
    """Keys or values [..., H] as pages of ``dtype`` hold them: rounded to a float dtype
    (nearest even; to bfloat16's bits for ``BF16_BITS``), or, in an 8-bit cache, [..., H + 2]
    int8: llama.cpp's Q8_0 rule with one block per row (``ggml-quants.c``; gguf's ``Q8_0.quantize_blocks`` is its bit-exact
    reference): d = max|x| / 127 in float32, codes round(x x (1 / d)) half away from zero (0
    where d = 0), then d's float16 bytes. Dettmers et al. 2022 ("LLM.int8()", §3.1) give the
    absmax rule; a scale per token and KV head is what vLLM's and llama.cpp's 8-bit caches keep."""
    dtype = jnp.dtype(dtype)
    if dtype == BF16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), BF16_BITS)
    if dtype != QUANTIZED:
        return x.astype(dtype)
    x = x.astype(jnp.float32)
    d = jnp.minimum(jnp.max(jnp.abs(x), axis=-1, keepdims=True) / _CODE_MAX, _SCALE_MAX)
    inv = jnp.where(d == 0, 0.0, 1.0 / jnp.where(d == 0, 1.0, d))
    scaled = x * inv
    codes = jnp.clip(jnp.trunc(scaled + jnp.copysign(0.5, scaled)), -_CODE_MAX, _CODE_MAX).astype(QUANTIZED)
    scale_bytes = jax.lax.bitcast_convert_type(d.astype(jnp.float16), QUANTIZED).reshape(*x.shape[:-1], KV_SCALE_BYTES)
    return jnp.concatenate([codes, scale_bytes], axis=-1)


def from_stored(pages: jax.Array) -> jax.Array:
    """``to_stored``'s rows [..., H'] back as float32 [..., H]: widened exactly (bfloat16 bits
    as bfloat16), or an 8-bit row's codes times its scale."""
    if pages.dtype == BF16_BITS:
        return jax.lax.bitcast_convert_type(pages, jnp.bfloat16).astype(jnp.float32)
    if pages.dtype != QUANTIZED:
        return pages.astype(jnp.float32)
    H = head_dim_of(pages)
    scale = jax.lax.bitcast_convert_type(pages[..., H:], jnp.float16).astype(jnp.float32)
    return pages[..., :H].astype(jnp.float32) * scale[..., None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    """Keys and values of every layer, in pages shared by all sequences.

    Attributes:
        k: [L, P, K, page_size, H] (L layers, P pages, K KV heads, H head dim), keys already
            rotated by RoPE, dtype = the cache dtype (a bfloat16 cache's bits as uint16:
            ``storage_dtype``); in an 8-bit cache [L, P, K, page_size,
            H + 2] int8, each row's codes and scale (``to_stored``).
        v: [L, P, K, page_size, H] (H + 2), values, same shape and dtype.

    Stacked over layers, one array each for keys and values: a jitted step's cache arguments
    are 2 leaves whatever L (the per-layer form's 2 x L leaves cost dispatch time per leaf,
    docs/performance.md, "Dispatch cost"), and the ``lax.scan`` over layers
    (``model.llama.Llama.forward``) carries both buffers, writing layer l's new
    tokens into them in place (a scatter at [l, page, :, offset, :]) and gathering layer l's
    pages straight out of them (``k[l, pages]``). Neither slices out a whole layer first: a
    dynamic slice of one layer is a copy of that layer's whole pool on XLA:CPU.

    Layout within a layer, [pages, kv_heads, page_len, head_dim]: one (page, KV head) is a
    contiguous [page_size, H] tile, so attention for one KV head walks a sequence's pages tile
    by tile, each a whole contiguous read that the G query heads of the group share (the
    grouping of jax-llm-examples' ``PagedKVCache``, [kv_heads, pages, page_size, head_dim],
    whose tiles are the same); pages lead, rather than heads, so a page's K heads are one
    contiguous block and writing a token touches one [K, H] slice of one page (vLLM's original
    PagedAttention kernel orders its blocks the same way, heads right after blocks: keys
    [blocks, K, H/x, block_size, x], values [blocks, K, H, block_size]). tpu-inference's ragged
    paged attention interleaves K and V in one [pages, page_size, 2K, H] array (packed into
    32-bit words) and vLLM's FlashAttention backend is token-major ([2, blocks, block_size, K,
    H]): positions before heads, which suits kernels reading all heads of a position at once,
    not this per-head walk. Pages hold stale values until overwritten; attention masks every
    position past a token's own, so they are never read into a result (and are finite: the
    pool starts as zeros).
    """

    k: jax.Array
    v: jax.Array

    @property
    def num_layers(self) -> int:
        return int(self.k.shape[0])

    @property
    def num_pages(self) -> int:
        return int(self.k.shape[1])

    @property
    def page_size(self) -> int:
        """Token positions per page."""
        return int(self.k.shape[3])

    @property
    def num_slots(self) -> int:
        """Token positions in the whole pool (per layer): num_pages x page_size."""
        return self.num_pages * self.page_size

    @staticmethod
    def shape(
        cfg: LlamaConfig, num_pages: int, page_size: int, dtype: Any = jnp.float32
    ) -> tuple[int, int, int, int, int]:
        """[L, P, K, page_size, H'] of the key (or value) array in ``dtype``, H' =
        ``stored_head_dim(H, dtype)``; ``shape(...)[1:]`` is one layer's.

        Raises:
            ValueError: num_pages or page_size below 1.
        """
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages} and {page_size}")
        return (cfg.num_layers, num_pages, cfg.num_kv_heads, page_size, stored_head_dim(cfg.head_dim, dtype))

    @classmethod
    def zeros(cls, cfg: LlamaConfig, num_pages: int, page_size: int, dtype: Any = jnp.float32) -> PagedKVCache:
        """A zero-filled cache of ``dtype`` (its arrays in ``storage_dtype(dtype)``; never
        ``jnp.empty``: uninitialised memory may hold NaN, and 0 * NaN = NaN would leak through
        the attention mask; int8 rows of zeros read as zeros).

        Raises:
            ValueError: num_pages or page_size below 1.
        """
        shape, stored = cls.shape(cfg, num_pages, page_size, dtype), storage_dtype(dtype)
        return cls(k=jnp.zeros(shape, stored), v=jnp.zeros(shape, stored))

    @classmethod
    def abstract(cls, cfg: LlamaConfig, num_pages: int, page_size: int, dtype: Any = jnp.float32) -> PagedKVCache:
        """Shape-and-dtype structs of the cache, for ahead-of-time lowering and shardings.

        Raises:
            ValueError: num_pages or page_size below 1.
        """
        struct: Any = jax.ShapeDtypeStruct(cls.shape(cfg, num_pages, page_size, dtype), storage_dtype(dtype))
        return cls(k=struct, v=struct)

    def nbytes(self) -> int:
        """Total bytes of K and V over all layers: 2 x L x P x K x page_size x H' x itemsize
        (H' = ``stored_head_dim``)."""
        return sum(int(a.size) * jnp.dtype(a.dtype).itemsize for a in (self.k, self.v))


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
    k_pages: jax.Array,
    v_pages: jax.Array,
    slots: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    layer: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Scatter N new tokens' keys and values into one layer's pages at flat slots.

    Args:
        k_pages, v_pages: one layer's pages [P, K, page_size, H] when ``layer`` is None, else
            the stacked pages of every layer [L, P, K, page_size, H] (``PagedKVCache.k``/``v``),
            of which only layer ``layer`` is written. Donate them in the jitted step (or carry
            them through a ``lax.scan``) and XLA updates them in place.
        slots: [N] int32, token n's slot ``page * page_size + offset`` (``slot_mapping``). A
            slot outside [0, P * page_size), e.g. -1 or P * page_size, marks a padding token:
            its write is dropped, never clamped onto a real slot (negative slots are mapped past
            the end first, since a scatter would otherwise wrap -1 onto the last page). Real
            slots must be distinct: which of two writes to one slot lands is unspecified.
        k_new, v_new: [N, K, H], as the pages hold them when written (``to_stored``: rounded
            to a float dtype, or 8-bit codes and a scale per row).
        layer: None, or an int32 scalar in [0, L), static or traced (a scan's layer index).

    Returns:
        (k_pages, v_pages) with the N tokens written, shapes as given.
    """
    stacked = layer is not None
    P, _, page_size, _ = k_pages.shape[1:] if stacked else k_pages.shape
    valid = (slots >= 0) & (slots < P * page_size)
    page = jnp.where(valid, slots // page_size, P)  # P: out of range, dropped by mode="drop"
    offset = jnp.where(valid, slots % page_size, 0)
    k_new, v_new = to_stored(k_new, k_pages.dtype), to_stored(v_new, v_pages.dtype)
    if stacked:
        # pages[layer, page, :, offset, :] has shape [N, K, H]: the scalar layer broadcasts
        # against the [N] pages and offsets, and the advanced indices' axis goes first.
        k_pages = k_pages.at[layer, page, :, offset, :].set(k_new, mode="drop")
        v_pages = v_pages.at[layer, page, :, offset, :].set(v_new, mode="drop")
        return k_pages, v_pages
    # pages[page, :, offset, :] has shape [N, K, H] (the two advanced indices go first).
    k_pages = k_pages.at[page, :, offset, :].set(k_new, mode="drop")
    v_pages = v_pages.at[page, :, offset, :].set(v_new, mode="drop")
    return k_pages, v_pages
