"""A Llama decoder in Flax NNX, with the pure entry points the engines jit: prefill and decode
(the per-slot engine) and the ragged step (the paged engine).

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

Kernels: every matmul, embedding lookup and attention call goes through ``model.kernels``, the
one seam where an engine's choice of XLA's or the native CPU kernels is made; this file has no
platform branches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.attention import Blocks, attention
from model.config import LlamaConfig, RopeScaling
from model.kernels import XLA, AttentionKernels, Packed, embedding_rows, matmul, split_stacked, with_stacked
from model.kv_cache import BlockedKVCache, KVCache, block_starts
from model.paged_kv import PagedKVCache, slot_mapping, write_kv

# (q, new k, new v, key blocks, value blocks) -> (attention, written key blocks, value blocks)
WriteAndAttend = Callable[[jax.Array, jax.Array, jax.Array, Blocks, Blocks], tuple[jax.Array, Blocks, Blocks]]
# (q [N, K, G, H], stacked key pages, value pages [L, P, K, page_size, H], layer index) -> attention [N, K, G, H]
PagedAttend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


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
    blocks as stored (``model.quant_panels.QuantPanels``, same logical axes), which ``matmul``
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
        return embedding_rows(self.embed.get_value(), tokens)

    def logits(self, h: jax.Array, head: Packed | None = None) -> jax.Array:
        """Final RMSNorm and LM head: h [..., D] -> logits [..., V] float32; ``head``: the LM head
        packed for a native kernel (``model.packed_weights``), used instead of the module's."""
        h = rms_norm(h, self.final_norm[...], self.cfg.rms_norm_eps)
        tied = self.cfg.tie_word_embeddings
        w = head if head is not None else (self.embed if tied else self.lm_head).get_value()
        # A tied table is [V, D] as floats; packed (stored blocks, panels) it is [D, V] like an
        # untied head, and ``matmul`` ignores the equation.
        return matmul(h.astype(w.dtype), w, "...D,VD->...V" if tied else "...D,DV->...V")

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
                (``model.packed_weights.stacked_panel_weights``), used instead of the module's by
                the same name.

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
                with the new entries written), built from an ``AttentionKernels``' methods.
            panels: matmul weights packed for the native kernel (``model.packed_weights``): the
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
    qkv = matmul(h, p["wqkv"], "BTD,DKCH->BTKCH")  # [B, T, K, G + 2, H]
    q, k, v = qkv[:, :, :, :G].reshape(B, T, K * G, H), qkv[:, :, :, G], qkv[:, :, :, G + 1]
    q = apply_rope(q, cos, sin).reshape(B, T, K, G, H) * (H**-0.5)
    k = apply_rope(k, cos, sin)
    return q, k.astype(cdt), v.astype(cdt)


def out_and_mlp(cfg: LlamaConfig, x: jax.Array, p: dict[str, jax.Array], attn: jax.Array) -> jax.Array:
    """The rest of one block after attention: the O projection and the SwiGLU MLP, each with
    its residual. Shapes: x [B, T, D] f32; attn [B, T, K, G, H] f32. Returns the new x."""
    B, T, _ = x.shape
    wdt = p["wo"].dtype
    # O projection as one [B*T, N*H] x [N*H, D] matmul: both reshapes are free (row-major), and
    # XLA:CPU does not transpose wo per step as it does for the two-axis contraction.
    wo = p["wo"]
    attn = attn.reshape(B, T, -1).astype(wdt)
    x = x + matmul(attn, wo if isinstance(wo, Packed) else wo.reshape(-1, wo.shape[-1]), "BTE,ED->BTD")

    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps).astype(wdt)
    gate_up = matmul(h, p["w_gate_up"], "BTD,DCF->BTCF")  # [B, T, 2, F]
    act = (jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]).astype(wdt)
    return x + matmul(act, p["w_down"], "BTF,FD->BTD")


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
    kernels: AttentionKernels = XLA,
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
        kernels: with per-layer weights, how chunks write their keys and attend
            (``model.kernels``: ``write_chunk``, then ``first_chunk`` for a first chunk or
            ``attend_chunk`` over the slot's blocks); the stacked form runs XLA's.
        panels: with per-layer weights, the matmul weights packed for the native kernel
            (``model.packed_weights.panel_weights``; registered first by
            ``cpu_matmul.available()``): the layers' projections then run through
            ``model.cpu_matmul`` (the LM head of the one last position stays XLA's
            matrix-vector product).

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
        spans = block_starts(cache.max_len)
        if kv_len == 0:  # a first chunk (start_pos 0) writes only the blocks its bucket reaches
            spans = [(b0, n) for b0, n in spans if b0 < T]
        # A later chunk attends over the slot's whole cache, new tokens included: [1, T, T_max].
        mask = (jnp.arange(cache.max_len)[None, :] <= positions[0][:, None])[None] if kv_len > 0 else None

        def step(q: jax.Array, k: jax.Array, v: jax.Array, kb: Blocks, vb: Blocks) -> tuple[jax.Array, Blocks, Blocks]:
            kb, vb = kernels.write_chunk(kb, vb, k[0], v[0], slot, start_pos, spans)
            if mask is None:
                return kernels.first_chunk(q, k, v, new_mask), kb, vb
            return kernels.attend_chunk(q, kb, vb, slot, mask), kb, vb

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
    kernels: AttentionKernels = XLA,
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
        kernels: with a ``BlockedKVCache``, how each layer writes the new keys and values and
            attends (``model.kernels``: ``decode_blocks``); the stacked form runs XLA's.
        panels: with per-layer weights, the matmul weights packed for the native kernel
            (``model.packed_weights.panel_weights``; registered first by
            ``cpu_matmul.available()``): the layers' projections, and the LM head when it is
            packed, then run through ``model.cpu_matmul``.

    Returns:
        logits [S, V] float32 and the cache with each active slot's new K/V at its position.
    """
    S = tokens.shape[0]
    pos2d = positions[:, None]  # [S, 1]
    if model.layers.per_layer():
        assert isinstance(cache, BlockedKVCache), "per-layer weights run on a BlockedKVCache"
        # The window: the blocks that hold positions below kv_len (every active position is).
        spans = [(b0, n) for b0, n in block_starts(cache.max_len) if b0 < kv_len]

        def step(q: jax.Array, k: jax.Array, v: jax.Array, kb: Blocks, vb: Blocks) -> tuple[jax.Array, Blocks, Blocks]:
            return kernels.decode_blocks(q, k, v, positions, kb, vb, spans)

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
    kernels: AttentionKernels = XLA,
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
        kernels: static: how tokens [0, prefill_from) (every token, with ``prefill_from``
            None) attend (``model.kernels``: ``paged_decode``; the native CPU kernel reads each
            token's pages in place up to its own position), and how the prefill region does
            (``paged_prefill``).
        panels: the matmul weights packed for the native float32 kernel
            (``model.packed_weights.stacked_panel_weights``; registered first by
            ``cpu_matmul.available()``): the
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
        if split > 0:
            parts.append(
                kernels.paged_decode(
                    q[:split], k, v, page_tables, seq_of_token[:split], positions[:split], layer, window_pages
                )
            )
        if split < N:
            parts.append(
                kernels.paged_prefill(
                    q[split:], k, v, page_tables, seq_of_token[split:], positions[split:], layer, window_pages,
                    seq_block,
                )
            )  # fmt: skip
        return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

    h, cache = model.run_layers_paged(tokens, positions, cache, slots, attend, panels)
    return model.logits(h[last_index], panels.get("lm_head") if panels else None), cache
