"""The model's matmul weights packed a second time for the native CPU kernels
(``model.cpu_matmul``): what an engine packs is its choice of matmul kernel (``model.kernels``).

Both functions read a ``model.llama.Llama``'s parameters by name; weights held as GGUF blocks as
stored (``QuantPanels``) have a kernel of their own and are never packed.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from model import cpu_matmul
from model.quant_panels import QuantPanels

if TYPE_CHECKING:
    from model.llama import Llama

PANEL_IN_DIMS = {"wqkv": 1, "wo": 2, "w_gate_up": 1, "w_down": 1}  # leading axes contracted


def panel_weights(model: Llama, lm_head: bool = True, format: str = "f32") -> dict[str, Any]:
    """The layer and LM-head matmul weights packed for a native kernel (``model.cpu_matmul``).

    Args:
        model: a Llama in the per-layer form (``unstack_layers``) with float32 weights.
        lm_head: pack the LM head too (only ``decode_step`` reads it).
        format: "f32" (float32 panels, ``cpu_matmul.pack``) or "bf16x3" (AMX bf16x3,
            ``cpu_matmul.pack_bf16x3``).

    Returns:
        {"wqkv", "wo", "w_gate_up", "w_down": tuples of L ``Panels``, "lm_head": one ``Panels``
        of the LM head [D, V] (the tied embedding transposed, or ``lm_head``), if asked}: a second copy
        of those weights, for ``prefill(panels=...)`` (which uses the layers') and
        ``decode_step(panels=...)``.

    Raises:
        ValueError: a weight's output width (for bf16x3, or its input width) is not a multiple
            of 32, or it is not float32.
    """
    assert model.layers.per_layer(), "panel_weights needs unstack_layers' per-layer form"
    pack = {"f32": cpu_matmul.pack, "bf16x3": cpu_matmul.pack_bf16x3}[format]
    weights = model.layers.weights()
    out: dict[str, Any] = {
        name: tuple(pack(w, in_dims) for w in weights[name])
        for name, in_dims in PANEL_IN_DIMS.items()
        if not isinstance(weights[name][0], QuantPanels)  # stored blocks have a kernel of their own
    }
    head = (model.embed if model.cfg.tie_word_embeddings else model.lm_head).get_value()
    if lm_head and not isinstance(head, QuantPanels):
        out["lm_head"] = pack(head.T if model.cfg.tie_word_embeddings else head, 1)
    return out


def stacked_panel_weights(model: Llama, lm_head: bool = True) -> dict[str, Any]:
    """The stacked layer weights (and the LM head) packed for the native float32 kernel, for
    ``ragged_step(panels=...)``: {"wqkv", "wo", "w_gate_up", "w_down": ``Panels`` of the L
    matrices [L, N/32, K, 32] (``cpu_matmul.pack_stacked``), "lm_head": ``Panels`` of the LM
    head [D, V], if asked}. A second copy of those weights. Left out (multiplied as before):
    weights held as stored blocks (they have a kernel of their own) and ones the kernel does not
    take (``cpu_matmul.supports``: not float32, or outputs not whole 32-column panels).
    """
    assert not model.layers.per_layer(), "stacked_panel_weights packs the stacked form"
    out: dict[str, Any] = {
        name: cpu_matmul.pack(w, in_dims) if name == "lm_head" else cpu_matmul.pack_stacked(w, in_dims)
        for name, (w, in_dims) in _packable(model, lm_head).items()
    }
    return out


def packed_bytes(model: Llama, lm_head: bool = True) -> int:
    """Bytes a float32 packed copy of ``model``'s matmul weights takes (what
    ``stacked_panel_weights`` or ``panel_weights`` would add), without packing: the weights the
    float32 kernel takes, 4 bytes each (panels hold every weight once, no padding: their output
    widths are whole panels). For predicting an engine's memory before it is built (a live
    layout switch). Either form, stacked or per layer."""
    total = 0
    for w, _ in _packable(model, lm_head).values():
        total += sum(4 * math.prod(x.shape) for x in (w if isinstance(w, tuple) else (w,)))
    return total


def _packable(model: Llama, lm_head: bool) -> dict[str, tuple[Any, int]]:
    """{name: (weight, contracted leading axes)} of the matmul weights the float32 kernel takes:
    the layer weights (stacked [L, ...] or a tuple per layer) and the LM head [D, V] (the tied
    embedding transposed), if asked. Stored blocks and what ``cpu_matmul.supports`` refuses are
    left out."""

    def packable(w: Any, in_dims: int, lead: int) -> bool:  # lead: a stack's leading L axis
        if isinstance(w, QuantPanels):
            return False
        shape = w.shape[lead:]
        return cpu_matmul.supports(math.prod(shape[in_dims:]), w.dtype, math.prod(shape[:in_dims]))

    out: dict[str, tuple[Any, int]] = {}
    for name, w in model.layers.weights().items():
        in_dims = PANEL_IN_DIMS.get(name)
        per_layer = isinstance(w, tuple)
        if in_dims is not None and packable(w[0] if per_layer else w, in_dims, lead=0 if per_layer else 1):
            out[name] = (w, in_dims)
    head = (model.embed if model.cfg.tie_word_embeddings else model.lm_head).get_value()
    head = head.T if model.cfg.tie_word_embeddings and not isinstance(head, QuantPanels) else head
    if lm_head and packable(head, 1, lead=0):
        out["lm_head"] = (head, 1)
    return out
