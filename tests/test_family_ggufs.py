"""GGUF files of every family whose files load (Llama, Qwen2, Qwen3, Gemma 3), written from tiny
random-weight Hugging Face models the way llama.cpp's ``convert_hf_to_gguf.py`` writes them
(tensor names, Llama's Q/K rows permuted for its interleaved RoPE, Gemma's norms stored as 1 + w,
the family's metadata keys), load into the served engine and give transformers' logits on the
same weights, greedy ids equal. The real Qwen2 and Gemma 3 files are checked in
``test_qwen2_gguf.py`` and ``test_gemma3_gguf.py``; no Qwen3 GGUF ships in a package, so this is
its check. Some matmuls are stored as Q8_0 (``gguf.quants.quantize``) and the HF side gets the
same values, dequantized by ``gguf``: the stored-blocks path is compared too.

Needs ``torch`` and ``transformers`` (the ``hf`` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_hf_llama import ENGINES, PREFILL, hf_logits, our_logits, tiny_family_model

from model.weights.gguf_weights import stored_matmuls, unpermute_rope_rows
from model.weights.loader import load_model

# (transformers config class, its fields, GGUF architecture); Gemma 3 with 6 layers so that the
# GGUF's fixed pattern (every sixth layer global) is the HF config's ``layer_types``.
CASES = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False, "rms_norm_eps": 1e-5}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True, "head_dim": 32}),
    "gemma3": ("Gemma3TextConfig", {
        "tie_word_embeddings": True, "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 5,
        "num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    }),
}  # fmt: skip
LAYER_TENSORS = {  # HF name within a layer -> GGUF name within a block
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
SANDWICH = {  # Gemma's: "post_attention_layernorm" follows attention; the MLP's pre-norm is its own
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
Q8_0 = ("attn_output", "ffn_gate", "ffn_up", "ffn_down")  # stored as blocks; the rest float32


def hf_to_gguf(hf_dir: Path, arch: str, config: Any, out: Path) -> None:
    """``hf_dir``'s model as a GGUF at ``out``, and ``hf_dir``'s safetensors rewritten with the
    Q8_0 matmuls' dequantized values (so both sides hold the same weights)."""
    tensors = load_file(str(hf_dir / "model.safetensors"))
    L, N, K = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    writer = gguf.GGUFWriter(str(out), arch=arch)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(L)
    writer.add_head_count(N)
    writer.add_head_count_kv(K)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // N
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("full_attention", rope).get("rope_theta", getattr(config, "rope_theta", 10000.0))
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}  # fmt: skip
    hf_layer = {**LAYER_TENSORS, **(SANDWICH if arch == "gemma3" else {"post_attention_layernorm": "ffn_norm"})}
    for i in range(L):
        for h, g in hf_layer.items():
            for kind in ("weight", "bias"):
                names[f"model.layers.{i}.{h}.{kind}"] = f"blk.{i}.{g}.{kind}"
    for hf_name, array in tensors.items():
        name = names[hf_name]
        array = np.ascontiguousarray(array, np.float32)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            array = array + np.float32(1.0)  # convert_hf_to_gguf.py stores Gemma's 1 + w
        if arch == "llama" and any(f".{p}." in name for p in ("attn_q", "attn_k")):
            # llama.cpp's permute: rotate-half rows -> interleaved pairs (its inverse is ours)
            heads = N if ".attn_q." in name else K
            half = array.shape[0] // heads // 2
            array = array.reshape(heads, 2, half, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)
            assert np.array_equal(unpermute_rope_rows(array, heads), np.asarray(tensors[hf_name], np.float32))
        if name.split(".")[-2] in Q8_0:
            blocks = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            tensors[hf_name] = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0).astype(np.float32)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(hf_dir / "model.safetensors"))


@pytest.mark.parametrize("family", list(CASES))
def test_a_converted_gguf_gives_transformers_logits(family: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="needs torch and transformers (the hf extra)")
    config_class, fields = CASES[family]
    model = tiny_family_model(tmp_path / "hf", config_class, fields)
    path = tmp_path / f"{family}.gguf"
    hf_to_gguf(tmp_path / "hf", family, model.config, path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()  # the Q8_0 values
    expected = hf_logits(model)[PREFILL - 1 :]

    for stored in (False, True):
        loaded = load_model(path, stored=stored)
        cfg = loaded.cfg
        assert cfg.architecture == family and cfg.tie_word_embeddings == fields["tie_word_embeddings"]
        assert cfg.local_layers == ((0, 1, 2, 3, 4) if family == "gemma3" else ())
        assert set(stored_matmuls(path, cfg)) == {"wo", "w_gate_up", "w_down"}
        for name, engine in ENGINES.items():
            got = our_logits(cfg, loaded.graphdef, loaded.state, **engine)
            np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4, err_msg=f"{name}, stored={stored}")
            assert (got.argmax(-1) == expected.argmax(-1)).all(), name
    assert np.abs(expected).max() > 1.0
