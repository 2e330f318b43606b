"""A Llama decoder in Flax NNX, and the one step the engine jits over it: ``ragged_step``, a flat
batch of decode tokens and prefill chunks of several sequences over a paged KV cache.

Architecture (Touvron et al. 2023, "LLaMA", §2.2): pre-norm RMSNorm (Zhang & Sennrich 2019),
rotary position embeddings (Su et al. 2021, "RoFormer", §3.4.2, in Hugging Face's rotate-half
form), grouped-query attention (Ainslie et al. 2023), SwiGLU MLP (Shazeer 2020), optionally
tied LM head. The families of ``model.families`` that share this decoder switch on what they
add through the config: Q/K/V biases (Qwen2), per-head q/k RMSNorm (Qwen3, Gemma 3), and Gemma
3's sandwich norms, GELU-tanh MLP, scaled embeddings and local (sliding-window) layers with a
RoPE base of their own.

Einsum letters used throughout:
    B batch rows (1: the flat batch)   T tokens of the flat batch   D embed (hidden)   F MLP width
    N query heads   K KV heads   G query heads per KV head (N = K * G)   H head dim   V vocab
    L layers   C the fused projections' axis (Q heads + K + V, or gate + up)   E = N * H

One forward pass (``Llama.forward``): embed, the L blocks, each writing its new keys and values
into the pages before attending through the step's ``AttentionBackend``, then the final norm and
the LM head of the tokens that sample. Layers are stored stacked (every parameter has a leading
L axis) and run with ``jax.lax.scan``, so a 30-layer model compiles one block, not thirty; in
the per-layer form (``unstack_layers``) the same block runs as an unrolled loop. Every parameter
carries ``logical_axes`` metadata; ``sharding/rules.py`` maps those names to mesh axes. The model
never imports sharding.

Kernels: every matmul and embedding lookup goes through ``model.matmul`` (the weight's form picks
the kernel) and attention through the backend the engine passes (``model.attention``); which
ones run is chosen once, in ``model.kernels``, so this file has no platform branches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.attention.base import AttentionBackend, StepMeta
from model.attention.pages import PagedKVCache, value_dtype, write_kv
from model.config import LlamaConfig, RopeScaling
from model.matmul import Packed, embedding_rows, matmul, split_stacked, with_stacked


def _param(value: jax.Array, axes: tuple[str, ...]) -> nnx.Param:
    assert value.ndim == len(axes), (value.shape, axes)
    return nnx.Param(value, logical_axes=axes)


class DecoderLayers(nnx.Module):
    """The L decoder blocks, with parameters stacked on a leading layer axis.

    Parameters (shape, logical axes):
        attn_norm [L, D] (layers, embed); wqkv [L, D, K, G + 2, H] (layers, embed, kv_heads,
        qkv, head_dim); wo [L, N, H, D] (layers, q_heads, head_dim, embed); mlp_norm [L, D];
        w_gate_up [L, D, 2, F] (layers, embed, gate_up, mlp); w_down [L, F, D] (layers, mlp,
        embed). With ``cfg.attention_bias``: bqkv [L, K, G + 2, H] (layers, kv_heads, qkv,
        head_dim), laid out as wqkv's outputs. With ``cfg.qk_norm``: q_norm and k_norm [L, H]
        (layers, head_dim). With ``cfg.sandwich_norms``: post_attn_norm and post_mlp_norm
        [L, D] (layers, embed), applied to the attention's and the MLP's outputs.
    Weights are stored input-major (x @ W), the faster layout for XLA on CPU. A matmul weight
    (wqkv, wo, w_gate_up, w_down; also ``Llama.embed`` and ``lm_head``) may instead hold a GGUF's
    blocks as stored (``model.weights.quant_panels.QuantPanels``, same logical axes), which ``matmul``
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
        if cfg.attention_bias:
            self.bqkv = _param(jnp.zeros((L, K, N // K + 2, H), dtype), ("layers", "kv_heads", "qkv", "head_dim"))
        if cfg.qk_norm:
            self.q_norm = _param(jnp.ones((L, H), dtype), ("layers", "head_dim"))
            self.k_norm = _param(jnp.ones((L, H), dtype), ("layers", "head_dim"))
        if cfg.sandwich_norms:
            self.post_attn_norm = _param(jnp.ones((L, D), dtype), ("layers", "embed"))
            self.post_mlp_norm = _param(jnp.ones((L, D), dtype), ("layers", "embed"))

    NAMES = (
        "attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down", "bqkv", "q_norm", "k_norm", "post_attn_norm",
        "post_mlp_norm",
    )  # fmt: skip

    def weights(self) -> dict[str, Any]:
        """The raw parameter values keyed by name (those of ``NAMES`` this family has): stacked
        arrays [L, ...], or tuples of L per-layer arrays when the state is in the per-layer form
        of ``unstack_layers``."""
        return {name: getattr(self, name).get_value() for name in self.NAMES if hasattr(self, name)}

    def per_layer(self) -> bool:
        """True when the parameters are in the per-layer form (``unstack_layers``)."""
        return isinstance(self.wqkv.get_value(), tuple)


def fuse_projections(layers: dict[str, Any], num_kv_heads: int) -> dict[str, Any]:
    """The loaders' separate projections as ``DecoderLayers``' fused parameters (numpy, host).

    Args:
        layers: stacked layer weights with separate projections: "wq" [L, D, N, H], "wk" and
            "wv" [L, D, K, H], "w_gate" and "w_up" [L, D, F], and the rest ("attn_norm", "wo",
            "mlp_norm", "w_down") as they are; biases "bq" [L, N, H], "bk" and "bv" [L, K, H],
            where the family has them, are fused as Q/K/V are. A group absent (Q/K/V, or
            gate/up: a loader that kept its blocks as stored fused them itself) is not fused.
        num_kv_heads: K; query head n belongs to KV head n // (N / K), as in Hugging Face's
            ``repeat_kv``.

    Returns:
        the same dict with "wqkv" [L, D, K, N/K + 2, H] (and "bqkv" [L, K, N/K + 2, H]) and
        "w_gate_up" [L, D, 2, F] in place of the separate arrays (dtype kept).
    """
    out = {k: v for k, v in layers.items() if k not in ("wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up")}

    def grouped(q: Any, k: Any, v: Any) -> np.ndarray:  # [..., N, H], [..., K, H] x 2 -> [..., K, G + 2, H]
        q = np.asarray(q)
        *lead, N, H = q.shape
        K = num_kv_heads
        q = q.reshape(*lead, K, N // K, H)
        return np.concatenate([q, np.asarray(k)[..., None, :], np.asarray(v)[..., None, :]], axis=-2)

    if "wq" in layers:
        out["wqkv"] = grouped(layers["wq"], layers["wk"], layers["wv"])
    if "bq" in layers:
        out["bqkv"] = grouped(layers["bq"], layers["bk"], layers["bv"])
    if "w_gate" in layers:
        out["w_gate_up"] = np.stack([np.asarray(layers["w_gate"]), np.asarray(layers["w_up"])], axis=2)
    return out


def unstack_layers(state: nnx.State) -> nnx.State:
    """The per-layer form of a Llama state: every stacked layer parameter [L, ...] becomes a
    tuple of L arrays [...] (the same Param with the same metadata; numpy inputs give views,
    device arrays give slices, abstract ones give per-layer ShapeDtypeStructs). Parameters
    without a leading "layers" axis, and ones already split, are returned as they are.

    Why: a backend whose scanned loop reads a stacked weight's dynamic slice more slowly than a
    weight of its own (XLA:GPU; ``model.kernels``) runs ``Llama.forward`` as an unrolled loop
    over this form instead; the price is compile time (L blocks per program).
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
    [D] (embed); ``lm_head`` [D, V] (embed, vocab) when embeddings are untied, or when a tied
    model's head is packed for a native kernel (``model.weights.packed_weights``).
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

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """The embedding rows of ``tokens`` [...] int32: [..., D] float32, times sqrt(D) with
        ``cfg.embed_scale``. A table kept as stored GGUF blocks (``QuantPanels`` of the
        transposed table [D, V]) is dequantized row by row, to exactly the float values."""
        x = embedding_rows(self.embed.get_value(), tokens)
        # Gemma's sqrt(D), rounded to float32 first as Hugging Face rounds it to the table's dtype.
        return x * np.float32(math.sqrt(self.cfg.hidden_size)) if self.cfg.embed_scale else x

    def logits(self, h: jax.Array) -> jax.Array:
        """Final RMSNorm and LM head: h [..., D] -> logits [..., V] float32. The head is
        ``lm_head`` where the model has one, else the tied embedding table."""
        h = rms_norm(h, self.final_norm[...], self.cfg.rms_norm_eps)
        if hasattr(self, "lm_head"):
            w = self.lm_head.get_value()
            return matmul(h.astype(w.dtype), w, "...D,DV->...V")
        # A tied table is [V, D] as floats; held as blocks it is [D, V], and ``matmul`` ignores
        # the equation.
        w = self.embed.get_value()
        return matmul(h.astype(w.dtype), w, "...D,VD->...V")

    def forward(
        self, tokens: jax.Array, cache: PagedKVCache, meta: StepMeta, attention: AttentionBackend
    ) -> tuple[jax.Array, PagedKVCache]:
        """All decoder blocks over a flat batch of N tokens and the paged cache. Block l writes
        its N new keys and values into layer l of the pages (a scatter in place,
        ``pages.write_kv``) *before* attending, so a token sees its own key and every key
        written for its sequence in this step, and each read of the pages depends on the write
        before it (so XLA updates the donated pages in place instead of copying them).

        Args:
            tokens: [N] int32 token ids in [0, V) (padding tokens too: any valid id).
            cache: the paged cache [L, P, K, page_size, H] (donated by the caller's jit).
            meta: the step's metadata (``StepMeta``: rows, positions, slots, page tables).
            attention: the backend every layer attends through.

        Returns:
            hidden [N, D] float32 after the last block, and the cache with every real token's
            keys and values written in every layer (rounded to the cache dtype; attention read
            exactly those).
        """
        cfg = self.cfg
        x = self.embed_tokens(tokens)[None]  # [1, N, D]: B = 1, T = N
        rope = layer_rope(cfg, meta.positions[None])

        def block(x: jax.Array, k: jax.Array, v: jax.Array, p: dict[str, Any], layer: jax.Array | int):
            cos, sin, window = rope(layer)
            # In what the pages keep exactly (an 8-bit cache quantizes in ``write_kv``: float32).
            q, k_new, v_new = project_qkv(cfg, x, p, cos, sin, value_dtype(k.dtype))
            k, v = write_kv(k, v, meta.slots, k_new[0], v_new[0], layer)
            attn = attention.attend(q[0], k, v, layer, meta, window)
            return out_and_mlp(cfg, x, p, attn[None]), k, v

        weights = self.layers.weights()
        k, v = cache.k, cache.v
        if self.layers.per_layer():  # unrolled: layer i's own weights, a static index into the pages
            for i in range(cfg.num_layers):
                x, k, v = block(x, k, v, {name: w[i] for name, w in weights.items()}, i)
            return x[0], PagedKVCache(k=k, v=v)

        sliced, stacked = split_stacked(weights)

        def body(carry: tuple[jax.Array, jax.Array, jax.Array], xs: tuple[dict[str, Any], jax.Array]):
            p, layer = xs
            return block(*carry, with_stacked(p, stacked, layer), layer), None

        layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, k, v), _ = jax.lax.scan(body, (x, k, v), (sliced, layers))
        return x[0], PagedKVCache(k=k, v=v)


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


def layer_rope(
    cfg: LlamaConfig, positions: jax.Array
) -> Callable[[jax.Array | int], tuple[jax.Array, jax.Array, jax.Array | int]]:
    """The per-layer attention facts at ``positions`` [B, T]: a function of the layer (an int, or
    an int32 scalar traced in the scan over layers) giving its cos and sin tables [B, T, H] and
    its sliding window (0: every earlier position). Without local layers every layer gets the
    same tables and window 0; with them (Gemma 3) a local layer gets ``rope_local_theta``'s
    tables (no scaling) and ``sliding_window``, picked by a select, so one scanned block serves
    both kinds."""
    cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    if not cfg.local_layers:
        return lambda layer: (cos, sin, 0)
    cos_l, sin_l = rope_tables(positions, cfg.head_dim, cfg.rope_local_theta)
    local = jnp.zeros((cfg.num_layers,), bool).at[jnp.asarray(cfg.local_layers)].set(True)

    def at(layer: jax.Array | int) -> tuple[jax.Array, jax.Array, jax.Array | int]:
        is_local = local[layer]
        window = jnp.where(is_local, cfg.sliding_window, 0).astype(jnp.int32)
        return jnp.where(is_local, cos_l, cos), jnp.where(is_local, sin_l, sin), window

    return at


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, heads, H] by the tables [B, T, H]: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def project_qkv(
    cfg: LlamaConfig, x: jax.Array, p: dict[str, jax.Array], cos: jax.Array, sin: jax.Array, cdt: jnp.dtype
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention inputs of one block: RMSNorm, Q/K/V projections (biases, q/k norms where
    the family has them) and RoPE.

    Shapes: x [B, T, D] f32 -> q [B, T, K, G, H] f32 (already scaled by ``cfg.query_scale``),
    and k, v [B, T, K, H] in the cache dtype ``cdt`` (attention uses exactly what the cache
    will hold).
    """
    B, T, _ = x.shape
    K, G, H = cfg.num_kv_heads, cfg.q_per_kv, cfg.head_dim
    wdt = p["wqkv"].dtype
    h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps).astype(wdt)
    qkv = matmul(h, p["wqkv"], "BTD,DKCH->BTKCH")  # [B, T, K, G + 2, H]
    if cfg.attention_bias:
        qkv = qkv + p["bqkv"].astype(qkv.dtype)
    q, k, v = qkv[:, :, :, :G].reshape(B, T, K * G, H), qkv[:, :, :, G], qkv[:, :, :, G + 1]
    if cfg.qk_norm:  # per head, over its H values
        q, k = rms_norm(q, p["q_norm"], cfg.rms_norm_eps), rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, cos, sin).reshape(B, T, K, G, H) * cfg.query_scale
    k = apply_rope(k, cos, sin)
    return q, k.astype(cdt), v.astype(cdt)


def out_and_mlp(cfg: LlamaConfig, x: jax.Array, p: dict[str, jax.Array], attn: jax.Array) -> jax.Array:
    """The rest of one block after attention: the O projection and the gated MLP (SiLU or
    GELU-tanh, ``cfg.mlp_activation``), each with its residual, and with ``cfg.sandwich_norms``
    each output RMS-normalised before it is added. Shapes: x [B, T, D] f32; attn [B, T, K, G,
    H] f32. Returns the new x."""
    B, T, _ = x.shape
    wdt = p["wo"].dtype
    # O projection as one [B*T, N*H] x [N*H, D] matmul: both reshapes are free (row-major), and
    # XLA:CPU does not transpose wo per step as it does for the two-axis contraction.
    wo = p["wo"]
    attn = attn.reshape(B, T, -1).astype(wdt)
    out = matmul(attn, wo if isinstance(wo, Packed) else wo.reshape(-1, wo.shape[-1]), "BTE,ED->BTD")
    x = x + (rms_norm(out, p["post_attn_norm"], cfg.rms_norm_eps) if cfg.sandwich_norms else out)

    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps).astype(wdt)
    gate_up = matmul(h, p["w_gate_up"], "BTD,DCF->BTCF")  # [B, T, 2, F]
    gate = gate_up[:, :, 0]
    gated = jax.nn.silu(gate) if cfg.mlp_activation == "silu" else jax.nn.gelu(gate, approximate=True)
    out = matmul((gated * gate_up[:, :, 1]).astype(wdt), p["w_down"], "BTF,FD->BTD")
    return x + (rms_norm(out, p["post_mlp_norm"], cfg.rms_norm_eps) if cfg.sandwich_norms else out)


# ---- the step the engine jits ------------------------------------------------------------------
def ragged_step(
    model: Llama,
    cache: PagedKVCache,
    tokens: jax.Array,
    meta: StepMeta,
    last_index: jax.Array,
    attention: AttentionBackend,
) -> tuple[jax.Array, PagedKVCache]:
    """One step over a flat batch of N tokens mixing decode tokens and prefill chunks of several
    sequences: every real token's key and value is written into its pages, then it attends
    causally by position to its sequence's cached keys and this step's.

    Args:
        model: the Llama module (stacked or per-layer weights).
        cache: the paged cache (donated by the caller's jit).
        tokens: [N] int32 token ids in [0, V); padding tokens carry any valid id (e.g. 0).
        meta: the step's metadata (``StepMeta``). Real positions must be below
            ``meta.window_pages * page_size`` for a windowed backend, and the slots of real
            tokens distinct; pages of positions a token attends to must have been written by an
            earlier step or hold a token of this one.
        last_index: [R] int32 in [0, N): row r's logits are those of token ``last_index[r]``
            (rows that sample nothing pass any valid index, e.g. 0).
        attention: the attention backend.

    Returns:
        logits [R, V] float32 (row r: token ``last_index[r]``'s), and the cache with every real
        token's keys and values written in every layer, rounded to the cache dtype before
        attention reads them (so a chunk's tokens see each other's rounded keys, as later steps
        will).
    """
    h, cache = model.forward(tokens, cache, meta, attention)
    return model.logits(h[last_index]), cache
