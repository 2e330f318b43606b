"""A model's matmul weights held as 32-weight blocks in its param tree: weight-only int8 for float
checkpoints (each matmul weight quantized to GGUF's Q8_0 blocks), the blocks back to floats, and
the blocks' array shapes for a checkpoint's abstract restore target.

Q8_0 is symmetric int8 with one float16 scale per 32 consecutive input weights of one output
(ggml-org/ggml ``src/ggml-quants.c``, ``quantize_row_q8_0_ref``: d = max|w| / 127 over the
block, q = round(w / d)); ``gguf.quants.quantize`` computes it bit for bit as ggml does, and
the result is held as ``model.weights.quant_panels.QuantPanels``, so the weights quantized here are
multiplied by the same kernels as a GGUF's Q8_0 tensors (``model.native.quant_matmul`` on one CPU
device, ``quant_panels.xla_matmul`` elsewhere), at exactly their dequantized values. 34 bytes
per 32 weights: 0.27x float32's.

Why per 32-weight blocks and not one scale per output channel: on SmolLM2-135M's weights the
blocks' relative error is several times smaller (``benchmarks/int8_error.py`` prints both; the
figures are in docs/performance.md, "int8 weights"), and they cost 2 bytes of scale per 32
weights (6 %).

A parameter's float layout ([*lead, *in, *out], ``model.llama``'s state) maps to the blocks'
[K, N] with K = prod(in) contracted and N = prod(out) outputs; ``INPUT_AXES`` says how many
axes after the layer axis are inputs. The embedding table [V, D] is held as its transpose
[D, V] (rows of the table are the blocks' outputs), as ``model.weights.gguf_weights`` holds a GGUF's.
"""

from __future__ import annotations

import math
from typing import Any

import gguf
import jax
import numpy as np

from model.weights import quant_panels
from model.weights.quant_panels import BLOCK, QuantPanels
from model.weights.record_panels import RECORD_FORMATS

# Per stacked layer parameter: how many of its axes (after the layer axis) are inputs.
INPUT_AXES = {"wqkv": 1, "wo": 2, "w_gate_up": 1, "w_down": 1}
TABLES = ("embed", "lm_head")  # embed [V, D] (a table of rows), lm_head [D, V] (a matmul weight)


def quantize_matrix(w: np.ndarray, in_axes: int) -> QuantPanels | None:
    """One float weight [*in, *out] as Q8_0 ``QuantPanels`` (``out_shape`` = out, K = prod(in)),
    or None when K or N is not a multiple of 32 (the weight then stays float).

    Args:
        w: float array (any float dtype; quantized from its float32 values).
        in_axes: how many leading axes are inputs.
    """
    k, n = math.prod(w.shape[:in_axes]), math.prod(w.shape[in_axes:])
    if k % BLOCK or n % BLOCK:
        return None
    rows = np.ascontiguousarray(np.asarray(w, np.float32).reshape(k, n).T)  # [N, K], one output per row
    raw = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0)  # [N, K/32 * 34] uint8
    return quant_panels.pack_rows(raw, "q8_0", k, tuple(int(d) for d in w.shape[in_axes:]))


def quantize_params(params: dict[str, Any]) -> dict[str, Any]:
    """A model's pure param dict with its float matmul weights as Q8_0 ``QuantPanels``.

    Args:
        params: ``{"embed": [V, D], "final_norm": [D], "layers": {...}, "lm_head": [D, V]?}``
            (stacked layers [L, ...], host numpy or jax arrays), as the format readers return
            it; weights already held as blocks (a GGUF's, as stored) are kept as they are.

    Returns:
        The same tree with "wqkv", "wo", "w_gate_up", "w_down" (stacked [L] panels), "embed"
        (held transposed) and "lm_head" quantized where their widths are whole 32-blocks; the
        norms and any other weight unchanged.
    """
    out = dict(params)
    layers = dict(params["layers"])
    for name, in_axes in INPUT_AXES.items():
        w = layers.get(name)
        if w is None or isinstance(w, QuantPanels):
            continue
        w = np.asarray(w)
        per_layer = [quantize_matrix(w[i], in_axes) for i in range(w.shape[0])]
        if all(q is not None for q in per_layer):
            layers[name] = quant_panels.stack([q for q in per_layer if q is not None])
    out["layers"] = layers
    for name in TABLES:
        w = params.get(name)
        if w is None or isinstance(w, QuantPanels):
            continue
        w = np.asarray(w)
        q = quantize_matrix(w.T if name == "embed" else w, 1)
        if q is not None:
            out[name] = q
    return out


def layout(path: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    """Where parameter ``path`` ("layers/wqkv", "embed", ...) of float ``shape`` puts its blocks:
    (lead axes, K, out_shape) of its ``QuantPanels``.

    Raises:
        ValueError: ``path`` is not a matmul weight that can be held as blocks.
    """
    name = path.rsplit("/", 1)[-1]
    if path == "embed":  # [V, D], held as W = table.T [D, V]
        return (), int(shape[1]), (int(shape[0]),)
    if path == "lm_head":  # [D, V]
        return (), int(shape[0]), (int(shape[1]),)
    if path.startswith("layers/") and name in INPUT_AXES:
        n_in = INPUT_AXES[name]
        return (int(shape[0]),), math.prod(shape[1 : 1 + n_in]), tuple(int(d) for d in shape[1 + n_in :])
    raise ValueError(f"parameter {path!r} is not a matmul weight held as blocks")


def abstract_panels(path: str, shape: tuple[int, ...], fmt: str) -> QuantPanels:
    """``QuantPanels`` of ``jax.ShapeDtypeStruct`` that parameter ``path`` of float ``shape``
    holds in block format ``fmt`` (``model.weights.quant_panels`` module docstring: codes
    [*lead, N/32, K/32, B, 32], scales and Q4_1's mins [*lead, N/32, K/32, 32] float16; a record
    format's records [*lead, N/32, K/unit, R, 32] uint8 alone).

    Raises:
        ValueError: see ``layout``; ``fmt`` is unknown, or K or N is not whole 32-blocks.
    """
    if fmt not in quant_panels.FORMATS:
        raise ValueError(f"{path}: unknown block format {fmt!r}: expected one of {', '.join(quant_panels.FORMATS)}")
    lead, k, out_shape = layout(path, shape)
    n = math.prod(out_shape)
    if k % BLOCK or n % BLOCK:
        raise ValueError(f"{path}: [{k}, {n}] is not whole blocks of {BLOCK}")
    if fmt in RECORD_FORMATS:  # one uint8 record per unit and 32 columns
        spec = RECORD_FORMATS[fmt]
        if k % spec.unit:
            raise ValueError(f"{path}: {k} inputs are not whole {fmt} blocks of {spec.unit}")
        codes = jax.ShapeDtypeStruct((*lead, n // BLOCK, k // spec.unit, spec.rows, BLOCK), np.uint8)
        return QuantPanels(codes, None, None, out_shape, fmt)
    p, kb = n // BLOCK, k // BLOCK
    codes = jax.ShapeDtypeStruct(
        (*lead, p, kb, 32 if fmt == "q8_0" else 16, BLOCK), np.int8 if fmt == "q8_0" else np.uint8
    )
    scales = jax.ShapeDtypeStruct((*lead, p, kb, BLOCK), np.float16)
    return QuantPanels(codes, scales, scales if fmt == "q4_1" else None, out_shape, fmt)


def dequantize_params(params: dict[str, Any], shapes: dict[str, tuple[int, ...]], dtype: Any) -> dict[str, Any]:
    """The inverse layout of ``quantize_params`` (and of a GGUF's stored blocks): every
    ``QuantPanels`` as the float array ``model.llama`` holds, host numpy of ``dtype``.

    Args:
        params: a pure param dict, some leaves ``QuantPanels`` (host or device arrays).
        shapes: each parameter's float shape by path ("layers/wqkv": [L, D, K, C, H], "embed":
            [V, D]), as ``model.weights.checkpoint.expected_shapes`` gives it.
        dtype: the float arrays' dtype.

    Raises:
        ValueError: a ``QuantPanels`` whose values do not fill its parameter's shape.
    """

    def convert(path: str, value: Any) -> Any:
        if not isinstance(value, QuantPanels):
            return value
        w = np.asarray(jax.device_get(quant_panels.dequantize(value)))  # [*lead, K, N] float32
        shape = shapes[path]
        if path == "embed":
            w = np.swapaxes(w, -1, -2)  # held as [D, V]
        if w.size != math.prod(shape):
            raise ValueError(f"{path}: blocks of {w.shape} values cannot be the parameter's shape {shape}")
        return w.reshape(shape).astype(dtype)

    return walk_params(params, convert)


def block_formats(params: dict[str, Any]) -> dict[str, str]:
    """The parameters of a pure param dict held as blocks, by path ("layers/wqkv") -> format."""
    found: dict[str, str] = {}

    def note(path: str, value: Any) -> Any:
        if isinstance(value, QuantPanels):
            found[path] = value.format
        return value

    walk_params(params, note)
    return found


def walk_params(params: dict[str, Any], fn: Any) -> dict[str, Any]:
    """``params`` with each leaf (a ``QuantPanels`` counts as one) replaced by ``fn(path, leaf)``;
    paths join the nested keys with "/"."""

    def walk(tree: dict[str, Any], prefix: str) -> dict[str, Any]:
        return {k: walk(v, f"{prefix}{k}/") if isinstance(v, dict) else fn(f"{prefix}{k}", v) for k, v in tree.items()}

    return walk(params, "")
