"""Qwen3 dense models (Yang et al. 2025, "Qwen3 Technical Report", §2): the Llama decoder with
each query and key head RMS-normalised over its head_dim before RoPE (QK-Norm), no biases, and a
head_dim that need not be hidden / heads. Its GGUF files keep Hugging Face's rotate-half Q/K order
(llama.cpp's NEOX RoPE) and name the norms ``attn_q_norm`` / ``attn_k_norm``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model.families.family import Family
from model.families.qwen2 import check_sliding_window


def check_hf(hf: Mapping[str, Any]) -> None:
    """Qwen3's ``attention_bias`` puts biases on Q, K, V and O (not implemented), and its sliding
    window as Qwen2's.

    Raises:
        ValueError: the field named.
    """
    if hf.get("attention_bias"):
        raise ValueError("config.json: attention_bias=true is not supported for Qwen3 (released models have none)")
    check_sliding_window(hf)


QWEN3 = Family(name="qwen3", hf_architectures=("Qwen3ForCausalLM",), qk_norm=True, gguf=True, check_hf=check_hf)
