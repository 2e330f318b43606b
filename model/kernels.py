"""The one seam between the model and its kernels: which implementation each matmul, embedding
lookup and attention call of ``model.llama`` runs. The choice is made once per engine, here
(``choose_attention``, ``choose_quant_kernel``) and by which weights the engine packs
(``model.packed_weights``), so the model's forward pass has no platform branches.

Matmuls and embedding rows: the weight's own form says which kernel reads it (``matmul``,
``embedding_rows``): an input-major array, XLA's einsum; ``cpu_matmul.Panels``, the native
float32 (or AMX bf16x3) panel kernel; ``QuantPanels``, GGUF blocks as stored, multiplied by its
``kernel`` ("native": ``model.quant_matmul``; "xla": dequantize then dot, any backend).

Attention: an ``AttentionKernels`` object, with one method per place the model writes keys and
attends (the backend protocol of mini-sglang's ``attention/base.py``):

- ``AttentionKernels`` itself (``XLA``): XLA's scatters and dots (``model.attention``,
  ``model.paged_attention``), on every backend; the reference.
- ``NativeCpuKernels`` (``NATIVE_CPU``): the CPU custom calls of ``model.cpu_attention`` (the
  per-slot blocked cache) and ``model.cpu_paged_attention`` (decode tokens over pages), one CPU
  device; what it does not override stays XLA's.

Shapes use the letters of ``model.llama``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from model import cpu_attention, cpu_matmul, cpu_paged_attention, quant_matmul, quant_panels
from model.attention import Blocks, attention_over_blocks, causal_attention_by_blocks
from model.config import LlamaConfig
from model.kv_cache import index_in_block
from model.paged_attention import ragged_paged_attention, ragged_paged_attention_blocks
from model.quant_panels import QuantPanels

Packed = QuantPanels | cpu_matmul.Panels  # weights a native kernel reads in place at a layer index
BlockSpan = tuple[int, int]  # (first position, positions) of one BlockedKVCache block


# ---- matmuls and embedding rows --------------------------------------------------------------
def matmul(x: jax.Array, w: jax.Array | Packed, equation: str) -> jax.Array:
    """x [..., in] times a weight, float32 out.

    An input-major array: ``jnp.einsum(equation, x, w)``. A packed weight (``Panels``,
    ``QuantPanels``; ``equation`` unused) gives [..., *w.out_shape], x's last axis being the
    weight's K: ``Panels`` through ``cpu_matmul.matmul``; ``QuantPanels`` through its
    ``kernel``, the native one of ``model.quant_matmul`` (set only where
    ``quant_matmul.available()``, by ``choose_quant_kernel``) or XLA's dequantize-then-dot.
    """
    if isinstance(w, cpu_matmul.Panels | QuantPanels):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if isinstance(w, cpu_matmul.Panels):
            y = cpu_matmul.matmul(x2, w)
        elif w.kernel == "native":
            y = quant_matmul.matmul(x2, w)
        else:
            y = quant_panels.xla_matmul(x2, w)
        return y.reshape(*lead, *w.out_shape)
    return jnp.einsum(equation, x, w, preferred_element_type=jnp.float32)


def embedding_rows(table: jax.Array | QuantPanels, tokens: jax.Array) -> jax.Array:
    """The rows of ``tokens`` [...] int32 of an embedding table: [..., D] float32. A table [V, D]
    as floats is indexed; one kept as stored GGUF blocks (``QuantPanels`` of the transposed
    table [D, V]) is dequantized row by row, to exactly the float values."""
    if isinstance(table, QuantPanels):
        return quant_panels.dequantize_rows(table, tokens)
    return jnp.take(table, tokens, axis=0).astype(jnp.float32)


def split_stacked(weights: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Packed]]:
    """A scanned layer loop's weights as (the arrays ``lax.scan`` slices per layer, the packed
    stacks it must not slice: stored blocks, float32 panels): XLA:CPU copies each iteration's
    slice of a stacked operand before a custom call reads it, so those go in whole, with the
    layer index (``with_stacked``)."""
    stacked = {k: v for k, v in weights.items() if isinstance(v, Packed)}
    return {k: v for k, v in weights.items() if k not in stacked}, stacked


def with_stacked(p: dict[str, Any], stacked: dict[str, Packed], layer: jax.Array) -> dict[str, Any]:
    """One layer's weights: ``p`` (sliced) and the packed stacks standing for ``layer``."""
    return {**p, **{k: dataclasses.replace(v, layer=layer) for k, v in stacked.items()}}


def has_stored_blocks(state: nnx.State) -> bool:
    """Whether any parameter of ``state`` is GGUF blocks kept as stored (``QuantPanels``)."""
    return any(isinstance(v, QuantPanels) for v in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, QuantPanels)))


def choose_quant_kernel(state: nnx.State, devices: Sequence[jax.Device]) -> tuple[nnx.State, str]:
    """``state`` with every ``QuantPanels`` parameter multiplied by the kernel its devices run:
    "native" (``model.quant_matmul``) on one CPU device where ``quant_matmul.available()``, else
    "xla" (dequantize then dot, any backend and mesh). Other parameters are returned as they are.

    Returns:
        (the state, the kernel chosen).
    """
    kernel = "native" if _one_cpu(devices) and quant_matmul.available() else "xla"
    state = jax.tree.map(
        lambda v: dataclasses.replace(v, kernel=kernel) if isinstance(v, QuantPanels) else v,
        state,
        is_leaf=lambda x: isinstance(x, QuantPanels),
    )
    return state, kernel


# ---- attention -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AttentionKernels:
    """Where the model writes new keys and values and attends, one method per place, as XLA's
    scatters and dots: every backend and mesh, and the reference the native kernels are tested
    against (``XLA``). A subclass overrides what it runs natively (``NativeCpuKernels``).
    ``native``: whether any method runs a native kernel; ``name``: for the engines' logs."""

    native: ClassVar[bool] = False
    name: ClassVar[str] = "XLA dots"

    def write_chunk(
        self, k_blocks: Blocks, v_blocks: Blocks, k: jax.Array, v: jax.Array, slot: jax.Array, start: jax.Array,
        spans: Sequence[BlockSpan],
    ) -> tuple[Blocks, Blocks]:  # fmt: skip
        """A prefill chunk's keys and values k, v [T, K, H] written into ``slot`` of the blocked
        cache at positions start .. start + T - 1, rounded to the cache's dtype; ``spans``: the
        leading blocks the chunk may reach (the rest are returned as they are). Key blocks
        [S, K, H, n], value blocks [S, K, n, H]. Positions past the cache are dropped."""
        pos = start + jnp.arange(k.shape[0], dtype=jnp.int32)
        out_k, out_v = list(k_blocks), list(v_blocks)
        for j, (b0, n) in enumerate(spans):
            idx = index_in_block(pos, b0, n)
            # k_blocks[j][slot, :, :, idx] and v_blocks[j][slot, :, idx, :] have shape [T, K, H].
            out_k[j] = k_blocks[j].at[slot, :, :, idx].set(k.astype(k_blocks[j].dtype), mode="drop")
            out_v[j] = v_blocks[j].at[slot, :, idx, :].set(v.astype(v_blocks[j].dtype), mode="drop")
        return tuple(out_k), tuple(out_v)

    def first_chunk(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
        """Causal self-attention of a chunk with nothing cached: q [B, T, K, G, H] f32 (scaled),
        k, v [B, T, K, H], mask [B, T, T] causal -> [B, T, K, G, H] f32."""
        return causal_attention_by_blocks(q, k, v, mask)

    def attend_chunk(
        self, q: jax.Array, k_blocks: Blocks, v_blocks: Blocks, slot: jax.Array, mask: jax.Array
    ) -> jax.Array:
        """A later chunk's queries q [1, T, K, G, H] over ``slot``'s rows of every block (which
        already hold the chunk's keys), masked by ``mask`` [1, T, W] (W: the cache's length):
        [1, T, K, G, H] f32."""
        rows_k = tuple(jax.lax.dynamic_index_in_dim(b, slot, axis=0) for b in k_blocks)  # [1, K, H, n]
        rows_v = tuple(jax.lax.dynamic_index_in_dim(b, slot, axis=0) for b in v_blocks)
        return attention_over_blocks(q, rows_k, rows_v, mask)

    def decode_blocks(
        self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, k_blocks: Blocks, v_blocks: Blocks,
        spans: Sequence[BlockSpan],
    ) -> tuple[jax.Array, Blocks, Blocks]:  # fmt: skip
        """One token per slot: q [S, 1, K, G, H] f32 (scaled), its key and value k, v
        [S, 1, K, H] written at ``positions`` [S] (a slot at the cache's length is idle: dropped),
        then attention over the window, the leading blocks ``spans``, up to each slot's position.

        Returns:
            (attention [S, 1, K, G, H] f32, key blocks, value blocks: every block, written).
        """
        S, K = q.shape[0], k.shape[2]
        slots, heads = jnp.arange(S)[:, None], jnp.arange(K)[None, :]
        out_k, out_v = list(k_blocks), list(v_blocks)
        for j, (b0, n) in enumerate(spans):
            # One index per (slot, KV head): XLA turns a scatter with a single index (one slot)
            # into a dynamic-update-slice, then fuses that into the read that follows, which
            # keeps the old block alive and costs a copy of it per layer.
            idx = index_in_block(positions, b0, n)[:, None]
            # k_blocks[j][slots, heads, :, idx] and v_blocks[j][slots, heads, idx, :] have shape [S, K, H].
            out_k[j] = k_blocks[j].at[slots, heads, :, idx].set(k[:, 0].astype(k_blocks[j].dtype), mode="drop")
            out_v[j] = v_blocks[j].at[slots, heads, idx, :].set(v[:, 0].astype(v_blocks[j].dtype), mode="drop")
        width = sum(n for _, n in spans)
        mask = (jnp.arange(width)[None, :] <= positions[:, None])[:, None, :]  # [S, 1, width]
        n = len(spans)
        return attention_over_blocks(q, tuple(out_k[:n]), tuple(out_v[:n]), mask), tuple(out_k), tuple(out_v)

    def paged_decode(
        self, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_tables: jax.Array, rows: jax.Array,
        positions: jax.Array, layer: jax.Array, window_pages: int,
    ) -> jax.Array:  # fmt: skip
        """Tokens attending on their own over their sequences' pages (``ragged_paged_attention``;
        arguments as there)."""
        return ragged_paged_attention(
            q, k_pages, v_pages, page_tables, rows, positions, window_pages=window_pages, layer=layer
        )

    def paged_prefill(
        self, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_tables: jax.Array, rows: jax.Array,
        positions: jax.Array, layer: jax.Array, window_pages: int, block: int,
    ) -> jax.Array:  # fmt: skip
        """Prefill chunks in blocks of ``block`` tokens of one sequence, one gathered window each
        (``ragged_paged_attention_blocks``; arguments as there)."""
        return ragged_paged_attention_blocks(
            q, k_pages, v_pages, page_tables, rows, positions, window_pages=window_pages, block=block, layer=layer
        )


@dataclasses.dataclass(frozen=True)
class NativeCpuKernels(AttentionKernels):
    """The native CPU custom calls where they exist (one CPU device; registered first by
    ``choose_attention``): the blocked cache's chunk writes, first-chunk causal attention and
    decode (``model.cpu_attention``), and decode tokens over pages (``model.cpu_paged_attention``,
    which reads each token's pages in place up to its own position). A later chunk over blocks
    and the paged prefill region stay XLA's."""

    native: ClassVar[bool] = True
    name: ClassVar[str] = "native CPU kernel"

    def write_chunk(
        self, k_blocks: Blocks, v_blocks: Blocks, k: jax.Array, v: jax.Array, slot: jax.Array, start: jax.Array,
        spans: Sequence[BlockSpan],
    ) -> tuple[Blocks, Blocks]:  # fmt: skip
        """As ``AttentionKernels.write_chunk``, in place and in the cache's dtype (XLA:CPU has no
        bfloat16 scatter); every block it reaches, whatever ``spans``."""
        return cpu_attention.write_chunk(slot, start, k, v, k_blocks, v_blocks)

    def first_chunk(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
        """As ``AttentionKernels.first_chunk``; the kernel applies the causal mask itself."""
        return cpu_attention.causal(q, k, v)

    def decode_blocks(
        self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, k_blocks: Blocks, v_blocks: Blocks,
        spans: Sequence[BlockSpan],
    ) -> tuple[jax.Array, Blocks, Blocks]:  # fmt: skip
        """As ``AttentionKernels.decode_blocks``, one custom call writing and attending in place."""
        n = len(spans)
        out, kw, vw = cpu_attention.write_and_attend(
            q[:, 0], k[:, 0], v[:, 0], positions, k_blocks[:n], v_blocks[:n]
        )  # fmt: skip
        return out[:, None], kw + k_blocks[n:], vw + v_blocks[n:]

    def paged_decode(
        self, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_tables: jax.Array, rows: jax.Array,
        positions: jax.Array, layer: jax.Array, window_pages: int,
    ) -> jax.Array:  # fmt: skip
        """As ``AttentionKernels.paged_decode``, each token reading its pages in place up to its own
        position (``window_pages`` unused)."""
        return cpu_paged_attention.paged_attention(q, k_pages, v_pages, page_tables, rows, positions, layer)


XLA = AttentionKernels()
NATIVE_CPU = NativeCpuKernels()


def _one_cpu(devices: Sequence[jax.Device]) -> bool:
    return len(devices) == 1 and devices[0].platform == "cpu"


def choose_attention(
    cache: str, devices: Sequence[jax.Device], requested: str, cfg: LlamaConfig, kv_dtype: jnp.dtype
) -> AttentionKernels:
    """The attention kernels an engine runs: ``NATIVE_CPU`` where ``requested`` is "auto", the
    engine runs on one CPU device, and the native kernel of its cache form is built and takes
    the model's heads and ``kv_dtype``; else ``XLA``.

    Args:
        cache: "blocked" (per-layer weights over a ``BlockedKVCache``: ``model.cpu_attention``),
            "paged" (``model.cpu_paged_attention``) or "dense" (the scanned ``KVCache``: XLA's
            only).
        devices: the engine's mesh devices.
        requested: the engine's ``decode_attention``: "auto" or "xla".
        cfg: the model's shapes (query heads per KV head, head dim).
        kv_dtype: the cache's dtype.
    """
    module = {"blocked": cpu_attention, "paged": cpu_paged_attention}.get(cache)
    if requested != "auto" or module is None or not _one_cpu(devices):
        return XLA
    if module.supports(cfg.q_per_kv, cfg.head_dim, kv_dtype) and module.available():
        return NATIVE_CPU
    return XLA
