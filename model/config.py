"""Llama-family hyperparameters, read from GGUF metadata by one explicit mapping."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf

from model.families import UnsupportedModelError, for_gguf
from model.weights.gguf_file import GGUFMetadataError, architecture, field_value, open_gguf

MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # LlamaConfig.mlp_activation's values

# Bytes per element of each dtype name the server, the layouts' byte counts and the roofline use.
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


KV_SCALE_BYTES = 2  # an 8-bit KV cache row's float16 scale (model.attention.pages.to_stored)


def kv_row_bytes(head_dim: int, kv_dtype: str) -> int:
    """Bytes of one (token, KV head) row of keys (or values) in a KV cache of ``kv_dtype``:
    head_dim x its itemsize, and an 8-bit row's scale.

    Raises:
        ValueError: ``kv_dtype`` is not a key of ``ITEMSIZE``.
    """
    return head_dim * itemsize(kv_dtype) + (KV_SCALE_BYTES if kv_dtype == "int8" else 0)


def itemsize(dtype: str) -> int:
    """Bytes per element of the dtype called ``dtype`` ("float32" -> 4, "bfloat16" -> 2).

    Raises:
        ValueError: ``dtype`` is not a key of ``ITEMSIZE`` (the message lists them).
    """
    if dtype not in ITEMSIZE:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(ITEMSIZE)}")
    return ITEMSIZE[dtype]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (``rope_type: "llama3"`` in Hugging Face configs).

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` keep their
    frequency, longer than ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``, and those in between are interpolated smoothly (``model.llama.llama3_inv_freq``).
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"

    def __post_init__(self) -> None:
        if self.rope_type != "llama3":
            raise ValueError(f"unsupported RoPE scaling type {self.rope_type!r}; supported: 'llama3'")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape-defining hyperparameters of a Llama-architecture decoder (Touvron et al. 2023).

    Frozen and hashable, so it can be a static argument of jitted functions.

    Attributes:
        vocab_size: V, number of token ids.
        hidden_size: D, the residual-stream width.
        intermediate_size: F, the SwiGLU MLP width.
        num_layers: L, decoder blocks.
        num_heads: N, query heads.
        num_kv_heads: K, key/value heads (grouped-query attention, Ainslie et al. 2023); N % K == 0.
        head_dim: H, per-head width (usually D // N).
        rope_theta: RoPE base frequency (Su et al. 2021, eq. 15).
        rms_norm_eps: epsilon inside RMSNorm (Zhang & Sennrich 2019).
        max_position_embeddings: the context length the model was trained for, in tokens.
        tie_word_embeddings: the LM head reuses the token embedding matrix.
        rope_scaling: Llama 3.1 RoPE frequency scaling, or None for plain RoPE.
        architecture: the model family (``model.families``: "llama", "qwen2", "qwen3"); what
            follows is what the family fixes, kept here so the model reads no registry.
        attention_bias: the Q, K and V projections add a bias (Qwen2: Yang et al. 2024, "Qwen2
            Technical Report", §2.2.1).
        qk_norm: each query and key head is RMS-normalised over its H values before RoPE, with
            a learned [H] weight per layer (Qwen3: Yang et al. 2025, "Qwen3 Technical Report",
            §2, after Dehghani et al. 2023).
        sandwich_norms: each block also RMS-normalises the attention's and the MLP's outputs
            before their residual adds (Gemma 3: Gemma Team 2025, "Gemma 3 Technical Report",
            §2, "post-norm and pre-norm with RMSNorm").
        embed_scale: the token embeddings are multiplied by sqrt(D) (rounded to float32), as
            Gemma's are.
        mlp_activation: the gated MLP's activation: "silu" (SwiGLU, Shazeer 2020) or
            "gelu_tanh" (GeGLU with GELU's tanh approximation, Hendrycks & Gimpel 2016, §2).
        query_pre_attn_scalar: queries are scaled by this ** -0.5 before the dot products; 0
            means ``head_dim`` (the usual 1/sqrt(H)).
        sliding_window: the keys a local layer's token attends to: the W latest positions,
            its own included (position p sees p - W + 1 .. p); 0 = no local layers.
        local_layers: the indices of the layers that attend locally (within
            ``sliding_window``) and use ``rope_local_theta``; the others attend to every
            earlier position with ``rope_theta`` and ``rope_scaling`` (Gemma 3's 5 local
            layers to 1 global, §2.1 of its report).
        rope_local_theta: the RoPE base of the local layers.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    rope_scaling: RopeScaling | None = None
    architecture: str = "llama"
    attention_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    mlp_activation: str = "silu"
    query_pre_attn_scalar: float = 0.0
    sliding_window: int = 0
    local_layers: tuple[int, ...] = ()
    rope_local_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"mlp_activation {self.mlp_activation!r} is not one of {', '.join(MLP_ACTIVATIONS)}")
        object.__setattr__(self, "local_layers", tuple(int(i) for i in self.local_layers))  # JSON gives a list
        if any(not 0 <= i < self.num_layers for i in self.local_layers) or len(set(self.local_layers)) != len(
            self.local_layers
        ):
            raise ValueError(f"local_layers {self.local_layers} must be distinct layers in [0, {self.num_layers})")
        if self.local_layers and self.sliding_window < 1:
            raise ValueError(f"local layers need a sliding_window of at least 1, got {self.sliding_window}")

    @property
    def query_scale(self) -> float:
        """What queries are multiplied by before the dot products: ``query_pre_attn_scalar`` **
        -0.5, or H ** -0.5 (Vaswani et al. 2017, §3.2.1)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def dims(self) -> tuple[int, int, int, int, int, int, int]:
        """(L, D, N, K, H, F, V): layers, hidden, query heads, KV heads, head dim, MLP width,
        vocabulary (the einsum letters of ``model/llama.py``)."""
        return (
            self.num_layers,
            self.hidden_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate_size,
            self.vocab_size,
        )

    @property
    def q_per_kv(self) -> int:
        """G, query heads sharing one KV head."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """KV-cache bytes per token: 2 (K and V) * L * K * H * itemsize."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def param_count(self) -> int:
        """Number of parameters (embedding counted once when tied)."""
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * self.num_heads * h * 2 + d * self.num_kv_heads * h * 2
        per_layer = attn + 3 * d * f + 2 * d
        per_layer += (self.num_heads + 2 * self.num_kv_heads) * h if self.attention_bias else 0
        per_layer += 2 * h if self.qk_norm else 0
        per_layer += 2 * d if self.sandwich_norms else 0
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + head + self.num_layers * per_layer + d

    @classmethod
    def from_gguf(cls, source: str | Path | gguf.GGUFReader) -> LlamaConfig:
        """Build the config from a GGUF file's ``<architecture>.*`` metadata and its family's
        fixed facts (``model.families``: which layers are local, their RoPE base).

        Tied embeddings are inferred from the absence of an ``output.weight`` tensor,
        as llama.cpp does. The vocabulary size falls back to the tokenizer's token count.

        Raises:
            GGUFMetadataError: the architecture is not a served family's or a required key is
                missing.
        """
        reader = source if isinstance(source, gguf.GGUFReader) else open_gguf(source)
        arch = architecture(reader)
        try:
            family = for_gguf(arch)
        except UnsupportedModelError as exc:
            raise GGUFMetadataError(str(exc)) from None

        def key(name: str, default: Any = ...) -> Any:
            return field_value(reader, f"{arch}.{name}", default)

        num_heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        vocab = key("vocab_size", None)
        if vocab is None:
            vocab = len(field_value(reader, "tokenizer.ggml.tokens"))
        tensor_names = {t.name for t in reader.tensors}
        layers = int(key("block_count"))
        head_dim = int(key("attention.key_length", hidden // num_heads))
        local = family.gguf_local_layers(layers)
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=layers,
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(key("context_length")),
            tie_word_embeddings="output.weight" not in tensor_names,
            sliding_window=int(key("attention.sliding_window")) if local else 0,
            local_layers=local,
            rope_local_theta=family.rope_local_theta,
            **family.config_fields(),
        )

    @classmethod
    def _preset(cls, base: Mapping[str, object], overrides: Mapping[str, object]) -> LlamaConfig:
        """The config of ``base``'s fields with ``overrides`` replacing some of them.

        Raises:
            TypeError: a key that is not a field. ValueError: as the constructor.
        """
        return cls(**{**base, **overrides})  # type: ignore[arg-type]

    @classmethod
    def smollm2_135m(cls, **overrides: object) -> LlamaConfig:
        """SmolLM2-135M's config (the values its GGUF's metadata gives: 30 layers, hidden 576,
        9 query / 3 KV heads of 64, MLP 1536, vocabulary 49152, tied embeddings), for benchmarks
        and tests that need its shapes without the file; ``overrides`` replace fields."""
        base = dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_layers=30,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
        )
        return cls._preset(base, overrides)

    @classmethod
    def tiny(cls, **overrides: object) -> LlamaConfig:
        """A small random-weight config for fast tests (2 layers, GQA with 4 query / 2 KV heads)."""
        base = dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=512,
            tie_word_embeddings=True,
        )
        return cls._preset(base, overrides)
