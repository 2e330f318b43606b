"""Qwen2 and Qwen2.5 (Yang et al. 2024, "Qwen2 Technical Report", §2.2.1): the Llama decoder
with biases on the Q, K and V projections (not on O), usually an untied LM head."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model.families.family import Family


def check_sliding_window(hf: Mapping[str, Any]) -> None:
    """Qwen's optional sliding-window attention (``use_sliding_window``, off in every released
    Qwen2.5 and Qwen3 config) is not implemented for this family.

    Raises:
        ValueError: ``use_sliding_window`` is true.
    """
    if hf.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window=true is not supported for Qwen models")


QWEN2 = Family(
    name="qwen2", hf_architectures=("Qwen2ForCausalLM",), attention_bias=True, gguf=True, check_hf=check_sliding_window
)
