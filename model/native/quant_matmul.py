"""x @ W over GGUF-quantized weights kept as stored (``QuantPanels``: Q8_0, Q4_0, Q4_1, and the
record formats Q5_0, Q4_K, Q5_K, Q6_K), as a
native XLA:CPU custom call that dequantizes on the fly (``native/quant_matmul.cc``).

A decode step's matmuls stream their weights from memory; Q4_1 panels hold 0.625 bytes per
weight and Q8_0 1.0625, against float32 panels' 4, so the kernel reads several times fewer
bytes than ``model.native.cpu_matmul`` over the dequantized weights, and than XLA's float32 dot
after ``quant_panels.dequantize`` (``quant_panels.xla_matmul``, which also writes and reads the
dequantized matrix). For few rows the kernel applies each block's scale to the block's
partial sums (the "direct" path); for more rows it dequantizes each panel once into a float32
scratch panel and reuses the float32 register-tile micro-kernel over every row (the
"dequantized" path). The engine runs the kernel wherever it is built;
docs/cpu-kernels.md has where it was measured to win (``benchmarks/quant_matmul.py``).

Stacked weights (``lead`` (L,), the scanned model's layers) are read in place: ``layer``, a
traced int32 scalar, is an operand of the call and the kernel offsets into the buffers, so no
dynamic slice of the stack is materialised inside ``lax.scan``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model import native
from model.weights.quant_panels import BLOCK, FORMATS, QuantPanels

PATHS = {"auto": 0, "direct": 1, "dequantized": 2}  # the kernel's ``path`` attribute


def matmul(x: jax.Array, w: QuantPanels, layer: jax.Array | int | None = None, *, path: str = "auto") -> jax.Array:
    """x @ W by the native kernel of ``w.format`` (call ``available()`` first).

    Args:
        x: [M, K] (cast to float32).
        w: ``QuantPanels`` of W [K, N]: codes [P, Kb, B, 32] (one matrix, ``layer`` None) or
            [L, P, Kb, B, 32] (stacked, ``layer`` given), scales (and Q4_1's mins) float16; or
            a record format's records [(L,) P, Ku, R, 32] uint8 alone.
        layer: None for one matrix; for stacked panels an int32 scalar in [0, L), which may be
            traced (under jit or in a ``lax.scan`` body): matrix ``layer`` of the stack, read in
            place. None takes ``w.layer`` (``model.kernels.with_stacked`` sets it).
        path: "auto" (the kernel picks by M), or "direct" / "dequantized" to force one of its
            two ways through a panel (tests and benchmarks; both give the same values up to
            float32 rounding).

    Returns:
        [M, *w.out_shape] float32.

    Raises:
        ValueError (at trace time): unknown format or path, codes of the wrong rank, ``layer``
            given for one matrix or missing for a stack, x not 2-D.
        XlaRuntimeError (at run time, never a crash): x's K differs from the weights' K, the
            arrays' shapes disagree, or ``layer`` is outside [0, L).
    """
    if w.format not in FORMATS:
        raise ValueError(f"unknown block format {w.format!r}: expected one of {', '.join(FORMATS)}")
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r}: expected one of {', '.join(PATHS)}")
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x.shape}")
    codes, scales, mins = w.codes, w.scales, w.mins
    layer = w.layer if layer is None else layer
    if codes.ndim == 4:
        if layer is not None:
            raise ValueError("layer is for stacked QuantPanels (codes [L, P, Kb, B, 32]); these hold one matrix")
        codes = codes[None]  # L = 1: a reshape, no copy
        scales = None if scales is None else scales[None]
        mins = None if mins is None else mins[None]
        layer = 0
    elif codes.ndim == 5:
        if layer is None:
            raise ValueError(f"stacked QuantPanels ({codes.shape[0]} matrices) need a layer index")
    else:
        raise ValueError(f"codes must be [P, Kb, B, 32] or [L, P, Kb, B, 32], got shape {codes.shape}")
    m = x.shape[0]
    n = codes.shape[1] * BLOCK
    call = jax.ffi.ffi_call(native.QUANT_MATMUL[w.format], jax.ShapeDtypeStruct((m, n), jnp.float32))
    operands = [x.astype(jnp.float32), codes, *(a for a in (scales, mins) if a is not None)]
    y = call(*operands, jnp.asarray(layer, jnp.int32), path=PATHS[path])
    return y.reshape(m, *w.out_shape)


available = native.available  # whether the kernels are built and registered
