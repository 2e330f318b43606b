"""Gemma 3 text models (Gemma Team 2025, "Gemma 3 Technical Report", §2): the shared decoder with
per-head q/k RMSNorm (instead of Gemma 2's soft-capping), RMSNorm both before and after the
attention and the MLP ("sandwich" norms), a GeGLU MLP (GELU, tanh approximation), embeddings
scaled by sqrt(hidden), a head_dim of its own, queries scaled by ``query_pre_attn_scalar`` **
-0.5, and 5 local layers (sliding window, RoPE base 10 000) to each global one (RoPE base
1 000 000).

Hugging Face stores its RMSNorm weights as w - 1 (it multiplies by 1 + w); its GGUF files store
w (``convert_hf_to_gguf.py`` adds the 1), which is what the shared decoder multiplies by.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model.families.family import Family


def check_hf(hf: Mapping[str, Any]) -> None:
    """What Gemma 3's config may ask for that this implementation lacks: logit soft-capping
    (Gemma 2's; null in every Gemma 3), bidirectional attention (its embedding variants), Q/K/V/O
    biases, an activation other than GELU-tanh.

    Raises:
        ValueError: the field named.
    """
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(name) is not None:
            raise ValueError(f"config.json: {name}={hf[name]} is not supported for Gemma 3 (only null)")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention=true is not supported (a causal LM only)")
    if hf.get("attention_bias"):
        raise ValueError("config.json: attention_bias=true is not supported for Gemma 3 (released models have none)")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"config.json: hidden_activation={act!r} is not supported (only 'gelu_pytorch_tanh')")


GEMMA3 = Family(
    name="gemma3",
    hf_architectures=("Gemma3ForCausalLM",),
    qk_norm=True,
    gguf=True,
    sandwich_norms=True,
    embed_scale=True,
    mlp_activation="gelu_tanh",
    gguf_global_every=6,
    rope_local_theta=10000.0,
    hf_norm_offset=1.0,
    check_hf=check_hf,
)
