"""Model families beside Llama (``model.families``): Qwen2 (Q/K/V biases, untied head), Qwen3
(per-head q/k RMSNorm, head_dim other than hidden / heads) and Gemma 3 (sandwich norms, GELU-tanh,
scaled embeddings, query_pre_attn_scalar, a local layer with a sliding window of 5 positions and
its own RoPE base beside a global one) from Hugging Face directories that
transformers saves with random weights give transformers' logits through the served engine's
step, on one device and split over the ``model`` axis; every preset layout on 8 CPU devices
serves one device's greedy ids; their configs round-trip through a converted checkpoint;
unsupported families and features are one-line errors.

The comparisons need ``torch`` and ``transformers`` (the ``hf`` extra); without them skipped,
saying so.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from test_golden import served
from test_hf_llama import ENGINES, PREFILL, hf_logits, our_logits, tiny_family_model, write_tokenizer

from model.config import LlamaConfig
from model.families import FAMILIES, UnsupportedModelError, for_gguf, for_hf
from model.weights.hf_weights import HFConfigError, config_from_hf
from model.weights.loader import abstract_llama, load_hf_model, load_model
from service.engine.config import EngineConfig
from service.engine.runner import Runner
from sharding.layouts import Layout, LayoutError, load_layout, preset_names

# A tiny Gemma 3: layer 0 local (window 5: the 20-token sequence runs well past it), layer 1
# global; queries scaled by 24^-0.5, not head_dim's 32^-0.5.
GEMMA3 = {
    "tie_word_embeddings": True,
    "head_dim": 32,
    "sliding_window": 5,
    "layer_types": ["sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 24,
}
# (transformers config class, its fields beyond the shared ones)
FAMILY_CASES = {
    "qwen2-untied": ("Qwen2Config", {"tie_word_embeddings": False}),
    "qwen2-tied": ("Qwen2Config", {"tie_word_embeddings": True}),
    # head_dim 32 with hidden 64 and 4 heads: q/k/v widths are not the hidden size.
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": False, "head_dim": 32}),
    "gemma3": ("Gemma3TextConfig", GEMMA3),
}


@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_logits_and_greedy_ids_match_transformers(case: str, tmp_path: Path) -> None:
    config_class, extra = FAMILY_CASES[case]
    model = tiny_family_model(tmp_path, config_class, extra)
    expected = hf_logits(model)[PREFILL - 1 :]
    cfg, graphdef, state = load_hf_model(tmp_path)
    family = FAMILIES[case.split("-")[0]]
    assert cfg.architecture == family.name
    assert (cfg.attention_bias, cfg.qk_norm) == (family.attention_bias, family.qk_norm)
    assert ("lm_head" in state) == (not extra["tie_word_embeddings"])
    for name, engine in ENGINES.items():
        got = our_logits(cfg, graphdef, state, **engine)
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4, err_msg=name)
        assert (got.argmax(-1) == expected.argmax(-1)).all(), name
    assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero logits

    # What the family adds matters on these weights: without it the logits are far off.
    plain = dataclasses.replace(cfg, attention_bias=False, qk_norm=False)
    graphdef_plain, _ = abstract_llama(plain)
    state_plain = {k: v for k, v in state.items() if k != "layers"}
    state_plain["layers"] = {k: v for k, v in state["layers"].items() if k not in ("bqkv", "q_norm", "k_norm")}
    assert np.abs(our_logits(plain, graphdef_plain, state_plain) - expected).max() > 1e-2
    if cfg.local_layers:  # and so does the sliding window
        everywhere = dataclasses.replace(cfg, local_layers=(), sliding_window=0)
        assert np.abs(our_logits(everywhere, abstract_llama(everywhere)[0], state) - expected).max() > 1e-2


@pytest.mark.parametrize("layout", ["1x2", "1x4"])
def test_a_split_model_axis_gives_the_same_logits(layout: str, tmp_path: Path) -> None:
    """Heads split (1x2: 2 KV heads over 2 devices, the biases and norms with them) and the
    fallback where they do not divide (1x4: attention replicated, the MLP and vocabulary split)."""
    model = tiny_family_model(tmp_path, "Qwen2Config", {"tie_word_embeddings": False})
    expected = hf_logits(model)[PREFILL - 1 :]
    cfg, graphdef, state = load_hf_model(tmp_path)
    np.testing.assert_allclose(our_logits(cfg, graphdef, state, load_layout(layout)), expected, atol=1e-4, rtol=1e-4)
    model3 = tiny_family_model(tmp_path / "qwen3", "Qwen3Config", {"tie_word_embeddings": False, "head_dim": 32})
    cfg3, graphdef3, state3 = load_hf_model(tmp_path / "qwen3")
    got = our_logits(cfg3, graphdef3, state3, load_layout(layout))
    np.testing.assert_allclose(got, hf_logits(model3)[PREFILL - 1 :], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["qwen3", "gemma3"])
def test_a_converted_checkpoint_keeps_its_family(case: str, tmp_path: Path) -> None:
    """``meshserve convert`` of a Qwen3 or Gemma 3 directory: the checkpoint's config is the
    directory's, what the family adds included (Gemma's local layers, window, RoPE bases and query
    scalar), and restored it gives the same logits."""
    from model.weights.checkpoint import read_checkpoint_config
    from service.server.cli import main

    src = tmp_path / "hf"
    config_class, extra = FAMILY_CASES[case]
    model = tiny_family_model(src, config_class, extra)
    write_tokenizer(src)
    assert main(["convert", str(src), str(tmp_path / "ckpt")]) == 0
    cfg, _ = read_checkpoint_config(tmp_path / "ckpt")
    assert cfg == load_hf_model(src)[0] and cfg.architecture == case and cfg.qk_norm
    assert cfg.local_layers == ((0,) if case == "gemma3" else ())
    restored = load_model(tmp_path / "ckpt")
    got = our_logits(restored.cfg, restored.graphdef, restored.state)
    np.testing.assert_allclose(got, hf_logits(model)[PREFILL - 1 :], atol=1e-4, rtol=1e-4)


def hf_config(**fields: Any) -> dict[str, Any]:
    base = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 256}  # fmt: skip
    return base | fields


def test_unsupported_families_and_features_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(HFConfigError) as exc:
        config_from_hf(hf_config(architectures=["MistralForCausalLM"]))
    message = str(exc.value)
    assert "\n" not in message and "MistralForCausalLM" in message
    assert all(f"{f.name} ({f.hf_architectures[0]})" in message for f in FAMILIES.values())
    with pytest.raises(HFConfigError, match="use_sliding_window"):
        config_from_hf(hf_config(architectures=["Qwen2ForCausalLM"], use_sliding_window=True))
    with pytest.raises(HFConfigError, match="attention_bias"):
        config_from_hf(hf_config(architectures=["Qwen3ForCausalLM"], attention_bias=True))
    with pytest.raises(HFConfigError, match="attention_bias"):
        config_from_hf(hf_config(architectures=["LlamaForCausalLM"], attention_bias=True))
    cfg = config_from_hf(hf_config(architectures=["Qwen2ForCausalLM"], num_key_value_heads=2))
    assert cfg == LlamaConfig(128, 64, 128, 2, 4, 2, 16, 10000.0, 1e-6, 256, tie_word_embeddings=False,
                              architecture="qwen2", attention_bias=True)  # fmt: skip
    assert for_hf(["Qwen3ForCausalLM"]).qk_norm and for_gguf("llama").name == "llama"
    with pytest.raises(UnsupportedModelError, match=r"architecture 'gemma2'; supported: llama, qwen2, qwen3, gemma3$"):
        for_gguf("gemma2")
    gemma = hf_config(architectures=["Gemma3ForCausalLM"], layer_types=["sliding_attention", "full_attention"])
    for field, value in [("final_logit_softcapping", 30.0), ("use_bidirectional_attention", True),
                         ("hidden_activation", "gelu")]:  # fmt: skip
        with pytest.raises(HFConfigError, match=field):
            config_from_hf(gemma | {"sliding_window": 4, field: value})
    with pytest.raises(HFConfigError, match="sliding_window"):
        config_from_hf(gemma)
    with pytest.raises(HFConfigError, match="layer_types"):
        config_from_hf(gemma | {"sliding_window": 4, "layer_types": ["sliding_attention", "chunked_attention"]})
    old_style = config_from_hf(gemma | {"layer_types": None, "sliding_window_pattern": 2, "sliding_window": 4,
                                        "rope_theta": 1e6, "rope_local_base_freq": 1e4})  # fmt: skip
    assert (old_style.local_layers, old_style.sliding_window, old_style.rope_local_theta) == ((0,), 4, 1e4)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(architectures=["GPT2LMHeadModel"])))
    with pytest.raises(HFConfigError, match="GPT2LMHeadModel"):
        load_hf_model(tmp_path)


LAYOUT_CASES = {
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False, "head_dim": 16}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": False, "head_dim": 16}),
    # The real files' heads, at head_dim 16: Qwen2.5-Coder-0.5B's 14 query heads on 2 KV heads,
    # the 1.5B's 12 on 2 (tp3 divides 12 but not 2), Gemma 3 270M's 4 on 1.
    "qwen2-14-2": ("Qwen2Config", {"tie_word_embeddings": False, "hidden_size": 224, "num_attention_heads": 14}),
    "qwen2-12-2": ("Qwen2Config", {"tie_word_embeddings": False, "hidden_size": 192, "num_attention_heads": 12}),
    "gemma3-4-1": ("Gemma3TextConfig", GEMMA3 | {"num_key_value_heads": 1}),
}


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_every_preset_layout_serves_one_devices_greedy_ids(case: str, tmp_path: Path) -> None:
    """On 8 CPU devices: each preset (and 1x2, where 2 KV heads split) serves the greedy ids and
    last-prompt logits of one device, holding the weight bytes its plan predicts; ``tp3``, which
    asks for attention split over heads, is refused: 3 does not divide 2 (or 1) KV heads."""
    config_class, fields = LAYOUT_CASES[case]
    tiny_family_model(tmp_path, config_class, fields)
    cfg, graphdef, state = load_hf_model(tmp_path)
    ecfg = EngineConfig(num_slots=8, max_seq_len=64, chunk_size=32)
    prompts = [[3, 17, 99, 42, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
    ref_ids, ref_logits = served(Runner(cfg, graphdef, state, Layout("1x1"), ecfg, jax.devices()[:1]), prompts, 6)
    for name in [*preset_names(), "1x2"]:
        layout = load_layout(name)
        if name == "tp3":
            with pytest.raises(LayoutError, match="heads"):
                Runner(cfg, graphdef, state, layout, ecfg, jax.devices()[: layout.num_devices])
            continue
        runner = Runner(cfg, graphdef, state, layout, ecfg, jax.devices()[: layout.num_devices])
        ids, logits = served(runner, prompts, 6)
        assert ids == ref_ids, name
        for got, want in zip(logits, ref_logits, strict=True):
            np.testing.assert_allclose(got, want, atol=2e-4, rtol=0, err_msg=name)
        # A tied model on one device gains a packed copy of its head for the native kernel, which
        # the plan (a layout's) does not predict.
        head_copy = (
            4 * cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings and "lm_head" in runner.params else 0
        )
        predicted = runner.plan.weight_bytes_per_device(cfg, 4) + head_copy
        assert set(runner.weight_bytes_per_device().values()) == {predicted}, name
        split = layout.model == 1 or (layout.model == 2 and cfg.num_kv_heads % 2 == 0)
        assert runner.plan.attention == ("heads" if split else "replicated"), name
