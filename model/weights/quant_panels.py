"""GGUF's quantized matmul weights kept as stored, re-laid out once in column panels: the
32-weight blocks (Q8_0, Q4_0, Q4_1) here, the K-quants and Q5_0 as byte records
(``model.weights.record_panels``).

A weight matrix W [K, N] (x @ W: K contracted, N outputs) comes from a GGUF tensor stored as N
rows of K weights, each row cut into K/32 blocks of 32 consecutive weights with one float16
scale ``d`` (and, for Q4_1, one float16 minimum ``m``) per block (ggml-org/ggml
``src/ggml-quants.c``; ``gguf.quants`` reads the same bytes). The value of weight k of a block
with code q is, as ``gguf.quants.dequantize`` computes it in float32:

    Q8_0: d * q          q int8 in [-128, 127]
    Q4_0: d * (q - 8)    q in [0, 15]
    Q4_1: d * q + m      q in [0, 15]

d * q is exact in float32 (an 11-bit significand times at most 8 bits), so every format's
value has at most one rounding (Q4_1's addition), and an FMA computes it bit for bit.

``QuantPanels`` holds the same codes and scales regrouped by 32 output columns, the layout of
the float32 panels of ``model.native.cpu_matmul`` (one contiguous stream per panel), so a native
kernel streams 32 columns' blocks together and XLA's dequantization is a reshape:

    codes  [*lead, P, Kb, B, 32]  P = N/32 panels, Kb = K/32 blocks; column c of panel p is
                                  output 32p + c. Q8_0: int8, B = 32, codes[.., p, b, j, c] is
                                  weight k = 32b + j. Q4_*: uint8, B = 16, byte j holds weight
                                  32b + j in its low nibble and 32b + j + 16 in its high one
                                  (GGUF's own pairing within a block).
    scales [*lead, P, Kb, 32]     float16 d of column c's block b.
    mins   [*lead, P, Kb, 32]     float16 m (Q4_1 only; None otherwise).

``lead`` is empty for one matrix or (L,) for the stacked layers of the scanned model. The bytes
equal the GGUF tensor's: Q4_1 20 per 32 weights, Q4_0 18, Q8_0 34.

The record formats (Q5_0, Q4_K, Q5_K, Q6_K) hold everything in the codes, [*lead, P, Ku, R, 32]
uint8 (``record_panels`` module docstring), with no scales or mins arrays.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from model.weights import record_panels
from model.weights.record_panels import RECORD_FORMATS

BLOCK = 32  # weights per GGUF block, and columns per panel
BLOCK_FORMATS = ("q8_0", "q4_0", "q4_1")  # codes, scales (and mins) arrays
FORMATS = (*BLOCK_FORMATS, *RECORD_FORMATS)  # every format held as stored
GGML_TYPES = {"q8_0": 8, "q4_0": 2, "q4_1": 3} | {f.name: f.ggml_type for f in RECORD_FORMATS.values()}
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}  # bytes of one stored block


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantPanels:
    """A quantized weight W [K, N] in column panels (module docstring). ``format``,
    ``out_shape`` (the shape the N outputs take in the model, e.g. (K, G + 2, H) for the fused
    QKV projection) and ``kernel`` are static. ``kernel`` is who multiplies by it: "xla"
    (``xla_matmul``, any backend) or "native" (``model.native.quant_matmul``, one CPU device), set by
    the engine (``model.kernels.choose_quant_kernel``). ``layer``: None, or an int32 scalar (may
    be traced) selecting matrix ``layer`` of stacked panels (lead (L,)) without slicing them:
    the scanned model's layer loop passes the whole stack and its index, and the native kernel
    reads that matrix in place (``model.kernels.with_stacked`` sets it)."""

    codes: Any  # jax.Array, or host numpy before placement (likewise below)
    scales: Any | None  # None for the record formats
    mins: Any | None
    out_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    format: str = dataclasses.field(default="q4_1", metadata={"static": True})
    kernel: str = dataclasses.field(default="xla", metadata={"static": True})
    layer: jax.Array | None = None

    @property
    def k(self) -> int:
        """Contracted size K (inputs)."""
        unit = RECORD_FORMATS[self.format].unit if self.format in RECORD_FORMATS else BLOCK
        return int(self.codes.shape[-3]) * unit

    @property
    def n(self) -> int:
        """Output size N."""
        return int(self.codes.shape[-4]) * BLOCK

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of the values the blocks hold: float32 (what ``dequantize`` gives)."""
        return jnp.dtype(jnp.float32)

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales and minimums."""
        return sum(int(a.size) * a.dtype.itemsize for a in (self.codes, self.scales, self.mins) if a is not None)


def format_of(ggml_type: int) -> str | None:
    """The ``QuantPanels`` format of a ``gguf.GGMLQuantizationType`` value, or None when the
    type is not one kept as stored (F32, F16, Q2_K, IQ4_XS, ...)."""
    return {v: k for k, v in GGML_TYPES.items()}.get(int(ggml_type))


def split_blocks(raw: np.ndarray, fmt: str, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A GGUF tensor's bytes as (codes, scales, mins) per row and block.

    Args:
        raw: uint8 [N, K/32 * bytes per block], the rows as stored (``GGUFReader`` tensor data).
        fmt: one of ``FORMATS``.
        k: K, the weights per row (a multiple of 32).

    Returns:
        codes [N, K/32, B] (int8, B = 32 for Q8_0; uint8, B = 16 for Q4_*), scales [N, K/32]
        float16, mins [N, K/32] float16 or None.

    Raises:
        ValueError: ``fmt`` is unknown, K is not a multiple of 32, or ``raw`` has the wrong size.
    """
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"unknown block format {fmt!r}: expected one of {', '.join(BLOCK_FORMATS)}")
    if k % BLOCK:
        raise ValueError(f"a {fmt} row of {k} weights is not whole 32-weight blocks")
    kb, size = k // BLOCK, BLOCK_BYTES[fmt]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.ndim != 2 or raw.shape[1] != kb * size:
        raise ValueError(f"{fmt} rows of {k} weights need {kb * size} bytes each, got shape {raw.shape}")
    blocks = raw.reshape(raw.shape[0], kb, size)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if fmt == "q8_0":
        return blocks[..., 2:].copy().view(np.int8), scales, None
    if fmt == "q4_0":
        return blocks[..., 2:].copy(), scales, None
    return blocks[..., 4:].copy(), scales, blocks[..., 2:4].copy().view(np.float16)[..., 0]


def as_q8_0(raw: np.ndarray, fmt: str, k: int) -> np.ndarray:
    """Q4_0 or Q5_0 rows (uint8 [N, K/32 * bytes per block]) as Q8_0 rows [N, K/32 * 34] of the
    same values: d (q - offset), the codes less their offset fitting int8.

    Raises:
        ValueError: ``fmt`` is neither, or ``raw`` is not N rows of K weights in it.
    """
    if fmt == "q4_0":
        nibbles, d, _ = split_blocks(raw, fmt, k)
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.int8) - np.int8(8)
    elif fmt == "q5_0":
        codes = record_panels.decode(raw, fmt, k)
        q, d = (codes.q.astype(np.int8) - np.int8(16)).reshape(raw.shape[0], k // BLOCK, BLOCK), codes.d
    else:
        raise ValueError(f"{fmt} blocks are not held as q8_0")
    scale = np.ascontiguousarray(d.astype("<f2")).view(np.uint8).reshape(*d.shape, 2)
    return np.concatenate([scale, q.view(np.uint8)], axis=-1).reshape(raw.shape[0], -1)


def pack_rows(
    raw: np.ndarray, fmt: str, k: int, out_shape: Sequence[int], rows: np.ndarray | None = None
) -> QuantPanels:
    """A GGUF tensor's rows (W's columns) as ``QuantPanels`` of host numpy arrays, the bytes
    regrouped, never dequantized.

    Args:
        raw: uint8 [N', K/32 * bytes per block], the stored rows (see ``split_blocks``).
        fmt: one of ``FORMATS``.
        k: K, weights per row.
        out_shape: the outputs' shape in the model; its product N must be a multiple of 32.
        rows: optional int [N] row indices into ``raw``: output n is stored row ``rows[n]`` (a
            RoPE un-permutation, or the rows of several tensors concatenated into a fused one).

    Raises:
        ValueError: see ``split_blocks``; N is not a multiple of 32 or does not match.
    """
    codes, scales, mins = split_blocks(raw, fmt, k)
    if rows is not None:
        codes, scales = codes[rows], scales[rows]
        mins = None if mins is None else mins[rows]
    n = math.prod(out_shape)
    if n != codes.shape[0] or n % BLOCK:
        raise ValueError(f"{codes.shape[0]} rows cannot be outputs {tuple(out_shape)} in panels of {BLOCK}")
    p, kb = n // BLOCK, k // BLOCK
    # [N, Kb, B] -> [P, 32, Kb, B] -> [P, Kb, B, 32]; [N, Kb] -> [P, 32, Kb] -> [P, Kb, 32]
    panel_codes = np.ascontiguousarray(codes.reshape(p, BLOCK, kb, -1).transpose(0, 2, 3, 1))

    def per_column(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else np.ascontiguousarray(a.reshape(p, BLOCK, kb).transpose(0, 2, 1))

    return QuantPanels(panel_codes, per_column(scales), per_column(mins), tuple(int(d) for d in out_shape), fmt)


def pack_records(codes: record_panels.Codes, out_shape: Sequence[int], rows: np.ndarray | None = None) -> QuantPanels:
    """A record format's ``QuantPanels`` (host numpy) of ``codes`` (``record_panels.decode``d
    and ``convert``-ed to one format), output n being row ``rows[n]`` (None: in order).

    Raises:
        ValueError: the rows are not the outputs ``out_shape`` in panels of 32.
    """
    n = math.prod(out_shape)
    if n != (codes.q.shape[0] if rows is None else len(rows)):
        raise ValueError(f"{codes.q.shape[0]} rows cannot be outputs {tuple(out_shape)}")
    return QuantPanels(record_panels.pack(codes, rows), None, None, tuple(int(d) for d in out_shape), codes.fmt)


def stack(panels: Sequence[QuantPanels]) -> QuantPanels:
    """Several matrices of one format and shape as one with a leading layer axis (host numpy)."""
    first = panels[0]
    if any(
        (q.format, q.out_shape, q.codes.shape) != (first.format, first.out_shape, first.codes.shape) for q in panels
    ):
        raise ValueError("stacked QuantPanels must share format and shape")

    def stacked(name: str) -> np.ndarray | None:
        return None if getattr(first, name) is None else np.stack([np.asarray(getattr(q, name)) for q in panels])

    return QuantPanels(stacked("codes"), stacked("scales"), stacked("mins"), first.out_shape, first.format)


def layer(w: QuantPanels, i: jax.Array | int) -> QuantPanels:
    """Matrix ``i`` of stacked panels (a slice of each array)."""
    scales = None if w.scales is None else w.scales[i]
    mins = None if w.mins is None else w.mins[i]
    return dataclasses.replace(w, codes=w.codes[i], scales=scales, mins=mins, layer=None)


def codes_as_float(codes: jax.Array, fmt: str) -> jax.Array:
    """The codes' integer values as float32, [..., Kb, B, 32] -> [..., Kb, 32, 32] (axis -2 the
    block's 32 weights in order). Q4_0's offset of 8 is subtracted here."""
    if fmt == "q8_0":
        return codes.astype(jnp.float32)
    low, high = codes & 0x0F, codes >> 4
    q = jnp.concatenate([low, high], axis=-2).astype(jnp.float32)
    return q - 8.0 if fmt == "q4_0" else q


def dequantize(w: QuantPanels) -> jax.Array:
    """W [*lead, K, N] float32 with exactly the values ``gguf.quants.dequantize`` gives (module
    docstring), in XLA (any backend; traceable)."""
    if w.format in RECORD_FORMATS:
        values = record_panels.dequantize(w.codes, w.format)  # [*lead, P, K, 32]
        lead, p = values.shape[:-3], values.shape[-3]
        nd = len(lead)
        order = (*range(nd), nd + 1, nd, nd + 2)  # -> [*lead, K, P, 32]
        return values.transpose(order).reshape(*lead, w.k, p * BLOCK)
    assert w.scales is not None  # a block format's
    q = codes_as_float(w.codes, w.format)  # [*lead, P, Kb, 32 (k), 32 (c)]
    values = q * w.scales.astype(jnp.float32)[..., None, :]
    if w.mins is not None:
        values = values + w.mins.astype(jnp.float32)[..., None, :]
    lead = values.shape[:-4]
    p, kb = values.shape[-4], values.shape[-3]
    nd = len(lead)
    order = (*range(nd), nd + 1, nd + 2, nd, nd + 3)  # -> [*lead, Kb, 32 (k), P, 32 (c)]
    return values.transpose(order).reshape(*lead, kb * BLOCK, p * BLOCK)


def dequantize_rows(w: QuantPanels, rows: jax.Array) -> jax.Array:
    """Columns ``rows`` of W as vectors: [..., K] float32 for int ``rows`` [...] in [0, N) (an
    embedding table's lookup, with W [D, V] the transposed table). ``w`` has no lead axes."""
    p, c = rows // BLOCK, rows % BLOCK
    if w.format in RECORD_FORMATS:
        return record_panels.dequantize_column(w.codes, p, c, w.format)
    assert w.scales is not None  # a block format's
    codes = w.codes[p, :, :, c]  # [..., Kb, B]
    q = codes_as_float(codes[..., None], w.format)[..., 0]  # [..., Kb, 32]
    values = q * w.scales[p, :, c].astype(jnp.float32)[..., None]
    if w.mins is not None:
        values = values + w.mins[p, :, c].astype(jnp.float32)[..., None]
    return values.reshape(*rows.shape, w.k)


def xla_matmul(x: jax.Array, w: QuantPanels) -> jax.Array:
    """x [M, K] @ W by XLA (``dequantize`` then a float32 dot): [M, *w.out_shape] float32. The
    reference for the native kernel, and the path of every non-CPU backend. Panels standing for
    one matrix of their stack (``layer``) are sliced to it first."""
    if w.layer is not None:
        w = layer(w, w.layer)
    y = jnp.dot(x.astype(jnp.float32), dequantize(w), preferred_element_type=jnp.float32)
    return y.reshape(x.shape[0], *w.out_shape)
