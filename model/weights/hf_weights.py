"""Read a Hugging Face causal-LM directory of a served family (``model.families``: Llama, Qwen2,
Qwen3) into (LlamaConfig, the param tree of ``model.llama.Llama``).

A directory as ``save_pretrained`` writes it: ``config.json``, the weights in ``model.safetensors``
or in several ``*.safetensors`` shards listed by ``model.safetensors.index.json``, and the
tokenizer files (read by ``model.text.tokenizer.Tokenizer.from_hf_dir``).

``config.json`` is mapped field by field (``config_from_hf``); its ``architectures`` pick the
family, and anything the family does not implement (Llama's attention or MLP biases, Qwen's
sliding window, an activation other than SiLU, partial rotary embeddings, a RoPE scaling other
than ``llama3``) is an error naming the field, never silently ignored.

Tensors are read with the ``safetensors`` package's numpy API (``ml_dtypes`` gives numpy its
``bfloat16``). Hugging Face stores every ``nn.Linear`` weight as [out, in] and Q/K rows already
in the rotate-half order ``model/llama.py`` uses, so a transpose and a reshape is all each
matrix needs (no RoPE unpermute, unlike GGUF). Every expected tensor must be present with its
exact shape, and every stored tensor must be used: a missing, unexpected or misshapen tensor
is a ``WeightError`` naming it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16" dtype, which safetensors' numpy API needs)
import numpy as np
from safetensors import safe_open

from model.config import LlamaConfig, RopeScaling
from model.families import FAMILIES, for_hf
from model.llama import fuse_projections
from model.weights.gguf_weights import WeightError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors dtypes a Llama checkpoint may use for its weights.
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
# Non-persistent buffers that older transformers versions wrote into checkpoints; not weights.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class HFConfigError(ValueError):
    """``config.json`` is missing, is not a served family's causal LM, or asks for something the
    family's implementation lacks."""


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a Hugging Face model directory.

    Raises:
        HFConfigError: the file is missing or is not a JSON object.
    """
    file = Path(path) / "config.json"
    if not file.is_file():
        raise HFConfigError(f"{file} not found: not a Hugging Face model directory")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise HFConfigError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise HFConfigError(f"{file} is not a JSON object")
    return data


def _layer_types(hf: dict[str, Any]) -> tuple[tuple[int, ...], int]:
    """(the local layers, the sliding window) from ``layer_types`` ("sliding_attention" /
    "full_attention" per layer) or, in older configs, ``sliding_window_pattern`` (every n-th
    layer global); ((), 0) when neither is there."""
    layers = int(hf.get("num_hidden_layers") or 0)
    types = hf.get("layer_types")
    if types is None and hf.get("sliding_window_pattern"):
        every = int(hf["sliding_window_pattern"])
        types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]
    if not types:
        return (), 0
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise HFConfigError(
            f"config.json: layer_types must list 'sliding_attention' or 'full_attention' for each of the "
            f"{layers} layers, got {types!r}"
        )
    local = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = int(hf.get("sliding_window") or 0)
    if local and window < 1:
        raise HFConfigError(f"config.json: sliding layers need a sliding_window >= 1, got {hf.get('sliding_window')!r}")
    return local, window


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None, float | None]:
    """(rope_theta, scaling, the local layers' rope_theta or None) from transformers 5's
    ``rope_parameters`` (per layer type for Gemma 3: "full_attention", "sliding_attention") or
    4's ``rope_scaling`` + ``rope_theta`` (+ ``rope_local_base_freq``)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    if not isinstance(params, dict):
        raise HFConfigError(f"config.json: {field} must be an object, got {params!r}")
    local_theta = hf.get("rope_local_base_freq")
    if params and all(isinstance(v, dict) for v in params.values()):
        if set(params) != {"full_attention", "sliding_attention"}:
            raise HFConfigError(f"config.json: per-layer-type {field} ({sorted(params)}) is not supported")
        local = params["sliding_attention"]
        if (local.get("rope_type") or "default") != "default":
            raise HFConfigError(
                f"config.json: {field}.sliding_attention.rope_type={local['rope_type']!r} is not supported"
            )
        local_theta = local.get("rope_theta", local_theta)
        theta, scaling, _ = _rope({**hf, field: params["full_attention"]})
        return theta, scaling, None if local_theta is None else float(local_theta)
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise HFConfigError(f"config.json: partial_rotary_factor={partial} is not supported (only 1.0)")
    kind = params.get("rope_type") or params.get("type") or "default"
    local_theta = None if local_theta is None else float(local_theta)
    if kind == "default":
        return theta, None, local_theta
    if kind != "llama3":
        raise HFConfigError(
            f"config.json: {field}.rope_type={kind!r} is not supported; supported: None/'default' and 'llama3'"
        )
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", hf["max_position_embeddings"])
            ),
        )
    except KeyError as exc:
        raise HFConfigError(f"config.json: {field} of type 'llama3' lacks {exc.args[0]!r}") from None
    return theta, scaling, local_theta


def config_from_hf(hf: dict[str, Any]) -> LlamaConfig:
    """Map a Hugging Face ``config.json`` (as a dict) of a served family onto :class:`LlamaConfig`.

    ``architectures`` must name a family of ``model.families`` (``LlamaForCausalLM``,
    ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``); the family sets ``architecture``,
    ``attention_bias`` and ``qk_norm``. Optional fields default as in transformers:
    ``num_key_value_heads`` = ``num_attention_heads``, ``head_dim`` = ``hidden_size //
    num_attention_heads``, ``tie_word_embeddings`` = False, ``rope_theta`` = 10000.

    Raises:
        HFConfigError: another architecture (the message lists the served ones), a missing
            required field, or a feature the family does not implement (the field named).
    """
    try:
        family = for_hf(hf.get("architectures") or [])
        family.check_hf(hf)
    except ValueError as exc:  # UnsupportedModelError is one
        raise HFConfigError(str(exc)) from None
    act = hf.get("hidden_act", "silu")
    if family.mlp_activation == "silu" and act != "silu":
        raise HFConfigError(f"config.json: hidden_act={act!r} is not supported (only 'silu')")

    def need(name: str) -> Any:
        if hf.get(name) is None:
            raise HFConfigError(f"config.json: required field {name!r} is missing")
        return hf[name]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    theta, scaling, local_theta = _rope(hf)
    local, window = _layer_types(hf) if family.gguf_global_every else ((), 0)
    query_scalar = hf.get("query_pre_attn_scalar") if family.name == "gemma3" else None
    return LlamaConfig(
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        rope_theta=theta,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(need("max_position_embeddings")),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
        sliding_window=window if local else 0,
        local_layers=local,
        rope_local_theta=family.rope_local_theta if local_theta is None else local_theta,
        query_pre_attn_scalar=float(query_scalar or 0),
        **family.config_fields(),
    )


def weight_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the ``.safetensors`` file holding it, from ``model.safetensors.index.json``
    when present, else from the single ``model.safetensors`` (or the directory's only
    ``*.safetensors`` file).

    Raises:
        WeightError: no weights, an index naming a missing shard, or several unindexed files.
    """
    root = Path(path)
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise WeightError(f"{index}: no 'weight_map'")
        out = {}
        for name, file in weight_map.items():
            shard = root / file
            if not shard.is_file():
                raise WeightError(f"{index}: tensor {name!r} is in {file}, which is missing")
            out[name] = shard
        return out
    files = [root / SINGLE_FILE] if (root / SINGLE_FILE).is_file() else sorted(root.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{root}: no *.safetensors weights")
    if len(files) > 1:
        raise WeightError(f"{root}: several *.safetensors files but no {INDEX_FILE}")
    with safe_open(files[0], framework="np") as f:
        return dict.fromkeys(f.keys(), files[0])


def _expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor name of a model with ``cfg`` (its family's), and its [out, in] shape."""
    D, N, K, H, F, V = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
    )
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    for i in range(cfg.num_layers):
        b = f"model.layers.{i}."
        shapes |= {
            b + "input_layernorm.weight": (D,),
            b + "self_attn.q_proj.weight": (N * H, D),
            b + "self_attn.k_proj.weight": (K * H, D),
            b + "self_attn.v_proj.weight": (K * H, D),
            b + "self_attn.o_proj.weight": (D, N * H),
            b + "post_attention_layernorm.weight": (D,),
            **(
                {b + "pre_feedforward_layernorm.weight": (D,), b + "post_feedforward_layernorm.weight": (D,)}
                if cfg.sandwich_norms
                else {}
            ),
            b + "mlp.gate_proj.weight": (F, D),
            b + "mlp.up_proj.weight": (F, D),
            b + "mlp.down_proj.weight": (D, F),
        }
        if cfg.attention_bias:
            shapes |= {b + "self_attn.q_proj.bias": (N * H,), b + "self_attn.k_proj.bias": (K * H,),
                       b + "self_attn.v_proj.bias": (K * H,)}  # fmt: skip
        if cfg.qk_norm:
            shapes |= {b + "self_attn.q_norm.weight": (H,), b + "self_attn.k_norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


class _SafetensorsReader:
    """Tensors by name across the shards, each file opened once, shape and dtype checked before reading."""

    def __init__(self, files: dict[str, Path]):
        self._files = files
        self._open: dict[Path, Any] = {}

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        file = self._files.get(name)
        if file is None:
            raise WeightError(f"safetensors tensor {name!r} is missing")
        if file not in self._open:
            self._open[file] = safe_open(file, framework="np")
        handle = self._open[file]
        info = handle.get_slice(name)
        stored = tuple(info.get_shape())
        if stored != shape:
            raise WeightError(f"safetensors tensor {name!r} in {file.name} has shape {stored}, expected {shape}")
        if info.get_dtype() not in _FLOAT_DTYPES:
            raise WeightError(
                f"safetensors tensor {name!r} in {file.name} has dtype {info.get_dtype()}; "
                f"supported: {sorted(_FLOAT_DTYPES)}"
            )
        return handle.get_tensor(name)


def load_hf_params(
    path: str | Path,
    cfg: LlamaConfig,
    dtype: Any = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Read every weight of a Hugging Face Llama directory into the nested dict of ``Llama``'s state.

    Args:
        path: the model directory.
        cfg: its config (``config_from_hf``).
        dtype: numpy dtype of the returned arrays; None keeps the stored dtype (the first
            weight's: float32, float16 or ml_dtypes.bfloat16).
        progress: called with each tensor's name after it is read (a progress bar's hook).

    Returns:
        The same tree as ``model.weights.gguf_weights.load_gguf_params``: ``{"embed": [V, D],
        "final_norm": [D], "layers": {"wqkv": [L, D, K, N/K + 2, H], ...}, "lm_head": [D, V] (untied
        only)}``.

    Raises:
        WeightError: a tensor is missing, unexpected, misshapen or not a float type (named).
    """
    files = weight_files(path)
    expected = _expected_shapes(cfg)
    reader = _SafetensorsReader(files)
    stored = {n for n in files if not n.endswith(_IGNORED_SUFFIXES)}
    unexpected = sorted(stored - set(expected))
    if cfg.tie_word_embeddings and "lm_head.weight" in unexpected:
        # Some tied checkpoints store the head anyway; accept it only when it is the embedding.
        head = reader.get("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
        if not np.array_equal(head, reader.get("model.embed_tokens.weight", head.shape)):
            raise WeightError(
                "safetensors tensor 'lm_head.weight' differs from 'model.embed_tokens.weight' "
                "but config.json says tie_word_embeddings=true"
            )
        unexpected.remove("lm_head.weight")
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise WeightError(
            f"unexpected safetensors tensor(s) {unexpected[:5]}{more} for a {cfg.num_layers}-layer {cfg.architecture}"
        )
    missing = sorted(set(expected) - stored)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightError(f"safetensors tensor(s) {missing[:5]}{more} are missing")

    L, D, N, K, H, F, _ = cfg.dims
    done = progress or (lambda _name: None)
    offset = FAMILIES[cfg.architecture].hf_norm_offset

    def get(name: str) -> np.ndarray:
        array = reader.get(name, expected[name])
        done(name)
        # A norm stored less its offset (Gemma's 1 + w), in float32 as transformers adds it.
        return array.astype(np.float32) + np.float32(offset) if offset and name.endswith("norm.weight") else array

    embed = get("model.embed_tokens.weight")
    out_dtype = np.dtype(dtype) if dtype is not None else embed.dtype
    # (HF name within a layer, our name, [L, ...] shape, how to lay one layer out [out, in] -> ours)
    per_layer: list[tuple[str, str, tuple[int, ...], Callable[[np.ndarray], np.ndarray]]] = [
        ("input_layernorm.weight", "attn_norm", (L, D), lambda w: w),
        ("self_attn.q_proj.weight", "wq", (L, D, N, H), lambda w: w.T.reshape(D, N, H)),
        ("self_attn.k_proj.weight", "wk", (L, D, K, H), lambda w: w.T.reshape(D, K, H)),
        ("self_attn.v_proj.weight", "wv", (L, D, K, H), lambda w: w.T.reshape(D, K, H)),
        ("self_attn.o_proj.weight", "wo", (L, N, H, D), lambda w: w.T.reshape(N, H, D)),
        ("mlp.gate_proj.weight", "w_gate", (L, D, F), lambda w: w.T),
        ("mlp.up_proj.weight", "w_up", (L, D, F), lambda w: w.T),
        ("mlp.down_proj.weight", "w_down", (L, F, D), lambda w: w.T),
    ]
    if cfg.sandwich_norms:  # Gemma's names: "post_attention" is after attention, not before the MLP
        per_layer += [
            ("post_attention_layernorm.weight", "post_attn_norm", (L, D), lambda w: w),
            ("pre_feedforward_layernorm.weight", "mlp_norm", (L, D), lambda w: w),
            ("post_feedforward_layernorm.weight", "post_mlp_norm", (L, D), lambda w: w),
        ]
    else:
        per_layer += [("post_attention_layernorm.weight", "mlp_norm", (L, D), lambda w: w)]
    if cfg.attention_bias:  # [out] laid out as the projection's outputs, fused like the weights
        per_layer += [
            ("self_attn.q_proj.bias", "bq", (L, N, H), lambda b: b.reshape(N, H)),
            ("self_attn.k_proj.bias", "bk", (L, K, H), lambda b: b.reshape(K, H)),
            ("self_attn.v_proj.bias", "bv", (L, K, H), lambda b: b.reshape(K, H)),
        ]
    if cfg.qk_norm:
        per_layer += [
            ("self_attn.q_norm.weight", "q_norm", (L, H), lambda w: w),
            ("self_attn.k_norm.weight", "k_norm", (L, H), lambda w: w),
        ]
    # Filled in place, layer by layer, so peak memory is about one copy of the weights (plus a
    # second copy of the projections while fuse_projections joins Q/K/V and gate/up).
    layers = {ours: np.empty(shape, out_dtype) for _, ours, shape, _ in per_layer}
    for i in range(L):
        for hf_name, ours, _, layout in per_layer:
            layers[ours][i] = layout(get(f"model.layers.{i}.{hf_name}"))
    params: dict[str, Any] = {
        "embed": embed.astype(out_dtype, copy=False),
        "final_norm": get("model.norm.weight").astype(out_dtype, copy=False),
        "layers": fuse_projections(layers, K),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = np.ascontiguousarray(get("lm_head.weight").T).astype(out_dtype, copy=False)
    return params


def num_tensors(cfg: LlamaConfig) -> int:
    """How many tensors ``load_hf_params`` reads for ``cfg`` (for a progress bar)."""
    return len(_expected_shapes(cfg))


def load_hf_llama(
    path: str | Path, dtype: Any = None, progress: Callable[[str], None] | None = None
) -> tuple[LlamaConfig, dict[str, Any]]:
    """Config and weights of a Hugging Face directory of a served family (``config_from_hf``).

    Returns:
        (config, param dict as ``load_hf_params`` returns).

    Raises:
        HFConfigError: see ``config_from_hf``. WeightError: see ``load_hf_params``.
    """
    cfg = config_from_hf(read_hf_config(path))
    return cfg, load_hf_params(path, cfg, dtype, progress)
