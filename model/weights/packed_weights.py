"""Float32 matmul weights packed into panels for the native CPU kernel (``model.native.cpu_matmul``)
as a form of the parameters, in place of the input-major arrays: ``pack_panels`` and its
inverse ``unpack_panels``. Which form an engine holds is its kernels' choice (``model.kernels``).

Weights held as GGUF blocks as stored (``QuantPanels``) have a kernel of their own and are never
packed, nor are weights the kernel does not take (``cpu_matmul.supports``: not float32, or
outputs not whole 32-column panels).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
from flax import nnx

from model.config import LlamaConfig
from model.native import cpu_matmul
from model.weights.quant_panels import QuantPanels

if TYPE_CHECKING:
    from model.llama import Llama

PANEL_IN_DIMS = {"wqkv": 1, "wo": 2, "w_gate_up": 1, "w_down": 1}  # leading axes contracted (after L)
HEAD_AXES = ("embed", "vocab")


def pack_panels(model: Llama) -> list[str]:
    """Pack ``model``'s float32 matmul weights into panels, in place: the stacked layer weights
    [L, ...] become stacked ``Panels`` [L, N/32, K, 32] (``cpu_matmul.pack_stacked``), and the LM
    head [D, V] one ``Panels``. A tied model keeps its embedding table for the lookups and gains
    a packed head, ``lm_head``, of the table transposed (the one extra copy this form holds).
    Weights already packed, stored blocks and what the kernel does not take are left as they
    are. Returns the names packed.
    """
    assert not model.layers.per_layer(), "panels pack the stacked form"
    packed = []
    for name, in_dims in PANEL_IN_DIMS.items():
        param = getattr(model.layers, name)
        w = param.get_value()
        if _packable(w, in_dims, lead=1):
            param.set_value(cpu_matmul.pack_stacked(w, in_dims))
            packed.append(name)
    if model.cfg.tie_word_embeddings:
        table = model.embed.get_value()
        if not hasattr(model, "lm_head") and not isinstance(table, QuantPanels) and _packable(table.T, 1, lead=0):
            model.lm_head = nnx.Param(cpu_matmul.pack(table.T, 1), logical_axes=HEAD_AXES)
            packed.append("lm_head")
    else:
        head = model.lm_head.get_value()
        if _packable(head, 1, lead=0):
            model.lm_head.set_value(cpu_matmul.pack(head, 1))
            packed.append("lm_head")
    return packed


def unpack_panels(model: Llama) -> None:
    """``pack_panels``' inverse, in place: every ``Panels`` parameter becomes its input-major
    float32 array again (exactly), and a tied model's packed head is dropped."""
    for name in PANEL_IN_DIMS:
        param = getattr(model.layers, name)
        if isinstance(param.get_value(), cpu_matmul.Panels):
            param.set_value(cpu_matmul.unpack(param.get_value()))
    if hasattr(model, "lm_head") and isinstance(model.lm_head.get_value(), cpu_matmul.Panels):
        if model.cfg.tie_word_embeddings:
            del model.lm_head
        else:
            model.lm_head.set_value(cpu_matmul.unpack(model.lm_head.get_value()))


def _packable(w: Any, in_dims: int, lead: int) -> bool:
    """Whether the float32 kernel takes ``w`` (a stack's leading axes ``lead`` left out)."""
    if isinstance(w, QuantPanels | cpu_matmul.Panels):
        return False
    shape = w.shape[lead:]
    return cpu_matmul.supports(math.prod(shape[in_dims:]), w.dtype)


def packed_head_bytes(cfg: LlamaConfig, formats: Mapping[str, str], panels: bool) -> int:
    """Bytes ``pack_panels`` adds beside a model's parameters: a tied model's packed head
    (V x D float32) when its weights are packed (``panels``), its table is a float array (not
    held as blocks: ``formats`` names the parameters held so) and the kernel takes it (V whole
    panels); else 0. For predicting a runner's memory before it is built (a live layout
    switch)."""
    if not panels or not cfg.tie_word_embeddings or "embed" in formats:
        return 0
    if not cpu_matmul.supports(cfg.vocab_size, jnp.float32):
        return 0
    return 4 * cfg.vocab_size * cfg.hidden_size
