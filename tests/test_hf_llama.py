"""Hugging Face Llama directories: a tiny random ``LlamaForCausalLM`` saved by transformers loads and
gives transformers' logits; its tokenizer files load; bad configs and weights fail naming the field
or tensor.

The comparisons need ``torch`` and ``transformers`` (the ``hf`` extra: ``pip install -e '.[hf]'``);
without them those tests are skipped, saying so. The error cases need neither.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from model.config import LlamaConfig, RopeScaling
from model.text.tokenizer import Tokenizer
from model.weights.gguf_weights import WeightError
from model.weights.hf_weights import HFConfigError, config_from_hf, load_hf_llama, load_hf_params
from model.weights.loader import abstract_llama, load_hf_model, model_format
from service.engine.batch import RaggedBatch
from service.engine.config import EngineConfig
from service.engine.runner import Runner
from sharding.layouts import Layout

TORCH_REASON = "needs torch==2.13.0 and transformers (pip install -e '.[hf]')"
SEQ = [3, 17, 99, 42, 5, 77, 8, 120, 64, 1, 33, 90, 11, 2, 50, 127, 6, 71, 29, 100]
PREFILL = 6  # prompt tokens; the rest go through decode steps
MAX_LEN = 32
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # With head_dim 16 and theta 10000 the wavelengths are 6.3, 19.9, 62.8, ...: one is kept, one
    # interpolated, the rest divided by the factor; every branch of the scaling runs.
    "original_max_position_embeddings": 32,
}


def tiny_family_model(out: Path, config_class: str, fields: dict[str, Any], max_shard_size: str | None = None) -> Any:
    """A random-weight model of transformers' ``config_class`` (vocab 128, hidden 64, 2 layers, 4
    query / 2 KV heads; ``fields`` add to or replace these) saved into ``out``, its norm weights
    and biases random too (transformers initialises them to ones and zeros, which would hide a
    norm or bias applied wrongly); returns the torch model in eval mode."""
    torch = pytest.importorskip("torch", reason=TORCH_REASON)
    transformers = pytest.importorskip("transformers", reason=TORCH_REASON)
    base = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        initializer_range=0.2,  # large enough that attention, and so RoPE, moves the logits
    )
    config = getattr(transformers, config_class)(**(base | fields))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return model


def tiny_hf_model(out: Path, tie: bool, rope_scaling: dict | None, max_shard_size: str | None = None) -> Any:
    """A random-weight LlamaForCausalLM (``tiny_family_model``'s shapes) saved into ``out``."""
    fields = {
        "tie_word_embeddings": tie,
        "rms_norm_eps": 1e-5,
        "rope_scaling": dict(rope_scaling) if rope_scaling else None,
    }
    return tiny_family_model(out, "LlamaConfig", fields, max_shard_size)  # transformers edits rope_scaling in place


def hf_logits(model: Any) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([SEQ])).logits[0].numpy()


# The served engine's kernel choices on one CPU device: the default (native attention, float32
# panels, scanned layers), XLA's attention and dots, and the unrolled layer loop.
ENGINES = {"auto": {}, "xla": dict(attention="xla", matmul="xla"), "unrolled": dict(layer_loop="unrolled")}


ONE_DEVICE = Layout("1x1")


def row0_logits(runner: Runner, prompt: list[int], then: list[int], chunk: int) -> np.ndarray:
    """Logits [1 + len(then), V] through ``runner.step`` of batches laid out as
    ``service.engine.batch`` says, in row 0 over pages 0, 1, ...: ``prompt`` in prefill chunks of
    ``chunk`` tokens (the last chunk's last token's logits first), then each id of ``then`` as a
    decode token (fed, not sampled)."""
    g = runner.geometry

    def batch(start: int, ids: list[int], decode: bool) -> RaggedBatch:
        n = len(ids)
        b = g.empty_batch(g.decode_buckets[0], 0 if decode else g.prefill_bucket(g.padded(n)))
        at = 0 if decode else b.decode_tokens  # the decode region, or the prefill region's first block
        b.tokens[at : at + n], b.positions[at : at + n], b.rows[at : at + n] = ids, np.arange(start, start + n), 0
        b.generated[at : at + n] = decode
        b.last_index[0] = at + n - 1
        b.page_tables[0] = np.arange(g.max_pages)
        return dataclasses.replace(b, num_real=n, max_position=start + n - 1)

    for start in range(0, len(prompt), chunk):
        out = runner.step(batch(start, prompt[start : start + chunk], decode=False))
    rows = [out.row_logits(0)]
    for i, token in enumerate(then):
        rows.append(runner.step(batch(len(prompt) + i, [token], decode=True)).row_logits(0))
    return np.stack(rows)


def our_logits(
    cfg: LlamaConfig, graphdef: nnx.GraphDef, params: Any, layout: Layout = ONE_DEVICE, **engine: Any
) -> np.ndarray:
    """Logits at every position of SEQ from PREFILL - 1 on, through the served engine's step
    (``row0_logits``): the first PREFILL tokens as one prefill chunk, then one decode token per
    remaining token of SEQ, on the first devices ``layout`` needs (one data replica).
    ``engine``: ``EngineConfig`` fields."""
    ecfg = EngineConfig(num_slots=1, max_seq_len=MAX_LEN, chunk_size=16, page_size=4, kv_cache_tokens=MAX_LEN, **engine)
    runner = Runner(cfg, graphdef, params, layout, ecfg, jax.devices()[: layout.num_devices])
    return row0_logits(runner, SEQ[:PREFILL], SEQ[PREFILL:], chunk=PREFILL)  # positions PREFILL-1 .. len(SEQ)-1


CASES = {
    "tied": (True, None, None),
    "untied": (False, None, None),
    "untied-sharded-llama3": (False, LLAMA3, "100KB"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case: str, tmp_path: Path) -> None:
    tie, rope, shard = CASES[case]
    model = tiny_hf_model(tmp_path, tie, rope, shard)
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shard)
    expected = hf_logits(model)[PREFILL - 1 :]

    assert model_format(tmp_path) == "hf"
    cfg, graphdef, state = load_hf_model(tmp_path)
    assert cfg.tie_word_embeddings == tie and ("lm_head" in state) == (not tie)
    assert cfg.rope_scaling == (None if rope is None else RopeScaling(8.0, 1.0, 4.0, 32))
    for name, engine in ENGINES.items():
        got = our_logits(cfg, graphdef, state, **engine)
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4, err_msg=name)
    assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero logits

    if rope is not None:
        # The scaling matters here: plain RoPE on the same weights is far off after position 0.
        plain = dataclasses.replace(cfg, rope_scaling=None)
        graphdef_plain, _ = abstract_llama(plain)
        assert np.abs(our_logits(plain, graphdef_plain, state) - expected).max() > 1e-2


def test_converted_hf_checkpoint_restores_the_same_weights(tmp_path: Path) -> None:
    """HF -> ``meshserve convert`` (bfloat16) -> restore equals the HF weights rounded to bfloat16."""
    from model.weights.checkpoint import read_checkpoint_config, restore_checkpoint
    from service.server.cli import main
    from sharding.layouts import load_layout
    from sharding.mesh import make_mesh
    from sharding.plan import make_plan
    from sharding.rules import param_shardings

    src = tmp_path / "hf"
    tiny_hf_model(src, tie=False, rope_scaling=LLAMA3)
    write_tokenizer(src)
    assert main(["convert", str(src), str(tmp_path / "ckpt"), "--dtype", "bfloat16"]) == 0
    cfg, params = load_hf_llama(src)
    assert read_checkpoint_config(tmp_path / "ckpt")[0] == cfg
    layout = load_layout("1x2")
    _, state = abstract_llama(cfg)
    shardings = param_shardings(state, make_mesh(layout), make_plan(layout, cfg).rules)
    restored = restore_checkpoint(tmp_path / "ckpt", shardings)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(params), strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), b.astype(ml_dtypes.bfloat16))
    tok = Tokenizer.from_checkpoint(tmp_path / "ckpt")
    assert tok.encode("hello world") == Tokenizer.from_hf_dir(src).encode("hello world")


# ---- tokenizer ----------------------------------------------------------------------------------
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }} : {{ m['content'] }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant :{% endif %}"
)


def write_tokenizer(out: Path) -> Any:
    """A word-level tokenizer saved by transformers (tokenizer.json, tokenizer_config.json,
    chat_template.jinja) plus a generation_config.json listing two EOS ids; returns it."""
    transformers = pytest.importorskip("transformers", reason=TORCH_REASON)
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as Backend

    words = ["<unk>", "<s>", "</s>", "<|eot|>", "hello", "world", "user", "assistant", ":"]
    words += [f"w{i}" for i in range(128 - len(words))]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>", "<|eot|>")])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.decoder = decoders.WordPiece()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 3]}))
    return tok


def test_tokenizer_from_hf_dir_matches_transformers(tmp_path: Path) -> None:
    reference = write_tokenizer(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path)
    for text in ["hello world w7", "user : hello<|eot|>", "w1 w2 w3 unknownword"]:
        assert tok.encode(text) == reference(text).input_ids  # BOS from the post-processor
        ids = tok.encode(text)
        assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert tok.bos_id == 1 and tok.eos_ids == {2, 3} and tok.special_ids == {0, 1, 2, 3}  # <unk> too
    assert tok.vocab_size == 128
    chat = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(chat) == reference.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )

    # Checkpoints carry the same tokenizer through save / from_checkpoint.
    (tmp_path / "ck").mkdir()
    tok.save(tmp_path / "ck")
    again = Tokenizer.from_checkpoint(tmp_path / "ck")
    assert again.encode("hello world w7") == tok.encode("hello world w7")
    assert (again.eos_ids, again.special_ids, again.apply_chat_template(chat)) == (
        tok.eos_ids,
        tok.special_ids,
        tok.apply_chat_template(chat),
    )


# ---- errors (no torch needed) -----------------------------------------------------------------
def hf_config(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    }
    base.update(overrides)
    return base


def test_config_mapping() -> None:
    cfg = config_from_hf(hf_config(rope_theta=500000.0, head_dim=32))
    assert (cfg.head_dim, cfg.rope_theta, cfg.num_kv_heads, cfg.rope_scaling) == (32, 500000.0, 2, None)
    # transformers 4 spelling: rope_scaling with "type", rope_theta beside it.
    old_style = {k: v for k, v in LLAMA3.items() if k != "rope_type"} | {"type": "llama3"}
    legacy = config_from_hf(hf_config(rope_theta=5e5, rope_scaling=old_style))
    assert legacy.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32) and legacy.rope_theta == 5e5
    # transformers 5 spelling: rope_parameters holds rope_theta too.
    v5 = config_from_hf(hf_config(rope_parameters={**LLAMA3, "rope_theta": 1e4}))
    assert v5.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32) and v5.rope_theta == 1e4
    assert config_from_hf(hf_config(rope_parameters={"rope_type": "default", "rope_theta": 7.0})).rope_theta == 7.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"architectures": ["MistralForCausalLM"]}, r"architectures=\['MistralForCausalLM'\] is not supported"),
        ({"architectures": None}, r"architectures=\[\] is not supported; supported: llama \(LlamaForCausalLM\)"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_scaling\.rope_type='yarn' is not supported"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, r"rope_parameters\.rope_type='linear'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"lacks 'low_freq_factor'"),
        ({"attention_bias": True}, r"attention_bias=true is not supported"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
        ({"intermediate_size": None}, r"required field 'intermediate_size' is missing"),
    ],
)
def test_config_errors_name_the_field(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(HFConfigError, match=message):
        config_from_hf(hf_config(**overrides))


def numpy_checkpoint(
    out: Path, cfg: dict[str, Any], drop: str = "", extra: str = "", bad: str = "", tied_head: bool = False
) -> None:
    """Write a Hugging Face directory with random float32 weights (numpy only)."""
    rng = np.random.default_rng(0)
    D, F, V, H = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], 16
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    for i in range(cfg["num_hidden_layers"]):
        b = f"model.layers.{i}."
        shapes |= {
            b + "input_layernorm.weight": (D,),
            b + "self_attn.q_proj.weight": (4 * H, D),
            b + "self_attn.k_proj.weight": (2 * H, D),
            b + "self_attn.v_proj.weight": (2 * H, D),
            b + "self_attn.o_proj.weight": (D, 4 * H),
            b + "post_attention_layernorm.weight": (D,),
            b + "mlp.gate_proj.weight": (F, D),
            b + "mlp.up_proj.weight": (F, D),
            b + "mlp.down_proj.weight": (D, F),
        }
    if extra:
        shapes[extra] = (V, D) if extra == "lm_head.weight" else (D,)
    if bad:
        shapes[bad] = (shapes[bad][0] + 1, *shapes[bad][1:])
    shapes.pop(drop, None)
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    if tied_head:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"drop": "model.layers.0.mlp.up_proj.weight"}, r"\['model\.layers\.0\.mlp\.up_proj\.weight'\] are missing"),
        (
            {"extra": "model.layers.0.self_attn.q_norm.weight"},
            r"unexpected .*'model\.layers\.0\.self_attn\.q_norm\.weight'",
        ),
        (
            {"bad": "model.layers.0.self_attn.k_proj.weight"},
            r"'model\.layers\.0\.self_attn\.k_proj\.weight' in model\.safetensors has shape \(33, 64\), expected \(32, 64\)",
        ),
        ({"extra": "lm_head.weight"}, r"'lm_head\.weight' differs from 'model\.embed_tokens\.weight'"),
    ],
)
def test_weight_errors_name_the_tensor(tmp_path: Path, kwargs: dict[str, str], message: str) -> None:
    numpy_checkpoint(tmp_path, hf_config(), **kwargs)
    with pytest.raises(WeightError, match=message):
        load_hf_llama(tmp_path)


def test_bfloat16_weights_and_ignored_buffers(tmp_path: Path) -> None:
    """bfloat16 tensors read through ml_dtypes; old checkpoints' rotary_emb.inv_freq buffers are skipped."""
    numpy_checkpoint(tmp_path, hf_config(), extra="model.layers.0.self_attn.rotary_emb.inv_freq")
    cfg = config_from_hf(hf_config())
    f32 = load_hf_params(tmp_path, cfg)
    from safetensors.numpy import load_file

    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    bf16 = load_hf_params(tmp_path, cfg)
    assert bf16["layers"]["wqkv"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(bf16["layers"]["wqkv"], f32["layers"]["wqkv"].astype(ml_dtypes.bfloat16))
    assert load_hf_params(tmp_path, cfg, np.float32)["embed"].dtype == np.float32


def test_tied_checkpoint_may_store_the_head_it_ties(tmp_path: Path) -> None:
    numpy_checkpoint(tmp_path, hf_config(), tied_head=True)
    cfg, params = load_hf_llama(tmp_path)
    assert cfg.tie_word_embeddings and "lm_head" not in params
