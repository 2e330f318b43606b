"""The layer and LM-head weight matmuls as a native XLA:CPU custom call over panel-packed weights.

At decode batch sizes (a few to 64 rows) the step's matmuls stream the weights from memory,
and XLA:CPU's small-M matmuls walk W [K, N] at a stride of N floats per output block, below
the machine's streaming rate. The kernel (``native/panel_matmul.cc``) reads the weights
re-laid out once as column panels [N/32, K, 32], each panel one contiguous,
software-prefetched stream, with a tile of rows of x held against a panel in vector registers
(the micro-kernel of Goto & van de Geijn 2008, section 4), sized by the build target's
registers. Where it is faster than XLA's dots depends on that target: ``faster_than_xla``
holds the rule the engine follows, and docs/cpu-kernels.md the measurements behind it.

The packed weights are a second copy: the engine keeps the input-major ones, which the
sharded layouts, relayout and checkpoints use (about 540 MB more for SmolLM2-135M).

Where the CPU has Intel AMX, ``pack_bf16x3`` packs the same weights for the AMX kernel
(``native/amx_matmul.cc``): each float32 split into two bfloat16 halves, the product taken as
three bf16 tile products accumulated in float32 (JAX's Precision.HIGH, "bfloat16_3x"; relative
error per product about 2^-16 instead of 2^-24). Same bytes as float32 weights; an opt-in
precision, not the default (``EngineConfig.matmul="bf16x3"``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from model import native_kernels

PANEL = 32  # columns per panel; N (and, for bf16x3, K) must be a multiple of it
TARGETS = {"f32": native_kernels.PANEL_MATMUL, "bf16x3": native_kernels.AMX_MATMUL}  # Panels.format -> FFI target


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Panels:
    """A weight matrix W [K, N] packed for a kernel. ``format`` (static) "f32": ``data``
    [N/32, K, 32] float32, panel p holding columns 32p .. 32p + 31 of every row, or a stack of
    L such matrices [L, N/32, K, 32] (``pack_stacked``); "bf16x3": ``data`` [N/32, K/32, 2, 2,
    16, 32] bfloat16, the hi and lo halves of each 32 x 32 block in AMX's pair-interleaved
    layout (``pack_bf16x3``). ``out_shape`` (static) is the shape the N outputs take in the
    model (e.g. (K, G + 2, H) for the fused QKV projection). ``layer``: None, or for a stack an
    int32 scalar (may be traced) naming the matrix ``matmul`` multiplies by, read in place (as
    ``QuantPanels.layer``: a scanned layer loop passes the whole stack and its index)."""

    data: jax.Array
    out_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    format: str = dataclasses.field(default="f32", metadata={"static": True})
    layer: jax.Array | None = None

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of the weights these hold: float32 (bf16x3 splits float32 weights)."""
        return jnp.dtype(jnp.float32)


def supports(n: int, dtype: jnp.dtype, k: int = PANEL, format: str = "f32") -> bool:
    """Whether a kernel takes a weight [k, n] of this dtype: float32, n a multiple of 32, and for
    "bf16x3" k a multiple of 32 too; it says nothing of whether the kernel is built."""
    return n % PANEL == 0 and jnp.dtype(dtype) == jnp.float32 and (format == "f32" or k % PANEL == 0)


def _as_matrix(w: jax.Array, in_dims: int, format: str) -> tuple[jax.Array, tuple[int, ...]]:
    in_shape, out_shape = w.shape[:in_dims], w.shape[in_dims:]
    k = math.prod(in_shape)
    n = w.size // k
    if not supports(n, w.dtype, k, format):
        raise ValueError(
            f"cannot pack a {w.dtype} weight [{k}, {n}] as {format} "
            f"(need float32, N{' and K' if format != 'f32' else ''} a multiple of {PANEL})"
        )
    return jnp.asarray(w).reshape(k, n), tuple(int(d) for d in out_shape)


def pack(w: jax.Array, in_dims: int) -> Panels:
    """W with its first ``in_dims`` axes as K and the rest as N, packed into panels.

    Args:
        w: [*in_shape, *out_shape] float32, e.g. wqkv [D, K, G + 2, H] with in_dims 1, or wo
            [N, H, D] with in_dims 2.
        in_dims: how many leading axes are contracted.

    Raises:
        ValueError: the output columns are not a multiple of 32, or w is not float32.
    """
    w2, out_shape = _as_matrix(w, in_dims, "f32")
    k, n = w2.shape
    return Panels(data=w2.reshape(k, n // PANEL, PANEL).transpose(1, 0, 2), out_shape=out_shape)


def pack_stacked(w: jax.Array, in_dims: int) -> Panels:
    """A stack of L weights, w [L, *in_shape, *out_shape] float32, packed as "f32" panels
    [L, N/32, K, 32] (``in_dims`` counts the contracted axes after L); ``matmul`` multiplies by
    one of them at a time (``Panels.layer``).

    Raises:
        ValueError: as ``pack``.
    """
    first, out_shape = _as_matrix(w[0], in_dims, "f32")  # checks the shapes and dtype once
    k, n = first.shape
    data = jnp.asarray(w).reshape(w.shape[0], k, n // PANEL, PANEL).transpose(0, 2, 1, 3)
    return Panels(data=data, out_shape=out_shape)


def split_bf16(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 w -> (hi, lo) bfloat16 with hi = RNE(w), lo = RNE(w - hi): w ~ hi + lo to about
    16 mantissa bits (the split of bf16x3; Henry et al. 2019, section III)."""
    hi = w.astype(jnp.bfloat16)
    return hi, (w - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def pack_bf16x3(w: jax.Array, in_dims: int) -> Panels:
    """W packed for the AMX bf16x3 kernel: ``data`` [N/32, K/32, 2, 2, 16, 32] bfloat16 with
    data[p, b, s, c, r, 2j + t] = half s (hi, lo) of W[32b + 2r + t, 32p + 16c + j]
    (AMX's B-operand layout, row pairs interleaved: Intel SDM vol. 2, TDPBF16PS).

    Args:
        w: [*in_shape, *out_shape] float32, as for ``pack``.
        in_dims: how many leading axes are contracted.

    Raises:
        ValueError: K or N is not a multiple of 32, or w is not float32.
    """
    w2, out_shape = _as_matrix(w, in_dims, "bf16x3")
    k, n = w2.shape
    # [K, N] -> axes (b, r, t, p, c, j) -> (p, b, c, r, j, t)
    halves = [
        h.reshape(k // 32, 16, 2, n // 32, 2, 16).transpose(3, 0, 4, 1, 5, 2).reshape(n // 32, k // 32, 2, 16, 32)
        for h in split_bf16(w2)
    ]
    return Panels(data=jnp.stack(halves, axis=2), out_shape=out_shape, format="bf16x3")


def matmul(x: jax.Array, w: Panels) -> jax.Array:
    """x @ W by the native kernel of ``w.format`` (call ``available()``, and for "bf16x3"
    ``amx_available()``, first); for stacked "f32" panels, W is matrix ``w.layer`` of the stack.

    Shapes: x [M, K] (cast to float32); returns [M, *w.out_shape] float32.

    Raises:
        ValueError (at trace time): stacked panels without a ``layer``, or one matrix with one.
        XlaRuntimeError (at run time): x's K differs from the panels', or ``layer`` is outside
            [0, L).
    """
    m = x.shape[0]
    stacked = w.format == "f32" and w.data.ndim == 4
    if stacked != (w.layer is not None):
        raise ValueError("stacked panels [L, N/32, K, 32] need a layer index, one matrix none")
    n = w.data.shape[-3 if w.format == "f32" else 0] * PANEL
    call = jax.ffi.ffi_call(TARGETS[w.format], jax.ShapeDtypeStruct((m, n), jnp.float32))
    if w.format == "bf16x3":
        return call(x.astype(jnp.float32), w.data).reshape(m, *w.out_shape)
    data, layer = (w.data, w.layer) if stacked else (w.data[None], 0)  # one matrix: L = 1, a reshape
    return call(x.astype(jnp.float32), data, jnp.asarray(layer, jnp.int32)).reshape(m, *w.out_shape)


def faster_than_xla(rows: int) -> bool:
    """Whether the float32 panel kernel, as built here (``native_kernels.isa()``), was measured
    faster than XLA's dots for matmuls of ``rows`` rows (docs/cpu-kernels.md,
    ``benchmarks/native_decode.py``): an AVX-512 build at every size measured (1 to 512 rows);
    an AVX2 build from 2 to 32 rows (at 1 row XLA's matrix-vector product streams the weights
    about as fast, and from 64 rows XLA's matmuls were as fast or faster, decode steps and
    prefill chunks alike); any other build never (not measured). The engine decides by this alone; call
    ``available()`` first.

    Raises:
        RuntimeError: the compiler could not be asked for the target's ISA.
    """
    isa = native_kernels.isa()
    if isa == "avx512":
        return rows >= 1
    if isa == "avx2":
        return 2 <= rows <= 32
    return False


available = native_kernels.available  # whether the kernels are built and registered
amx_available = native_kernels.amx_available  # whether the bf16x3 kernel can run here
