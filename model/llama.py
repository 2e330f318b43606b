"""A Llama decoder in Flax NNX, with the pure entry points the engine jits: prefill and decode, and
the paged engine's ragged step (issue 19; not yet used by the engine).

Architecture (Touvron et al. 2023, "LLaMA", §2.2): pre-norm RMSNorm (Zhang & Sennrich 2019),
rotary position embeddings (Su et al. 2021, "RoFormer", §3.4.2, in Hugging Face's rotate-half
form), grouped-query attention (Ainslie et al. 2023), SwiGLU MLP (Shazeer 2020), optionally
tied LM head.

Einsum letters used throughout:
    B batch rows (slots in decode, 1 in prefill)   T query positions   U new key positions
    S cached key positions (the attended window)   D embed (hidden)   F MLP width
    N query heads   K KV heads   G query heads per KV head (N = K * G)   H head dim   V vocab
    L layers

Layers are stored stacked (every parameter has a leading L axis) and run with ``jax.lax.scan``,
so a 30-layer model compiles one block, not thirty, over a ``KVCache`` [L, S, K, T, H]. The
per-layer form (``unstack_layers``) runs them as an unrolled loop over a ``BlockedKVCache``,
the faster steps on XLA:CPU. ``ragged_step`` runs the stacked form over a ``PagedKVCache``
[L, P, K, page_size, H] (``Llama.run_layers_paged``). Every parameter carries ``logical_axes``
metadata; ``sharding/rules.py`` maps those names to mesh axes. The model never imports sharding.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import cpu_attention, cpu_matmul, cpu_paged_attention, quant_matmul, quant_panels
from model.config import LlamaConfig, RopeScaling
from model.kv_cache import BlockedKVCache, KVCache, block_starts, index_in_block
from model.paged_attention import ragged_paged_attention, ragged_paged_attention_blocks
from model.paged_kv import PagedKVCache, slot_mapping, write_kv
from model.quant_panels import QuantPanels

Blocks = tuple[jax.Array, ...]  # one layer's cache blocks (BlockedKVCache)
# (q, new k, new v, key blocks, value blocks) -> (attention, written key blocks, value blocks)
WriteAndAttend = Callable[[jax.Array, jax.Array, jax.Array, Blocks, Blocks], tuple[jax.Array, Blocks, Blocks]]
# (q [N, K, G, H], stacked key pages, value pages [L, P, K, page_size, H], layer index) -> attention [N, K, G, H]
PagedAttend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def write_then_attend(
    write: Callable[[Blocks, Blocks, jax.Array, jax.Array], tuple[Blocks, Blocks]],
    attend: Callable[[jax.Array, jax.Array, jax.Array, Blocks, Blocks], jax.Array],
) -> WriteAndAttend:
    """One layer's cache update then attention as ``Llama.run_layers_in_place`` takes them:
    ``write`` (key blocks, value blocks, new k, new v) -> written blocks, then ``attend``
    (q, new k, new v, written blocks) -> attention output, reading what ``write`` wrote."""

    def step(q: jax.Array, k: jax.Array, v: jax.Array, kb: Blocks, vb: Blocks) -> tuple[jax.Array, Blocks, Blocks]:
        kb, vb = write(kb, vb, k, v)
        return attend(q, k, v, kb, vb), kb, vb

    return step


NEG_INF = -1e30  # finite, so a fully masked row gives a uniform softmax instead of NaN


def _param(value: jax.Array, axes: tuple[str, ...]) -> nnx.Param:
    assert value.ndim == len(axes), (value.shape, axes)
    return nnx.Param(value, logical_axes=axes)


class DecoderLayers(nnx.Module):
    """The L decoder blocks, with parameters stacked on a leading layer axis.

    Parameters (shape, logical axes):
        attn_norm [L, D] (layers, embed); wqkv [L, D, K, G + 2, H] (layers, embed, kv_heads,
        qkv, head_dim); wo [L, N, H, D] (layers, q_heads, head_dim, embed); mlp_norm [L, D];
        w_gate_up [L, D, 2, F] (layers, embed, gate_up, mlp); w_down [L, F, D] (layers, mlp,
        embed).
    Weights are stored input-major (x @ W), the faster layout for XLA on CPU. A matmul weight
    (wqkv, wo, w_gate_up, w_down; also ``Llama.embed`` and ``lm_head``) may instead hold a GGUF's
    blocks as stored (``model.quant_panels.QuantPanels``, same logical axes), which ``dense``
    multiplies by at exactly their dequantized values.

    The Q, K and V projections are one array, grouped by KV head: ``wqkv[:, :, k, :G]`` are the
    G query heads k*G .. k*G+G-1 that share KV head k (grouped-query attention, Ainslie et al.
    2023), ``wqkv[:, :, k, G]`` its key and ``wqkv[:, :, k, G + 1]`` its value projection. So
    one matmul computes all three, and splitting the ``kv_heads`` axis over a mesh gives each
    device whole groups, as splitting separate Q (over q_heads) and K/V (over kv_heads)
    projections would. Gate and up are one array for the same reason. One matmul instead of
    three (two) matters on CPU, where small matvecs stream weights slower than large ones
    (docs/cpu-kernels.md has the timings).
    ``fuse_projections`` builds both from the separate projections the loaders read.
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        L, D, N, K, H, F, _ = cfg.dims
        init = nnx.initializers.normal(0.02)

        def w(shape: tuple[int, ...], axes: tuple[str, ...]) -> nnx.Param:
            return _param(init(rngs.params(), shape, dtype), axes)

        self.attn_norm = _param(jnp.ones((L, D), dtype), ("layers", "embed"))
        self.wqkv = w((L, D, K, N // K + 2, H), ("layers", "embed", "kv_heads", "qkv", "head_dim"))
        self.wo = w((L, N, H, D), ("layers", "q_heads", "head_dim", "embed"))
        self.mlp_norm = _param(jnp.ones((L, D), dtype), ("layers", "embed"))
        self.w_gate_up = w((L, D, 2, F), ("layers", "embed", "gate_up", "mlp"))
        self.w_down = w((L, F, D), ("layers", "mlp", "embed"))

    NAMES = ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down")

    def weights(self) -> dict[str, Any]:
        """The raw parameter values keyed by name: stacked arrays [L, ...], or tuples of L
        per-layer arrays when the state is in the per-layer form of ``unstack_layers``."""
        return {name: getattr(self, name).get_value() for name in self.NAMES}

    def per_layer(self) -> bool:
        """True when the parameters are in the per-layer form (``unstack_layers``)."""
        return isinstance(self.wqkv.get_value(), tuple)


def fuse_projections(layers: dict[str, Any], num_kv_heads: int) -> dict[str, Any]:
    """The loaders' separate projections as ``DecoderLayers``' fused parameters (numpy, host).

    Args:
        layers: stacked layer weights with separate projections: "wq" [L, D, N, H], "wk" and
            "wv" [L, D, K, H], "w_gate" and "w_up" [L, D, F], and the rest ("attn_norm", "wo",
            "mlp_norm", "w_down") as they are. A group absent (Q/K/V, or gate/up: a loader
            that kept its blocks as stored fused them itself) is not fused.
        num_kv_heads: K; query head n belongs to KV head n // (N / K), as in Hugging Face's
            ``repeat_kv``.

    Returns:
        the same dict with "wqkv" [L, D, K, N/K + 2, H] and "w_gate_up" [L, D, 2, F] in place
        of the five separate arrays (dtype kept).
    """
    out = {k: v for k, v in layers.items() if k not in ("wq", "wk", "wv", "w_gate", "w_up")}
    if "wq" in layers:
        wq = np.asarray(layers["wq"])
        L, D, N, H = wq.shape
        K = num_kv_heads
        q = wq.reshape(L, D, K, N // K, H)
        out["wqkv"] = np.concatenate(
            [q, np.asarray(layers["wk"])[:, :, :, None], np.asarray(layers["wv"])[:, :, :, None]], axis=3
        )
    if "w_gate" in layers:
        out["w_gate_up"] = np.stack([np.asarray(layers["w_gate"]), np.asarray(layers["w_up"])], axis=2)
    return out


def unstack_layers(state: nnx.State) -> nnx.State:
    """The per-layer form of a Llama state: every stacked layer parameter [L, ...] becomes a
    tuple of L arrays [...] (the same Param with the same metadata; numpy inputs give views,
    device arrays give slices, abstract ones give per-layer ShapeDtypeStructs). Parameters
    without a leading "layers" axis, and ones already split, are returned as they are.

    Why: inside ``lax.scan`` XLA:CPU materialises each iteration's dynamic slice of a stacked
    weight before the dot reads it, so a scanned decode step moves its weights about twice,
    and static slices of one stacked array in an unrolled loop are slower still
    (docs/cpu-kernels.md). An
    engine with ``EngineConfig(layers="unrolled")`` keeps its weights in this form, and
    ``prefill``/``decode_step`` then run the layers as an unrolled loop
    (``Llama.run_layers_in_place``); the price is compile time (L blocks per program).
    """

    def split(var: nnx.Variable) -> nnx.Variable:
        value = var.get_value()
        if var.get_metadata()["logical_axes"][:1] != ("layers",) or isinstance(value, tuple):
            return var
        n = jax.tree.leaves(value)[0].shape[0]  # a QuantPanels value's leaves share the L axis

        def layer(a: Any, i: int) -> Any:
            return jax.ShapeDtypeStruct(a.shape[1:], a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a[i]

        return var.replace(tuple(jax.tree.map(lambda a, i=i: layer(a, i), value) for i in range(n)))

    return jax.tree.map(split, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def stack_layers(state: nnx.State) -> nnx.State:
    """Inverse of ``unstack_layers``: per-layer tuples become stacked arrays [L, ...] again
    (a copy, with ``jnp.stack``)."""

    def join(var: nnx.Variable) -> nnx.Variable:
        value = var.get_value()
        return var.replace(jax.tree.map(lambda *xs: jnp.stack(xs), *value)) if isinstance(value, tuple) else var

    return jax.tree.map(join, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


class Llama(nnx.Module):
    """A Llama-architecture causal LM.

    Parameters: ``embed`` [V, D] (vocab, embed); ``layers`` (see DecoderLayers); ``final_norm``
    [D] (embed); ``lm_head`` [D, V] (embed, vocab) only when embeddings are untied.
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        self.cfg = cfg
        self.embed = _param(
            nnx.initializers.normal(0.02)(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype),
            ("vocab", "embed"),
        )
        self.layers = DecoderLayers(cfg, rngs=rngs, dtype=dtype)
        self.final_norm = _param(jnp.ones((cfg.hidden_size,), dtype), ("embed",))
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(
                nnx.initializers.normal(0.02)(rngs.params(), (cfg.hidden_size, cfg.vocab_size), dtype),
                ("embed", "vocab"),
            )

    # ---- pieces -------------------------------------------------------------------------
    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """The embedding rows of ``tokens`` [...] int32: [..., D] float32. A table kept as
        stored GGUF blocks (``QuantPanels`` of the transposed table [D, V]) is dequantized row
        by row, to exactly the float values."""
        table = self.embed.get_value()
        if isinstance(table, QuantPanels):
            return quant_panels.dequantize_rows(table, tokens)
        return jnp.take(table, tokens, axis=0).astype(jnp.float32)

    def logits(self, h: jax.Array, head: cpu_matmul.Panels | None = None) -> jax.Array:
        """Final RMSNorm and LM head: h [..., D] -> logits [..., V] float32; ``head``: the LM head
        packed for the native kernel (``panel_weights``), used instead of the module's (h [S, D])."""
        h = rms_norm(h, self.final_norm[...], self.cfg.rms_norm_eps)
        if head is not None:
            return cpu_matmul.matmul(h, head)
        if self.cfg.tie_word_embeddings:
            emb = self.embed.get_value()
            if isinstance(emb, QuantPanels):  # the table as stored is already [D, V]
                return dense(h, emb, "")
            return jnp.einsum("...D,VD->...V", h.astype(emb.dtype), emb, preferred_element_type=jnp.float32)
        w = self.lm_head.get_value()
        if isinstance(w, QuantPanels):
            return dense(h, w, "")
        return jnp.einsum("...D,DV->...V", h.astype(w.dtype), w, preferred_element_type=jnp.float32)

    def run_layers(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache_k: jax.Array | None,
        cache_v: jax.Array | None,
        cache_mask: jax.Array | None,
        new_mask: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """All decoder blocks over new tokens that attend to a read-only cache window.

        Args:
            tokens: [B, T] int32 token ids.
            positions: [B, T] int32 absolute positions (RoPE angles).
            cache_k, cache_v: [L, B, K, S', H] the cache rows of the batch (S' >= S positions;
                only the first S, the attended window, are read), or None when nothing is
                cached yet.
            cache_mask: [B, T, S] bool, True where query t may attend cached position s.
            new_mask: [B, T, U] bool, True where query t may attend new token u (U = T).

        Returns:
            hidden [B, T, D] float32 after the last block; new keys and values
            [L, B, T, K, H] each (RoPE applied), to be written into the cache by the caller.
        """
        cfg = self.cfg
        x = self.embed_tokens(tokens)
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        sliced, stacked = split_stacked(self.layers.weights())
        xs: dict[str, Any] = {"p": sliced, "layer": jnp.arange(cfg.num_layers, dtype=jnp.int32)}
        if cache_k is not None:
            xs["ck"], xs["cv"] = cache_k, cache_v

        window = cache_mask.shape[-1] if cache_mask is not None else 0

        def body(x: jax.Array, layer: dict[str, Any]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            ck, cv = layer.get("ck"), layer.get("cv")
            if ck is not None and cv is not None:
                ck, cv = ck[:, :, :window], cv[:, :, :window]  # this layer's slice, then the window
            p = with_stacked(layer["p"], stacked, layer["layer"])
            x, k, v = decoder_block(cfg, x, p, cos, sin, ck, cv, cache_mask, new_mask)
            return x, (k, v)

        x, (new_k, new_v) = jax.lax.scan(body, x, xs)
        return x, new_k, new_v

    def run_layers_paged(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: PagedKVCache,
        slots: jax.Array,
        attend: PagedAttend,
        panels: dict[str, Any] | None = None,
    ) -> tuple[jax.Array, PagedKVCache]:
        """All decoder blocks over a flat batch of N tokens and a paged cache, as one
        ``lax.scan`` over the stacked weights that carries (x, key pages, value pages): block l
        writes its N new keys and values into layer l of the carried pages (a scatter in place,
        ``paged_kv.write_kv`` with the layer index) *before* attending, then attends through
        ``attend``, which reads the pages it was given, so a token sees its own key and every
        key written for its sequence in this step, and each read depends on the write before it
        (the order ``run_layers_in_place`` explains).

        Args:
            tokens: [N] int32 token ids in [0, V) (padding tokens too: any valid id).
            positions: [N] int32 absolute positions (RoPE angles; padding any value).
            cache: the paged cache [L, P, K, page_size, H] (donated by the caller's jit).
            slots: [N] int32 flat slots (``paged_kv.slot_mapping``); out of range = not written.
            attend: (q [N, K, G, H] f32 scaled, key pages, value pages [L, P, K, page_size, H]
                with this block's keys written, layer int32 scalar) -> attention [N, K, G, H]
                f32, e.g. ``ragged_paged_attention(..., layer=layer)``.
            panels: layer matmul weights packed as stacks for the native kernel
                (``stacked_panel_weights``), used instead of the module's by the same name.

        Returns:
            hidden [N, D] float32 after the last block, and the cache with every token whose
            slot is in range written in every layer (keys and values rounded to the cache dtype;
            attention read exactly those).
        """
        cfg = self.cfg
        assert not self.layers.per_layer(), "run_layers_paged runs the stacked weights (lax.scan)"
        x = self.embed_tokens(tokens)[None]  # [1, N, D]: B = 1, T = N
        cos, sin = rope_tables(positions[None], cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        cdt = cache.k.dtype

        def body(
            carry: tuple[jax.Array, jax.Array, jax.Array], xs: tuple[dict[str, Any], jax.Array]
        ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], None]:
            x, k, v = carry
            p, layer = xs
            p = with_stacked(p, stacked, layer)
            q, k_new, v_new = project_qkv(cfg, x, p, cos, sin, cdt)
            k, v = write_kv(k, v, slots, k_new[0], v_new[0], layer)
            attn = attend(q[0], k, v, layer)
            return (out_and_mlp(cfg, x, p, attn[None]), k, v), None

        layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        weights = self.layers.weights()
        weights.update({name: w for name, w in (panels or {}).items() if name in weights})
        sliced, stacked = split_stacked(weights)
        (x, k, v), _ = jax.lax.scan(body, (x, cache.k, cache.v), (sliced, layers))
        return x[0], PagedKVCache(k=k, v=v)

    def run_layers_in_place(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: BlockedKVCache,
        write_and_attend: WriteAndAttend,
        panels: dict[str, Any] | None = None,
        attend_dtype: jnp.dtype | None = None,
    ) -> tuple[jax.Array, BlockedKVCache]:
        """All decoder blocks as an unrolled loop over per-layer weights (``unstack_layers``),
        each block writing its new keys and values into the cache *before* attending.

        Writing first gives every cache read a data dependency on the write that precedes it,
        so XLA updates the donated cache in place; reading a window of the old cache while a
        later write is pending makes XLA:CPU copy the whole cache twice per step.

        Args:
            tokens, positions: [B, T] int32 ids and absolute positions.
            cache: the blocked KV cache (``BlockedKVCache``).
            write_and_attend: (q [B, T, K, G, H], new k, new v [B, T, K, H], the layer's key
                blocks, value blocks) -> (attention output [B, T, K, G, H] float32, the blocks
                with the new entries written): XLA's scatters and dots composed by
                ``write_then_attend``, or the native decode kernel (``model.cpu_attention``).
            panels: matmul weights packed for the native kernel (``panel_weights``): the
                layers' ones are used instead of the module's input-major ones.
            attend_dtype: the dtype of the new k, v handed to ``write_and_attend`` (the writes
                round them to the cache's dtype); None = the cache's, so attention reads exactly
                what the cache holds. A first prefill chunk, which attends only to its own
                keys, passes float32, as the stacked form does: with a bfloat16 cache it then
                attends to unrounded keys and values.

        Returns:
            hidden [B, T, D] float32 after the last block, and the updated cache.
        """
        cfg = self.cfg
        assert self.layers.per_layer(), "run_layers_in_place needs unstack_layers' per-layer form"
        x = self.embed_tokens(tokens)
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        cos, sin = materialised(cos), materialised(sin)
        weights = self.layers.weights()
        weights.update({name: w for name, w in (panels or {}).items() if name in weights})
        k_out, v_out = [], []
        cdt = attend_dtype or cache.v_blocks[0][0].dtype
        for i in range(cfg.num_layers):
            p = {name: w[i] for name, w in weights.items()}
            q, k, v = project_qkv(cfg, x, p, cos, sin, cdt)
            attn, kb, vb = write_and_attend(q, k, v, cache.k_blocks[i], cache.v_blocks[i])
            x = out_and_mlp(cfg, x, p, attn)
            k_out.append(kb)
            v_out.append(vb)
        return x, BlockedKVCache(k_blocks=tuple(k_out), v_blocks=tuple(v_out))


# ---- the math of one block ------------------------------------------------------------------
Packed = QuantPanels | cpu_matmul.Panels  # weights a native kernel reads in place at a layer index


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


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019, eq. 4), computed in float32: x [..., D] -> [..., D] f32."""
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * weight.astype(jnp.float32)


def llama3_inv_freq(inv_freq: jax.Array, s: RopeScaling) -> jax.Array:
    """Llama 3.1's RoPE frequency scaling of ``inv_freq`` [H/2] (float32), as Hugging Face's
    ``_compute_llama3_parameters``: high frequencies kept, low ones divided by ``s.factor``, the
    band between interpolated."""
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_tables(
    positions: jax.Array, head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables [B, T, H] float32 for RoPE at integer ``positions`` [B, T].

    Frequencies theta^(-2i/H) for i < H/2 (rescaled by ``llama3_inv_freq`` when ``scaling`` is
    given), duplicated over both halves (Hugging Face's rotate-half layout; GGUF's interleaved
    layout is undone at load time).
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def materialised(table: jax.Array) -> jax.Array:
    """``table`` [B, T, H] unchanged, read through an identity gather so that XLA computes it once.

    In the unrolled layer loop XLA:CPU fuses the RoPE tables' cos/sin into every layer's RoPE
    and evaluates them once per (token, head, dim) element: for SmolLM2 (30 layers, 9 query and
    3 KV heads) each table entry 360 times per step (30 layers x 12 heads). XLA does not
    fuse an expensive elementwise producer into a gather that reads it, and
    ``jax.lax.optimization_barrier`` does not help: XLA:CPU expands it before fusion.
    (The scanned loop needs none of this: its tables are loop-invariant operands.)
    """
    B, T, H = table.shape
    rows = jnp.take(table.reshape(B * T, H), jnp.arange(B * T), axis=0)
    return rows.reshape(B, T, H)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, heads, H] by the tables [B, T, H]: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def dense(x: jax.Array, w: jax.Array | cpu_matmul.Panels | QuantPanels, equation: str) -> jax.Array:
    """x [..., in] times a weight, float32 out: ``jnp.einsum(equation, x, w)`` for an
    input-major weight; for a packed one, whose outputs take its ``out_shape`` ([..., *out_shape];
    x's last axis is the weight's K), the native kernel of ``model.cpu_matmul``
    (``Panels``) or the GGUF blocks as stored (``QuantPanels``: its ``kernel``, the native one of
    ``model.quant_matmul`` or XLA's dequantize-then-dot)."""
    if isinstance(w, cpu_matmul.Panels | QuantPanels):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if isinstance(w, cpu_matmul.Panels):
            y = cpu_matmul.matmul(x2, w)
        elif w.kernel == "native":  # the engine checked quant_matmul.available()
            y = quant_matmul.matmul(x2, w)
        else:
            y = quant_panels.xla_matmul(x2, w)
        return y.reshape(*lead, *w.out_shape)
    return jnp.einsum(equation, x, w, preferred_element_type=jnp.float32)


def project_qkv(
    cfg: LlamaConfig, x: jax.Array, p: dict[str, jax.Array], cos: jax.Array, sin: jax.Array, cdt: jnp.dtype
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention inputs of one block: RMSNorm, Q/K/V projections and RoPE.

    Shapes: x [B, T, D] f32 -> q [B, T, K, G, H] f32 (already scaled by H^-0.5), and k, v
    [B, T, K, H] in the cache dtype ``cdt`` (attention uses exactly what the cache will hold).
    """
    B, T, _ = x.shape
    K, G, H = cfg.num_kv_heads, cfg.q_per_kv, cfg.head_dim
    wdt = p["wqkv"].dtype
    h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps).astype(wdt)
    qkv = dense(h, p["wqkv"], "BTD,DKCH->BTKCH")  # [B, T, K, G + 2, H]
    q, k, v = qkv[:, :, :, :G].reshape(B, T, K * G, H), qkv[:, :, :, G], qkv[:, :, :, G + 1]
    q = apply_rope(q, cos, sin).reshape(B, T, K, G, H) * (H**-0.5)
    k = apply_rope(k, cos, sin)
    return q, k.astype(cdt), v.astype(cdt)


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


def out_and_mlp(cfg: LlamaConfig, x: jax.Array, p: dict[str, jax.Array], attn: jax.Array) -> jax.Array:
    """The rest of one block after attention: the O projection and the SwiGLU MLP, each with
    its residual. Shapes: x [B, T, D] f32; attn [B, T, K, G, H] f32. Returns the new x."""
    B, T, _ = x.shape
    wdt = p["wo"].dtype
    # O projection as one [B*T, N*H] x [N*H, D] matmul: both reshapes are free (row-major), and
    # XLA:CPU does not transpose wo per step as it does for the two-axis contraction.
    wo = p["wo"]
    attn = attn.reshape(B, T, -1).astype(wdt)
    packed = isinstance(wo, cpu_matmul.Panels | QuantPanels)
    x = x + dense(attn, wo if packed else wo.reshape(-1, wo.shape[-1]), "BTE,ED->BTD")

    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps).astype(wdt)
    gate_up = dense(h, p["w_gate_up"], "BTD,DCF->BTCF")  # [B, T, 2, F]
    act = (jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]).astype(wdt)
    return x + dense(act, p["w_down"], "BTF,FD->BTD")


def decoder_block(
    cfg: LlamaConfig,
    x: jax.Array,
    p: dict[str, jax.Array],
    cos: jax.Array,
    sin: jax.Array,
    cache_k: jax.Array | None,
    cache_v: jax.Array | None,
    cache_mask: jax.Array | None,
    new_mask: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One pre-norm block: x + Attn(norm(x)), then + MLP(norm(x)), attending to a read-only
    cache window and the block's own new keys.

    Shapes: x [B, T, D] f32; cache_k/v [B, K, S, H]; masks as in ``Llama.run_layers``.
    Returns the new x [B, T, D] f32 and this block's new k, v [B, T, K, H].
    """
    cdt = cache_k.dtype if cache_k is not None else jnp.float32
    q, k, v = project_qkv(cfg, x, p, cos, sin, cdt)
    attn = attention(cfg, q, k, v, cache_k, cache_v, cache_mask, new_mask)
    return out_and_mlp(cfg, x, p, attn), k, v


# ---- weights packed for the native matmuls ---------------------------------------------------
PANEL_IN_DIMS = {"wqkv": 1, "wo": 2, "w_gate_up": 1, "w_down": 1}  # leading axes contracted


def panel_weights(model: Llama, lm_head: bool = True, format: str = "f32") -> dict[str, Any]:
    """The layer and LM-head matmul weights packed for a native kernel (``model.cpu_matmul``).

    Args:
        model: a Llama in the per-layer form (``unstack_layers``) with float32 weights.
        lm_head: pack the LM head too (only ``decode_step`` reads it).
        format: "f32" (float32 panels, ``cpu_matmul.pack``) or "bf16x3" (AMX bf16x3,
            ``cpu_matmul.pack_bf16x3``).

    Returns:
        {"wqkv", "wo", "w_gate_up", "w_down": tuples of L ``Panels``, "lm_head": one ``Panels``
        of the LM head [D, V] (the tied embedding transposed, or ``lm_head``), if asked}: a second copy
        of those weights, for ``prefill(panels=...)`` (which uses the layers') and
        ``decode_step(panels=...)``.

    Raises:
        ValueError: a weight's output width (for bf16x3, or its input width) is not a multiple
            of 32, or it is not float32.
    """
    assert model.layers.per_layer(), "panel_weights needs unstack_layers' per-layer form"
    pack = {"f32": cpu_matmul.pack, "bf16x3": cpu_matmul.pack_bf16x3}[format]
    weights = model.layers.weights()
    out: dict[str, Any] = {
        name: tuple(pack(w, in_dims) for w in weights[name])
        for name, in_dims in PANEL_IN_DIMS.items()
        if not isinstance(weights[name][0], QuantPanels)  # stored blocks have a kernel of their own
    }
    head = (model.embed if model.cfg.tie_word_embeddings else model.lm_head).get_value()
    if lm_head and not isinstance(head, QuantPanels):
        out["lm_head"] = pack(head.T if model.cfg.tie_word_embeddings else head, 1)
    return out


def stacked_panel_weights(model: Llama, lm_head: bool = True) -> dict[str, Any]:
    """The stacked layer weights (and the LM head) packed for the native float32 kernel, for
    ``ragged_step(panels=...)``: {"wqkv", "wo", "w_gate_up", "w_down": ``Panels`` of the L
    matrices [L, N/32, K, 32] (``cpu_matmul.pack_stacked``), "lm_head": ``Panels`` of the LM
    head [D, V], if asked}. A second copy of those weights. Left out (multiplied as before):
    weights held as stored blocks (they have a kernel of their own) and ones the kernel does not
    take (``cpu_matmul.supports``: not float32, or outputs not whole 32-column panels).
    """
    assert not model.layers.per_layer(), "stacked_panel_weights packs the stacked form"
    weights = model.layers.weights()

    def packable(w: Any, in_dims: int, lead: int = 0) -> bool:  # lead: a stack's leading L axis
        if isinstance(w, QuantPanels):
            return False
        shape = w.shape[lead:]
        return cpu_matmul.supports(math.prod(shape[in_dims:]), w.dtype, math.prod(shape[:in_dims]))

    out: dict[str, Any] = {
        name: cpu_matmul.pack_stacked(weights[name], in_dims)
        for name, in_dims in PANEL_IN_DIMS.items()
        if packable(weights[name], in_dims, lead=1)
    }
    head = (model.embed if model.cfg.tie_word_embeddings else model.lm_head).get_value()
    head = head.T if model.cfg.tie_word_embeddings and not isinstance(head, QuantPanels) else head
    if lm_head and packable(head, 1):
        out["lm_head"] = cpu_matmul.pack(head, 1)
    return out


def has_stored_blocks(state: nnx.State) -> bool:
    """Whether any parameter of ``state`` is GGUF blocks kept as stored (``QuantPanels``)."""
    return any(isinstance(v, QuantPanels) for v in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, QuantPanels)))


def choose_quant_kernel(state: nnx.State, kernel: str) -> nnx.State:
    """``state`` with every ``QuantPanels`` parameter multiplied by ``kernel``: "native" (the
    CPU kernel of ``model.quant_matmul``; one CPU device, ``quant_matmul.available()`` first) or
    "xla" (dequantize then dot, any backend). Other parameters are returned as they are."""
    return jax.tree.map(
        lambda v: dataclasses.replace(v, kernel=kernel) if isinstance(v, QuantPanels) else v,
        state,
        is_leaf=lambda x: isinstance(x, QuantPanels),
    )


# ---- the entry points ------------------------------------------------------------------------
def prefill(
    model: Llama,
    cache: KVCache | BlockedKVCache,
    tokens: jax.Array,
    start_pos: jax.Array,
    true_len: jax.Array,
    slot: jax.Array,
    *,
    kv_len: int,
    native_attention: bool = False,
    panels: dict[str, Any] | None = None,
) -> tuple[jax.Array, KVCache | BlockedKVCache]:
    """Run one prompt chunk through the model and write its KV into one slot of the cache.

    Args:
        model: the Llama module (merged from graphdef and params inside jit).
        cache: the KV cache (donated by the caller's jit): ``KVCache`` [L, S, K, T_max, H] with
            stacked weights, ``BlockedKVCache`` with per-layer weights (``unstack_layers``).
        tokens: [T] int32, the chunk padded to a length bucket T (padding ids are ignored).
        start_pos: int32 scalar, absolute position of tokens[0] (0 for a whole prompt; > 0 for
            later chunks of a chunked prefill, which attend to the slot's cached prefix).
        true_len: int32 scalar in [1, T], number of real tokens in the chunk.
        slot: int32 scalar, the cache slot to write.
        kv_len: static; how many cached positions to attend to (>= start_pos, <= T_max); 0 when
            start_pos is 0, which skips reading the cache. (The per-layer form attends to the
            slot's whole cache, masked, when kv_len > 0.)
        native_attention: with per-layer weights, a first chunk (kv_len 0) attends causally
            through the CPU kernel of ``model.cpu_attention`` (``causal``; registered first by
            ``cpu_attention.available()``, one device) instead of XLA's dots by query blocks,
            and every chunk writes its keys and values through ``cpu_attention.write_chunk``
            instead of XLA's scatters.
        panels: with per-layer weights, the matmul weights packed for the native kernel
            (``panel_weights``; registered first by ``cpu_matmul.available()``): the layers'
            projections then run through ``model.cpu_matmul`` (the LM head of the one last
            position stays XLA's matrix-vector product).

    Returns:
        logits [V] float32 at the last real position (start_pos + true_len - 1), and the cache
        with positions [start_pos, start_pos + T) of ``slot`` overwritten. Writes past T_max are
        dropped (never clamped onto the last position); the caller guarantees the real tokens fit.
    """
    T = tokens.shape[0]
    positions = (start_pos + jnp.arange(T, dtype=jnp.int32))[None, :]  # [1, T]
    new_mask = (jnp.arange(T)[None, :] <= jnp.arange(T)[:, None])[None]  # [1, T, U] causal
    if model.layers.per_layer():
        assert isinstance(cache, BlockedKVCache), "per-layer weights run on a BlockedKVCache"
        pos = positions[0]
        blocks = block_starts(cache.max_len)
        if kv_len == 0:  # a first chunk (start_pos 0) writes only the blocks its bucket reaches
            blocks = [(b0, n) for b0, n in blocks if b0 < T]

        def write(kb: Blocks, vb: Blocks, k: jax.Array, v: jax.Array) -> tuple[Blocks, Blocks]:
            if native_attention:  # in place, in the cache's dtype (XLA:CPU has no bfloat16 scatter)
                return cpu_attention.write_chunk(slot, start_pos, k[0], v[0], kb, vb)
            out_k, out_v = list(kb), list(vb)
            for j, (b0, n) in enumerate(blocks):
                idx = index_in_block(pos, b0, n)
                # kb[j][slot, :, :, idx] and vb[j][slot, :, idx, :] have shape [T, K, H].
                out_k[j] = kb[j].at[slot, :, :, idx].set(k[0].astype(kb[j].dtype), mode="drop")
                out_v[j] = vb[j].at[slot, :, idx, :].set(v[0].astype(vb[j].dtype), mode="drop")
            return tuple(out_k), tuple(out_v)

        if kv_len > 0:
            mask = (jnp.arange(cache.max_len)[None, :] <= pos[:, None])[None]  # [1, T, T_max], new tokens included

            def attend(q: jax.Array, k: jax.Array, v: jax.Array, kb: Blocks, vb: Blocks) -> jax.Array:
                rows_k = [jax.lax.dynamic_index_in_dim(b, slot, axis=0) for b in kb]  # [1, K, H, n]
                rows_v = [jax.lax.dynamic_index_in_dim(b, slot, axis=0) for b in vb]
                return attention_over_blocks(q, tuple(rows_k), tuple(rows_v), mask)

        elif native_attention:

            def attend(q: jax.Array, k: jax.Array, v: jax.Array, kb: Blocks, vb: Blocks) -> jax.Array:
                return cpu_attention.causal(q, k, v)

        else:

            def attend(q: jax.Array, k: jax.Array, v: jax.Array, kb: Blocks, vb: Blocks) -> jax.Array:
                return attention(model.cfg, q, k, v, None, None, None, new_mask)

        step = write_then_attend(write, attend)
        first = jnp.float32 if kv_len == 0 else None  # a first chunk attends to unrounded k, v
        h, cache = model.run_layers_in_place(tokens[None, :], positions, cache, step, panels, first)
        last = jax.lax.dynamic_index_in_dim(h[0], true_len - 1, axis=0, keepdims=False)
        return model.logits(last), cache

    assert isinstance(cache, KVCache), "stacked weights run on a KVCache"
    if kv_len > 0:
        ck = jax.lax.dynamic_index_in_dim(cache.k, slot, axis=1, keepdims=True)
        cv = jax.lax.dynamic_index_in_dim(cache.v, slot, axis=1, keepdims=True)
        cache_mask = jnp.broadcast_to(jnp.arange(kv_len)[None, None, :] < start_pos, (1, T, kv_len))
    else:
        ck = cv = cache_mask = None
    h, new_k, new_v = model.run_layers(tokens[None, :], positions, ck, cv, cache_mask, new_mask)
    last = jax.lax.dynamic_index_in_dim(h[0], true_len - 1, axis=0, keepdims=False)
    logits = model.logits(last)

    pos = positions[0]
    # cache.k[:, slot, :, pos, :] has shape [T, L, K, H] (advanced indices go first).
    k_vals = new_k[:, 0].transpose(1, 0, 2, 3)
    v_vals = new_v[:, 0].transpose(1, 0, 2, 3)
    cache = KVCache(
        k=cache.k.at[:, slot, :, pos, :].set(k_vals.astype(cache.k.dtype), mode="drop"),
        v=cache.v.at[:, slot, :, pos, :].set(v_vals.astype(cache.v.dtype), mode="drop"),
    )
    return logits, cache


def decode_step(
    model: Llama,
    cache: KVCache | BlockedKVCache,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    kv_len: int,
    native_attention: bool = False,
    panels: dict[str, Any] | None = None,
) -> tuple[jax.Array, KVCache | BlockedKVCache]:
    """One new token for every slot.

    Args:
        model: the Llama module.
        cache: the KV cache (donated by the caller's jit): ``KVCache`` [L, S, K, T_max, H] with
            stacked weights, ``BlockedKVCache`` with per-layer weights.
        tokens: [S] int32, the last token of each slot.
        positions: [S] int32, each token's absolute position (= tokens already cached in the
            slot). An idle slot passes T_max: its output is ignored and its KV write dropped.
        kv_len: static window of cached positions attended to; must exceed every active
            position (the engine picks a power-of-two bucket, so reads scale with the
            longest live sequence, not with T_max).
        native_attention: with a ``BlockedKVCache``, write the new keys and values and attend
            through the CPU kernel of ``model.cpu_attention`` (registered first by
            ``cpu_attention.available()``; one device, float32 or bfloat16 cache) instead of
            XLA's scatters and dots.
        panels: with per-layer weights, the matmul weights packed for the native kernel
            (``panel_weights``; registered first by ``cpu_matmul.available()``): the layers'
            projections, and the LM head when it is packed, then run through ``model.cpu_matmul``.

    Returns:
        logits [S, V] float32 and the cache with each active slot's new K/V at its position.
    """
    S = tokens.shape[0]
    pos2d = positions[:, None]  # [S, 1]
    if model.layers.per_layer():
        assert isinstance(cache, BlockedKVCache), "per-layer weights run on a BlockedKVCache"
        slots = jnp.arange(S)[:, None]
        heads = jnp.arange(cache.v_blocks[0][0].shape[1])[None, :]
        # The window: the blocks that hold positions below kv_len (every active position is).
        blocks = [(b0, n) for b0, n in block_starts(cache.max_len) if b0 < kv_len]
        width = sum(n for _, n in blocks)

        def write(kb: Blocks, vb: Blocks, k: jax.Array, v: jax.Array) -> tuple[Blocks, Blocks]:
            # One index per (slot, KV head): XLA turns a scatter with a single index (one slot)
            # into a dynamic-update-slice, then fuses that into the read that follows, which
            # keeps the old block alive and costs a copy of it per layer.
            out_k, out_v = list(kb), list(vb)
            for j, (b0, n) in enumerate(blocks):
                idx = index_in_block(positions, b0, n)[:, None]  # idle slots (T_max) are dropped
                # kb[j][slots, heads, :, idx] and vb[j][slots, heads, idx, :] have shape [S, K, H].
                out_k[j] = kb[j].at[slots, heads, :, idx].set(k[:, 0].astype(kb[j].dtype), mode="drop")
                out_v[j] = vb[j].at[slots, heads, idx, :].set(v[:, 0].astype(vb[j].dtype), mode="drop")
            return tuple(out_k), tuple(out_v)

        mask = (jnp.arange(width)[None, :] <= positions[:, None])[:, None, :]  # [S, 1, width]

        def attend(q: jax.Array, k: jax.Array, v: jax.Array, kb: Blocks, vb: Blocks) -> jax.Array:
            return attention_over_blocks(q, kb[: len(blocks)], vb[: len(blocks)], mask)

        def native(
            q: jax.Array, k: jax.Array, v: jax.Array, kb: Blocks, vb: Blocks
        ) -> tuple[jax.Array, Blocks, Blocks]:
            n = len(blocks)  # q [S, 1, K, G, H]; k, v [S, 1, K, H]
            out, kw, vw = cpu_attention.write_and_attend(q[:, 0], k[:, 0], v[:, 0], positions, kb[:n], vb[:n])
            return out[:, None], kw + kb[n:], vw + vb[n:]

        step = native if native_attention else write_then_attend(write, attend)
        h, cache = model.run_layers_in_place(tokens[:, None], pos2d, cache, step, panels)
        return model.logits(h[:, 0], panels.get("lm_head") if panels else None), cache

    assert isinstance(cache, KVCache), "stacked weights run on a KVCache"
    ck, cv = cache.k, cache.v  # the scan slices each layer's window without copying the cache
    cache_mask = (jnp.arange(kv_len)[None, :] < positions[:, None])[:, None, :]  # [S, 1, kv_len]
    new_mask = jnp.ones((S, 1, 1), bool)
    h, new_k, new_v = model.run_layers(tokens[:, None], pos2d, ck, cv, cache_mask, new_mask)
    logits = model.logits(h[:, 0])

    slots = jnp.arange(S)
    # cache.k[:, slots, :, positions, :] has shape [S, L, K, H].
    k_vals = new_k[:, :, 0].transpose(1, 0, 2, 3)
    v_vals = new_v[:, :, 0].transpose(1, 0, 2, 3)
    cache = KVCache(
        k=cache.k.at[:, slots, :, positions, :].set(k_vals.astype(cache.k.dtype), mode="drop"),
        v=cache.v.at[:, slots, :, positions, :].set(v_vals.astype(cache.v.dtype), mode="drop"),
    )
    return logits, cache


SEQ_BLOCK = 64  # tokens per block of ragged_step's prefill region (one gathered window each)


def ragged_step(
    model: Llama,
    cache: PagedKVCache,
    tokens: jax.Array,
    positions: jax.Array,
    seq_of_token: jax.Array,
    page_tables: jax.Array,
    last_index: jax.Array,
    *,
    window_pages: int,
    prefill_from: int | None = None,
    seq_block: int = SEQ_BLOCK,
    native_decode: bool = False,
    panels: dict[str, Any] | None = None,
) -> tuple[jax.Array, PagedKVCache]:
    """One step of the paged engine over a flat batch of N tokens mixing decode tokens and
    prefill chunks of several sequences: every real token's key and value is written into its
    pages, then it attends causally by position to its sequence's cached keys and this step's
    (``model.paged_attention``; the metadata as described there).

    Args:
        model: the Llama module with stacked weights (not ``unstack_layers``' form).
        cache: the paged cache (donated by the caller's jit).
        tokens: [N] int32 token ids in [0, V); padding tokens carry any valid id (e.g. 0).
        positions: [N] int32 absolute positions; negative = padding. Real positions must be
            below ``window_pages * page_size`` and the slots of real tokens distinct.
        seq_of_token: [N] int32, each token's row of ``page_tables``; outside [0, B) = padding.
        page_tables: [B, max_pages] int32, each sequence's pages in order (unused entries any
            value, e.g. 0). Pages of positions a token attends to must have been written by an
            earlier step or hold a token of this one.
        last_index: [B] int32 in [0, N): row b's logits are those of token ``last_index[b]``
            (rows that sample nothing pass any valid index, e.g. 0).
        window_pages: static, in [1, max_pages]: the leading pages of each table read, a bucket
            covering every real token's position.
        prefill_from: static, None or in [0, N]. None: every token attends on its own, gathering
            its sequence's window (right for any layout). An int: tokens [0, prefill_from) do
            so (the decode tokens), and tokens [prefill_from, N) go in blocks of ``seq_block``
            consecutive tokens, each block gathering one window
            (``ragged_paged_attention_blocks``). The caller promises that every block's real
            tokens belong to one sequence: each prefill chunk starts at a block boundary (an
            offset from ``prefill_from`` that is a multiple of ``seq_block``), padding fills the
            rest of its last block. A real token of another sequence than its block's first is
            attended as padding (zero attention output): a broken promise gives that token
            wrong hidden states and keys, never another sequence's keys or NaN.
        seq_block: static, >= 1: tokens per block of the prefill region.
        native_decode: static: tokens [0, prefill_from) (every token, with ``prefill_from``
            None) attend through the CPU kernel of ``model.cpu_paged_attention`` (registered
            first by its ``available()``; one CPU device) instead of gathering windows for
            XLA's dots; it reads each token's pages in place, up to its own position.
        panels: the matmul weights packed for the native float32 kernel
            (``stacked_panel_weights``; registered first by ``cpu_matmul.available()``): the
            layers' projections, and the LM head when it is packed, run through
            ``model.cpu_matmul`` instead of XLA's dots.

    Returns:
        logits [B, V] float32 (row b: token ``last_index[b]``'s), and the cache with every real
        token's keys and values written in every layer, rounded to the cache dtype before
        attention reads them (so a chunk's tokens see each other's rounded keys, as later steps
        will).

    Raises:
        ValueError: ``window_pages`` outside [1, max_pages], ``prefill_from`` outside [0, N],
            or ``seq_block`` below 1.
    """
    assert not model.layers.per_layer(), "ragged_step runs the stacked weights (lax.scan)"
    N = tokens.shape[0]
    split = N if prefill_from is None else prefill_from
    if not 0 <= split <= N:
        raise ValueError(f"prefill_from must be in [0, {N}], got {prefill_from}")
    if seq_block < 1:
        raise ValueError(f"seq_block must be >= 1, got {seq_block}")
    if not 1 <= window_pages <= page_tables.shape[1]:  # checked here too: attend runs only when traced by the scan
        raise ValueError(f"window_pages must be in [1, {page_tables.shape[1]}], got {window_pages}")
    slots = slot_mapping(page_tables, seq_of_token, positions, cache.page_size)

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, layer: jax.Array) -> jax.Array:
        parts = []
        if split > 0 and native_decode:
            parts.append(
                cpu_paged_attention.paged_attention(
                    q[:split], k, v, page_tables, seq_of_token[:split], positions[:split], layer
                )
            )
        elif split > 0:
            parts.append(
                ragged_paged_attention(
                    q[:split], k, v, page_tables, seq_of_token[:split], positions[:split],
                    window_pages=window_pages, layer=layer,
                )
            )  # fmt: skip
        if split < N:
            parts.append(
                ragged_paged_attention_blocks(
                    q[split:], k, v, page_tables, seq_of_token[split:], positions[split:],
                    window_pages=window_pages, block=seq_block, layer=layer,
                )
            )  # fmt: skip
        return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

    h, cache = model.run_layers_paged(tokens, positions, cache, slots, attend, panels)
    return model.logits(h[last_index], panels.get("lm_head") if panels else None), cache
