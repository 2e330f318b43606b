"""The layer and LM-head weight matmuls as a native XLA:CPU custom call over panel-packed weights.

At decode batch sizes (a few to 64 rows) the step's matmuls stream the weights from memory,
and XLA:CPU's small-M matmuls read W [K, N] row after row at a stride of N floats, at about
9 GB/s at 8 rows on a 2-core machine that streams 20 (measured at SmolLM2-135M's shapes, a
jitted loop of [M, 576] x [576, 3072] and [M, 1536] x [1536, 576] over 30 layers). The kernel
(``native/panel_matmul.cc``) reads the weights re-laid out once as column panels
[N/32, K, 32], each panel one contiguous, software-prefetched stream, with up to 16 rows of x
held against a panel in vector registers (the micro-kernel of Goto & van de Geijn 2008,
section 4). On a [M, 576] x [576, 3072] loop over 30 layers, both in one process (scratch
timings, min of 7): 19 against 8 GB/s at 8 rows, 146 against 78-92 GFLOP/s at 32, 165-171
against 118-140 at 64, 175-193 against 126-141 at 512; at 1 row XLA's matrix-vector product
is 10-20 % faster.

The packed weights are a second copy: the engine keeps the input-major ones, which the
sharded layouts, relayout and checkpoints use (about 540 MB more for SmolLM2-135M).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from model import native_kernels

TARGET = native_kernels.PANEL_MATMUL  # the FFI target (registered by native_kernels)
PANEL = 32  # columns per panel; N must be a multiple of it


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Panels:
    """A weight matrix W [K, N] packed for the kernel: ``data`` [N/32, K, 32] float32, panel p
    holding columns 32p .. 32p + 31 of every row. ``out_shape`` (static) is the shape the
    N outputs take in the model (e.g. (K, G + 2, H) for the fused QKV projection)."""

    data: jax.Array
    out_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})

    @property
    def dtype(self) -> jnp.dtype:
        """The weights' dtype (float32)."""
        return self.data.dtype


def supports(n: int, dtype: jnp.dtype) -> bool:
    """Whether the kernel takes a weight with ``n`` output columns of this dtype (float32 and a
    multiple of 32 columns); it says nothing of whether the kernel is built."""
    return n % PANEL == 0 and jnp.dtype(dtype) == jnp.float32


def pack(w: jax.Array, in_dims: int) -> Panels:
    """W with its first ``in_dims`` axes as K and the rest as N, packed into panels.

    Args:
        w: [*in_shape, *out_shape] float32, e.g. wqkv [D, K, G + 2, H] with in_dims 1, or wo
            [N, H, D] with in_dims 2.
        in_dims: how many leading axes are contracted.

    Raises:
        ValueError: the output columns are not a multiple of 32, or w is not float32.
    """
    in_shape, out_shape = w.shape[:in_dims], w.shape[in_dims:]
    k = math.prod(in_shape)
    n = w.size // k
    if not supports(n, w.dtype):
        raise ValueError(
            f"cannot pack a {w.dtype} weight with {n} output columns (need float32, a multiple of {PANEL})"
        )
    data = jnp.asarray(w).reshape(k, n // PANEL, PANEL).transpose(1, 0, 2)
    return Panels(data=data, out_shape=tuple(int(d) for d in out_shape))


def matmul(x: jax.Array, w: Panels) -> jax.Array:
    """x @ W by the native kernel (call ``native_kernels.available()`` first).

    Shapes: x [M, K] (cast to float32); returns [M, *w.out_shape] float32.

    Raises:
        XlaRuntimeError (at run time): x's K differs from the panels'.
    """
    m = x.shape[0]
    n = w.data.shape[0] * PANEL
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))
    return call(x.astype(jnp.float32), w.data).reshape(m, *w.out_shape)


available = native_kernels.available  # whether the kernels are built and registered
