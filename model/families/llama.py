"""Llama (Touvron et al. 2023) and the models that keep its shape (SmolLM2, Llama 3.x): the
shared decoder as it is, no biases, no q/k norms."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model.families.family import Family


def check_hf(hf: Mapping[str, Any]) -> None:
    """Llama's biases (``attention_bias`` puts one on Q, K, V and O; ``mlp_bias`` on the MLP)
    are not implemented.

    Raises:
        ValueError: either flag is set (named).
    """
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"config.json: {flag}=true is not supported (this Llama has no biases)")


LLAMA = Family(
    name="llama", hf_architectures=("LlamaForCausalLM",), gguf=True, gguf_rope_permuted=True, check_hf=check_hf
)
