"""The model's matmuls and embedding lookups by weight form: a weight's own form says which
kernel reads it, so the forward pass (``model.llama``) has no platform branches.

* an input-major array: XLA's einsum (every backend);
* ``cpu_matmul.Panels``: float32 weights packed into column panels, the native CPU kernel
  (``model.native.cpu_matmul``; the engine packs them on one CPU device, ``model.kernels``);
* ``QuantPanels``: GGUF blocks as stored, multiplied at exactly their dequantized values by
  their ``kernel``: "native" (``model.native.quant_matmul``) or "xla" (dequantize, then dot).

Packed weights of a stack of layers carry their layer index (``layer``) instead of being sliced:
``split_stacked`` and ``with_stacked`` pass them through a ``lax.scan`` whole.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from model.native import cpu_matmul, quant_matmul
from model.weights import quant_panels
from model.weights.quant_panels import QuantPanels

Packed = QuantPanels | cpu_matmul.Panels  # weights a native kernel reads in place at a layer index


def matmul(x: jax.Array, w: jax.Array | Packed, equation: str) -> jax.Array:
    """x [..., in] times a weight, float32 out.

    An input-major array: ``jnp.einsum(equation, x, w)``. A packed weight (``Panels``,
    ``QuantPanels``; ``equation`` unused) gives [..., *w.out_shape], x's last axis being the
    weight's K: ``Panels`` through ``cpu_matmul.matmul``; ``QuantPanels`` through its
    ``kernel``, the native one of ``model.native.quant_matmul`` (set only where it is built,
    ``model.kernels``) or XLA's dequantize-then-dot.
    """
    if isinstance(w, cpu_matmul.Panels | QuantPanels):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if isinstance(w, cpu_matmul.Panels):
            y = cpu_matmul.matmul(x2, w)
        elif w.kernel == "native":
            y = quant_matmul.matmul(x2, w)
        else:
            y = quant_panels.xla_matmul(x2, w)
        return y.reshape(*lead, *w.out_shape)
    return jnp.einsum(equation, x, w, preferred_element_type=jnp.float32)


def embedding_rows(table: jax.Array | QuantPanels, tokens: jax.Array) -> jax.Array:
    """The rows of ``tokens`` [...] int32 of an embedding table: [..., D] float32. A table [V, D]
    as floats is indexed; one kept as stored GGUF blocks (``QuantPanels`` of the transposed
    table [D, V]) is dequantized row by row, to exactly the float values."""
    if isinstance(table, QuantPanels):
        return quant_panels.dequantize_rows(table, tokens)
    return jnp.take(table, tokens, axis=0).astype(jnp.float32)


def split_stacked(weights: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Packed]]:
    """A scanned layer loop's weights as (the arrays ``lax.scan`` slices per layer, the packed
    stacks it must not slice: stored blocks, float32 panels): XLA:CPU copies each iteration's
    slice of a stacked operand before a custom call reads it, so those go in whole, with the
    layer index (``with_stacked``)."""
    stacked = {k: v for k, v in weights.items() if isinstance(v, Packed)}
    return {k: v for k, v in weights.items() if k not in stacked}, stacked


def with_stacked(p: dict[str, Any], stacked: dict[str, Packed], layer: jax.Array) -> dict[str, Any]:
    """One layer's weights: ``p`` (sliced) and the packed stacks standing for ``layer``."""
    return {**p, **{k: dataclasses.replace(v, layer=layer) for k, v in stacked.items()}}


def has_packed(state: nnx.State, kind: type = QuantPanels) -> bool:
    """Whether any parameter of ``state`` is held packed as ``kind`` (default: GGUF blocks kept
    as stored)."""
    return any(isinstance(v, kind) for v in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, Packed)))
