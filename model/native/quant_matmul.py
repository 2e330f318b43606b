"""x @ W over GGUF-quantized weights kept as stored (``QuantPanels``: Q8_0, Q4_0, Q4_1), as a
native XLA:CPU custom call that dequantizes on the fly (``native/quant_matmul.cc``).

A decode step's matmuls stream their weights from memory; Q4_1 panels hold 0.625 bytes per
weight and Q8_0 1.0625, against float32 panels' 4, so the kernel reads several times fewer
bytes than ``model.native.cpu_matmul`` over the dequantized weights, and than XLA's float32 dot
after ``quant_panels.dequantize`` (``quant_panels.xla_matmul``, which also writes and reads the
dequantized matrix). For few rows the kernel applies each block's scale to the block's
partial sums (the "direct" path); for more rows it dequantizes each panel once into a float32
scratch panel and reuses the float32 register-tile micro-kernel over every row (the
"dequantized" path). ``faster_than_xla`` states where the kernel was measured to win (the
engine does not consult it per shape: it runs the kernel wherever it is built);
docs/cpu-kernels.md has the measurements (``benchmarks/quant_matmul.py``).

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
            [L, P, Kb, B, 32] (stacked, ``layer`` given), scales (and Q4_1's mins) float16.
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
        codes, scales = codes[None], scales[None]  # L = 1: a reshape, no copy
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
    operands = [x.astype(jnp.float32), codes, scales, *([] if mins is None else [mins])]
    y = call(*operands, jnp.asarray(layer, jnp.int32), path=PATHS[path])
    return y.reshape(m, *w.out_shape)


def faster_than_xla(rows: int, fmt: str) -> bool:
    """Whether the kernel, as built here (``native.isa()``), was measured faster than
    ``quant_panels.xla_matmul`` (XLA's dequantization, then its float32 dot) for ``rows`` rows
    of ``fmt`` weights (docs/cpu-kernels.md, ``benchmarks/quant_matmul.py``).

    The rule: an AVX2 or AVX-512 build from 1 to 64 rows, any format (beyond that XLA's dot
    amortises its dequantization over the rows); an "other" (SSE2) build never (correct, not
    measured). AVX-512 builds are assumed to follow AVX2's (same code, wider vectors and tiles).
    The figures behind it are in docs/cpu-kernels.md.

    Against ``model.native.cpu_matmul`` on the same weights dequantized into float32 panels (4 bytes
    a weight instead of 0.625-1.06, and a float32 copy held): see ``faster_than_panels``.

    Raises:
        ValueError: ``fmt`` is not one of ``quant_panels.FORMATS``.
        RuntimeError: the compiler could not be asked for the target's ISA.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown block format {fmt!r}: expected one of {', '.join(FORMATS)}")
    return native.isa() != "other" and 1 <= rows <= 64


def faster_than_panels(rows: int, fmt: str) -> bool:
    """Whether the kernel was measured faster than ``model.native.cpu_matmul`` on float32 panels of the
    same weights dequantized (docs/cpu-kernels.md), as built here.

    The rule: an AVX2 or AVX-512 build at 1 row, where the weights' bytes bound the matmul
    (4 bytes a weight in float32 panels against 0.625 for Q4_1, 1.06 for Q8_0); otherwise not:
    from 8 rows the matmuls are bound by arithmetic and widening the codes costs what the bytes
    save (docs/cpu-kernels.md). What the kernel always saves is memory: no float32 copy.

    Raises:
        ValueError: ``fmt`` is not one of ``quant_panels.FORMATS``.
        RuntimeError: the compiler could not be asked for the target's ISA.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown block format {fmt!r}: expected one of {', '.join(FORMATS)}")
    return native.isa() != "other" and rows == 1


available = native.available  # whether the kernels are built and registered
