"""GGUF's K-quants (Q4_K, Q5_K, Q6_K) and Q5_0 kept as stored: one byte record per 32 columns.

The formats (ggml-org/ggml ``src/ggml-quants.c``; ``gguf.quants`` reads the same bytes) give
weight k of a 32-weight block b with code q the float32 value

    Q5_0: d * (q - 16)                      q 5 bits; d float16 per 32 weights
    Q4_K: (d * sc_b) * q - (dmin * m_b)     q 4 bits; d, dmin float16 per 256 weights,
    Q5_K: the same, q 5 bits                sc_b, m_b 6 bits per 32 weights
    Q6_K: (d * sc_h) * (q - 32)             q 6 bits; d float16 per 256, sc_h int8 per 16

``gguf.quants.dequantize`` computes D = d * sc and M = dmin * m first (exact in float32: an
11-bit significand times at most 8 bits), then one rounding, D q - M or D (q - 32). All four are
one formula here, value = D_h (q - offset) - M_b, with D_h the scale of the block's half h (its
weights 0-15 or 16-31; Q4_K and Q5_K give both halves one scale, Q5_0 has sc = 1), and M = 0
where a format has no minimum. So one record layout holds them, and a stack whose layers mix
Q4_K, Q5_K and Q6_K (llama.cpp's Q4_K_M mixes do, in ffn_down and attn_v) is held as Q6_K with
minimums: a Q4_K or Q5_K code q becomes q + 32 (< 64), its scale both halves', and the values
are unchanged bit for bit (``union_format``).

A record is one unit (32 weights for Q5_0, 256 for the K-quants: U = 1 or 8 blocks) of 32
output columns, rows of 32 bytes (one byte per column), in this order:

    codes   16 U rows   byte j of block b: weight j's low 4 bits in its low nibble, weight
                        j + 16's in its high one (the pairing of model.weights.quant_panels)
    high    4 U rows (5-bit codes): row i bit t is bit 4 of weight 4t + i;
            8 U rows (6-bit codes): row i bits 2t, 2t + 1 are bits 4-5 of weight 8t + i
    sc      U rows (Q4_K, Q5_K) or 2 U rows (Q6_K: half 0, half 1) of int8
    m       U rows of uint8 (K-quants)
    d       2 rows: the 32 columns' float16 d as 32 little-endian uint16
    dmin    2 rows likewise (K-quants)

Codes are thus [*lead, P, Ku, R, 32] uint8 (P = N/32 panels, Ku = K / unit units, R rows per
record): Q5_0 22 rows per 32 weights, Q4_K 148 per 256, Q5_K 180, Q6_K 220 (with the minimums
the mixes need), against the file's 22, 144, 176 and 210 bytes: at most 1.05x the file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import gguf
import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # weights per block, columns per panel


@dataclasses.dataclass(frozen=True)
class RecordFormat:
    """How one record format lays out its unit (module docstring)."""

    name: str
    ggml_type: int  # the gguf.GGMLQuantizationType this format stores as it is
    blocks: int  # U, 32-weight blocks per unit
    high_bits: int  # bits of each code above its low 4 (0, 1 or 2)
    halves: int  # scale rows per block: 0 (Q5_0: d alone), 1 or 2 (Q6_K: one per 16 weights)
    mins: bool  # whether the record holds m and dmin
    offset: int  # subtracted from each code

    @property
    def unit(self) -> int:
        """Weights per record (per column)."""
        return self.blocks * BLOCK

    @property
    def high_rows(self) -> int:
        return {0: 0, 1: 4, 2: 8}[self.high_bits]

    @property
    def sc_row(self) -> int:
        return 16 * self.blocks + self.high_rows * self.blocks

    @property
    def m_row(self) -> int:
        return self.sc_row + self.halves * self.blocks

    @property
    def d_row(self) -> int:
        return self.m_row + (self.blocks if self.mins else 0)

    @property
    def rows(self) -> int:
        """R, bytes per record and column."""
        return self.d_row + (4 if self.mins else 2)


RECORD_FORMATS = {
    f.name: f
    for f in (
        RecordFormat("q5_0", int(gguf.GGMLQuantizationType.Q5_0), 1, 1, 0, False, 16),
        RecordFormat("q4_k", int(gguf.GGMLQuantizationType.Q4_K), 8, 0, 1, True, 0),
        RecordFormat("q5_k", int(gguf.GGMLQuantizationType.Q5_K), 8, 1, 1, True, 0),
        RecordFormat("q6_k", int(gguf.GGMLQuantizationType.Q6_K), 8, 2, 2, True, 32),
    )
}
# A GGUF tensor's bytes per 32 weights (Q5_0) or 256 (the K-quants)
SOURCE_BYTES = {"q5_0": 22, "q4_k": 144, "q5_k": 176, "q6_k": 210}
# Byte offsets of its float16 fields in a GGUF block: d (and the K-quants' dmin), as ggml lays them out
SOURCE_HALVES = {"q5_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


@dataclasses.dataclass
class Codes:
    """A tensor's codes and scales as integers, rows [N] of K weights (host numpy): q uint8
    [N, K] (before the offset), sc int8 [N, K/32, 2] (None: 1), m uint8 [N, K/32] (None: 0),
    d float16 [N, K / unit], dmin float16 [N, K / unit] (None: 0). ``fmt`` the record format
    whose unit and offset they follow."""

    fmt: str
    q: np.ndarray
    d: np.ndarray
    sc: np.ndarray | None = None
    m: np.ndarray | None = None
    dmin: np.ndarray | None = None


def decode(raw: np.ndarray, fmt: str, k: int) -> Codes:
    """A GGUF tensor's bytes (uint8 [N, K / unit * bytes per unit], ``fmt`` one of
    ``SOURCE_BYTES``) as ``Codes``, their bits unpacked as ``gguf.quants`` unpacks them.

    Raises:
        ValueError: K is not whole units, or ``raw`` is not N rows of them.
    """
    spec = RECORD_FORMATS[fmt]
    if k % spec.unit:
        raise ValueError(f"a {fmt} row of {k} weights is not whole {spec.unit}-weight blocks")
    ku, size = k // spec.unit, SOURCE_BYTES[fmt]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.ndim != 2 or raw.shape[1] != ku * size:
        raise ValueError(f"{fmt} rows of {k} weights need {ku * size} bytes each, got shape {raw.shape}")
    n = raw.shape[0]
    b = raw.reshape(n, ku, size)

    def half(lo: int) -> np.ndarray:
        return b[..., lo : lo + 2].copy().view(np.float16)[..., 0]

    if fmt == "q5_0":
        qh = b[..., 2:6].copy().view(np.uint32)[..., 0]  # [N, Ku]
        ql = b[..., 6:22]
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)  # [N, Ku, 32]
        high = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1
        return Codes(fmt, (low | (high.astype(np.uint8) << 4)).reshape(n, k), half(SOURCE_HALVES[fmt][0]))
    if fmt == "q6_k":
        ql = b[..., :128].reshape(n, ku, 2, 64)
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)  # [N, Ku, 2, 128]: weight 128h + i
        qh = b[..., 128:192].reshape(n, ku, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]
        high = (qh & 3).reshape(n, ku, 2, 128)
        q = (low | (high << 4)).reshape(n, k)
        sc = b[..., 192:208].copy().view(np.int8).reshape(n, ku * 8, 2)
        return Codes(fmt, q, half(SOURCE_HALVES[fmt][0]), sc=sc)
    # Q4_K, Q5_K: d, dmin, 12 bytes of 6-bit scales and minimums, (Q5_K: 32 bytes of bit 4), codes
    sc, m = gguf.quants.Q4_K.get_scale_min(b[..., 4:16].reshape(n * ku, 12))
    qs = b[..., 16:144] if fmt == "q4_k" else b[..., 48:176]
    qs = qs.reshape(n, ku, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, ku, 8, 32)  # sub-block 2g, 2g + 1
    if fmt == "q5_k":
        qh = b[..., 16:48].reshape(n, ku, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
        q = q | ((qh & 1) << 4)
    sc = np.repeat(sc.reshape(n, ku * 8, 1).astype(np.int8), 2, axis=-1)
    d_at, dmin_at = SOURCE_HALVES[fmt]
    return Codes(fmt, q.reshape(n, k), half(d_at), sc=sc, m=m.reshape(n, ku * 8).astype(np.uint8), dmin=half(dmin_at))


def union_format(formats: set[str]) -> str | None:
    """The record format that holds tensors of all ``formats`` exactly (module docstring), or
    None: one format itself; Q4_K with Q5_K as Q5_K; any K-quants with Q6_K as Q6_K."""
    if len(formats) == 1:
        return next(iter(formats))
    if formats <= {"q4_k", "q5_k"}:
        return "q5_k"
    if formats <= {"q4_k", "q5_k", "q6_k"}:
        return "q6_k"
    return None


def convert(codes: Codes, fmt: str) -> Codes:
    """``codes`` as the codes of record format ``fmt`` (``union_format`` of theirs and others),
    every value unchanged.

    Raises:
        ValueError: ``fmt`` cannot hold them.
    """
    if union_format({codes.fmt, fmt}) != fmt:
        raise ValueError(f"{codes.fmt} blocks cannot be held as {fmt}")
    spec, n, blocks = RECORD_FORMATS[fmt], codes.q.shape[0], codes.q.shape[1] // BLOCK
    shift = spec.offset - RECORD_FORMATS[codes.fmt].offset
    return Codes(  # the fields the target holds and the source lacks at their neutral values
        fmt,
        codes.q + np.uint8(shift) if shift else codes.q,
        codes.d,
        codes.sc if codes.sc is not None or not spec.halves else np.ones((n, blocks, 2), np.int8),
        codes.m if codes.m is not None or not spec.mins else np.zeros((n, blocks), np.uint8),
        codes.dmin if codes.dmin is not None or not spec.mins else np.zeros_like(codes.d),
    )


def concatenate(parts: Sequence[Codes]) -> Codes:
    """Rows of several ``Codes`` of one format (each ``convert``-ed to it), in order."""

    def cat(name: str) -> np.ndarray | None:
        arrays = [getattr(p, name) for p in parts]
        return None if arrays[0] is None else np.concatenate(arrays)

    return Codes(parts[0].fmt, cat("q"), cat("d"), cat("sc"), cat("m"), cat("dmin"))  # type: ignore[arg-type]


def pack(codes: Codes, rows: np.ndarray | None = None) -> np.ndarray:
    """Records [P, Ku, R, 32] uint8 of ``codes`` (``convert``-ed to their format; output n
    being row ``rows[n]``; None: in order).

    Raises:
        ValueError: N is not a multiple of 32.
    """
    spec = RECORD_FORMATS[codes.fmt]
    pick = (lambda a: a) if rows is None else (lambda a: a[rows])
    q = pick(codes.q)
    n, k = q.shape
    if n % BLOCK:
        raise ValueError(f"{n} rows cannot be outputs in panels of {BLOCK}")
    ku, u = k // spec.unit, spec.blocks
    q = q.reshape(n, ku, u, BLOCK)
    fields = [((q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4)).reshape(n, ku, 16 * u)]
    if spec.high_bits:
        per = 8 // spec.high_bits  # codes' high parts per byte
        h = (q >> 4).reshape(n, ku, u, per, BLOCK // per)  # [.., t, i]: weight (32 / per) t + i
        shifts = (spec.high_bits * np.arange(per, dtype=np.uint8))[:, None]
        fields.append(np.bitwise_or.reduce(h << shifts, axis=3).reshape(n, ku, -1))
    if spec.halves:
        fields.append(pick(codes.sc)[..., : spec.halves].reshape(n, ku, -1).view(np.uint8))
    if spec.mins:
        fields.append(pick(codes.m).reshape(n, ku, u))
    halfs = [pick(codes.d), *([pick(codes.dmin)] if spec.mins else [])]
    for _ in halfs:  # placeholder rows, overwritten per panel below
        fields.append(np.zeros((n, ku, 2), np.uint8))
    per_column = np.concatenate(fields, axis=-1)  # [N, Ku, R]
    p = n // BLOCK
    out = np.ascontiguousarray(per_column.reshape(p, BLOCK, ku, spec.rows).transpose(0, 2, 3, 1))
    for i, h in enumerate(halfs):  # [N, Ku] float16 -> [P, Ku, 32] -> 64 bytes as 2 rows
        panel = h.astype("<f2").reshape(p, BLOCK, ku).transpose(0, 2, 1)
        out[:, :, spec.d_row + 2 * i : spec.d_row + 2 * i + 2, :] = (
            np.ascontiguousarray(panel).view(np.uint8).reshape(p, ku, 2, BLOCK)
        )
    return out


def _half_row(codes: jax.Array, row: int) -> jax.Array:
    """The float16 field at record rows ``row``, ``row + 1`` as float32 [..., C] (C columns)."""
    b = codes[..., row : row + 2, :].reshape(*codes.shape[:-2], codes.shape[-1], 2).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(b[..., 0] | (b[..., 1] << 8), jnp.float16).astype(jnp.float32)


def dequantize(codes: jax.Array, fmt: str) -> jax.Array:
    """Records [..., Ku, R, C] as values [..., Ku * unit, C] float32, exactly
    ``gguf.quants.dequantize``'s (module docstring), in XLA (any backend; traceable). C is 32
    (a panel), or 1 (``dequantize_column``'s one-column record)."""
    spec = RECORD_FORMATS[fmt]
    u, cols = spec.blocks, codes.shape[-1]
    lead = codes.shape[:-2]
    nib = codes[..., : 16 * u, :].reshape(*lead, u, 16, cols)
    q = jnp.concatenate([nib & 0x0F, nib >> 4], axis=-2).astype(jnp.int32)  # [..., U, 32 (k), 32 (c)]
    if spec.high_bits:
        h = codes[..., 16 * u : spec.sc_row, :].reshape(*lead, u, spec.high_rows, cols).astype(jnp.int32)
        w = np.arange(BLOCK)
        bits = (h[..., w % spec.high_rows, :] >> (spec.high_bits * (w // spec.high_rows))[:, None]) & (
            (1 << spec.high_bits) - 1
        )
        q = q | (bits << 4)
    d = _half_row(codes, spec.d_row)[..., None, None, :]  # [..., 1, 1, C]
    if spec.halves:
        sc = jax.lax.bitcast_convert_type(codes[..., spec.sc_row : spec.m_row, :], jnp.int8).astype(jnp.float32)
        sc = sc.reshape(*lead, u, spec.halves, cols)
        scale = d * jnp.repeat(sc, BLOCK // spec.halves, axis=-2)  # [..., U, 32, C], exact
    else:
        scale = jnp.broadcast_to(d, (*lead, u, BLOCK, cols))
    values = scale * (q - spec.offset).astype(jnp.float32)
    if spec.mins:
        m = codes[..., spec.m_row : spec.d_row, :].astype(jnp.float32)  # [..., U, C]
        values = values - (_half_row(codes, spec.d_row + 2)[..., None, :] * m)[..., None, :]
    return values.reshape(*lead[:-1], lead[-1] * spec.unit, cols)


def dequantize_column(codes: jax.Array, p: jax.Array, c: jax.Array, fmt: str) -> jax.Array:
    """Column c of panel p of records [P, Ku, R, 32] as values [..., Ku * unit] float32 for int
    ``p``, ``c`` [...] (an embedding table's lookup), exactly ``dequantize``'s: the column's byte
    of every per-column row, and its two bytes of each float16 field (which is laid out as 32
    little-endian uint16, not a byte per column), as a record one column wide."""
    spec = RECORD_FORMATS[fmt]
    column = codes[p, :, :, c]  # [..., Ku, R]
    halves = codes[p, :, spec.d_row :, :]  # [..., Ku, 2 or 4, 32]: d (and dmin), 64 bytes each
    halves = halves.reshape(*halves.shape[:-2], -1, 2 * BLOCK)  # [..., Ku, 1 or 2, 64]
    picked = jnp.take_along_axis(halves, (2 * c[..., None, None, None] + jnp.arange(2)), axis=-1)
    column = column.at[..., spec.d_row :].set(picked.reshape(*column.shape[:-1], -1))
    return dequantize(column[..., None], fmt)[..., 0]
