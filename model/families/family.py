"""What a model family is to the rest of meshserve: its names in the files people download and
what it adds to the shared decoder (``model.llama``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


class UnsupportedModelError(ValueError):
    """A file or config names a family meshserve does not serve (the message lists those it does)."""


def no_check(hf: Mapping[str, Any]) -> None:
    """A family whose config.json has nothing it must refuse beyond the shared fields."""


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name: its GGUF ``general.architecture`` and ``LlamaConfig.architecture`` ("qwen2").
        hf_architectures: the ``architectures`` names of its Hugging Face ``config.json``.
        attention_bias: Q, K and V projections with biases (``LlamaConfig.attention_bias``).
        qk_norm: per-head q/k RMSNorm before RoPE (``LlamaConfig.qk_norm``).
        gguf: its GGUF files load (their tensor names, tokenizer and template are read).
        gguf_rope_permuted: its GGUF files store the Q and K rows permuted for llama.cpp's
            interleaved RoPE (``permute`` in llama.cpp's ``convert_hf_to_gguf.py``, done for the
            Llama family only; Qwen's files keep Hugging Face's rotate-half order, llama.cpp's
            NEOX RoPE).
        sandwich_norms, embed_scale, mlp_activation: as ``LlamaConfig``'s fields of those names
            (Gemma 3's block, embedding scale and GeGLU MLP).
        gguf_global_every: in its GGUF files every this-many-th layer (the last of each run)
            attends globally and the others within ``attention.sliding_window`` (llama.cpp's
            ``set_swa_pattern``, hard-coded per family since the files do not say); 0: no
            local layers.
        rope_local_theta: the RoPE base of its local layers (not in its GGUF files either).
        hf_norm_offset: its Hugging Face checkpoints store each RMSNorm weight less this (Gemma
            multiplies by 1 + w), added back when they are read.
        check_hf: raises ``ValueError`` naming a ``config.json`` field that asks for what this
            family's implementation lacks (a feature silently ignored would change the logits).
    """

    name: str
    hf_architectures: tuple[str, ...]
    attention_bias: bool = False
    qk_norm: bool = False
    gguf: bool = False
    gguf_rope_permuted: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    mlp_activation: str = "silu"
    gguf_global_every: int = 0
    rope_local_theta: float = 10000.0
    hf_norm_offset: float = 0.0
    check_hf: Callable[[Mapping[str, Any]], None] = no_check

    def config_fields(self) -> dict[str, Any]:
        """What the family fixes in a ``LlamaConfig``: ``architecture``, ``attention_bias``,
        ``qk_norm``, ``sandwich_norms``, ``embed_scale``, ``mlp_activation`` (the readers of
        every format pass these)."""
        return {
            "architecture": self.name,
            "attention_bias": self.attention_bias,
            "qk_norm": self.qk_norm,
            "sandwich_norms": self.sandwich_norms,
            "embed_scale": self.embed_scale,
            "mlp_activation": self.mlp_activation,
        }

    def gguf_local_layers(self, num_layers: int) -> tuple[int, ...]:
        """The local (sliding-window) layers of its GGUF files of ``num_layers`` layers: all
        but every ``gguf_global_every``-th."""
        every = self.gguf_global_every
        return tuple(i for i in range(num_layers) if (i + 1) % every) if every else ()

    def describe(self) -> str:
        """ "qwen2 (Qwen2ForCausalLM)": its names, for error messages."""
        return f"{self.name} ({', '.join(self.hf_architectures)})"
