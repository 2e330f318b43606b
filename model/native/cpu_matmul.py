"""The layer and LM-head weight matmuls as a native XLA:CPU custom call over panel-packed weights.

At decode batch sizes (a few to 64 rows) the step's matmuls stream the weights from memory,
and XLA:CPU's small-M matmuls walk W [K, N] at a stride of N floats per output block, below
the machine's streaming rate. The kernel (``native/panel_matmul.cc``) reads the weights
re-laid out once as column panels [N/32, K, 32], each panel one contiguous,
software-prefetched stream, with a tile of rows of x held against a panel in vector registers
(the micro-kernel of Goto & van de Geijn 2008, section 4), sized by the build target's
registers. Where it is faster than XLA's dots depends on that target (docs/cpu-kernels.md); the
engine does not choose per shape: ``model.kernels.choose`` packs panels wherever it is built.

Panels are a form of the parameters, as stored GGUF blocks are (``model.matmul``): the engine
packs its float32 weights once on one CPU device (``model.weights.packed_weights``) and keeps
no other copy; ``unpack`` gives the input-major array back for a layout on other devices.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from model import native

PANEL = 32  # columns per panel; N must be a multiple of it
TARGET = native.PANEL_MATMUL


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Panels:
    """A float32 weight matrix W [K, N] packed for the kernel: ``data`` [N/32, K, 32], panel p
    holding columns 32p .. 32p + 31 of every row, or a stack of L such matrices
    [L, N/32, K, 32] (``pack_stacked``). ``in_shape`` and ``out_shape`` (static) are the shapes
    the K inputs and N outputs take in the model (e.g. (D,) and (K, G + 2, H) for the fused QKV
    projection). ``layer``: None, or for a stack an int32 scalar (may be traced) naming the
    matrix ``matmul`` multiplies by, read in place (as ``QuantPanels.layer``: a scanned layer
    loop passes the whole stack and its index)."""

    data: Any  # jax.Array (a sharding while placement is computed)
    out_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    in_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    layer: jax.Array | None = None

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of the weights these hold: float32."""
        return jnp.dtype(jnp.float32)

    @property
    def shape(self) -> tuple[int, ...]:
        """The input-major weight's shape ([L] + in_shape + out_shape for a stack)."""
        return (*self.data.shape[:-3], *self.in_shape, *self.out_shape)


def supports(n: int, dtype: jnp.dtype) -> bool:
    """Whether the kernel takes a weight [k, n] of this dtype: float32 and n a multiple of 32;
    it says nothing of whether the kernel is built."""
    return n % PANEL == 0 and jnp.dtype(dtype) == jnp.float32


def _as_matrix(w: jax.Array, in_dims: int) -> tuple[jax.Array, tuple[int, ...], tuple[int, ...]]:
    in_shape, out_shape = w.shape[:in_dims], w.shape[in_dims:]
    k = math.prod(in_shape)
    n = w.size // k
    if not supports(n, w.dtype):
        raise ValueError(
            f"cannot pack a {w.dtype} weight [{k}, {n}] into panels (need float32, N a multiple of {PANEL})"
        )
    return jnp.asarray(w).reshape(k, n), tuple(int(d) for d in in_shape), tuple(int(d) for d in out_shape)


def pack(w: jax.Array, in_dims: int) -> Panels:
    """W with its first ``in_dims`` axes as K and the rest as N, packed into panels.

    Args:
        w: [*in_shape, *out_shape] float32, e.g. wqkv [D, K, G + 2, H] with in_dims 1, or wo
            [N, H, D] with in_dims 2.
        in_dims: how many leading axes are contracted.

    Raises:
        ValueError: the output columns are not a multiple of 32, or w is not float32.
    """
    w2, in_shape, out_shape = _as_matrix(w, in_dims)
    k, n = w2.shape
    return Panels(data=w2.reshape(k, n // PANEL, PANEL).transpose(1, 0, 2), out_shape=out_shape, in_shape=in_shape)


def pack_stacked(w: jax.Array, in_dims: int) -> Panels:
    """A stack of L weights, w [L, *in_shape, *out_shape] float32, packed as "f32" panels
    [L, N/32, K, 32] (``in_dims`` counts the contracted axes after L); ``matmul`` multiplies by
    one of them at a time (``Panels.layer``).

    Raises:
        ValueError: as ``pack``.
    """
    first, in_shape, out_shape = _as_matrix(w[0], in_dims)  # checks the shapes and dtype once
    k, n = first.shape
    data = jnp.asarray(w).reshape(w.shape[0], k, n // PANEL, PANEL).transpose(0, 2, 1, 3)
    return Panels(data=data, out_shape=out_shape, in_shape=in_shape)


def unpack(w: Panels) -> jax.Array:
    """The input-major float32 weight ``w`` packs ([L] + in_shape + out_shape for a stack):
    ``pack``'s and ``pack_stacked``'s inverse, exact."""
    lead, (panels, k, _) = w.data.shape[:-3], w.data.shape[-3:]
    matrix = jnp.moveaxis(w.data, -3, -2).reshape(*lead, k, panels * PANEL)
    return matrix.reshape(w.shape)


def matmul(x: jax.Array, w: Panels) -> jax.Array:
    """x @ W by the native kernel (call ``available()`` first); for stacked panels, W is matrix
    ``w.layer`` of the stack.

    Shapes: x [M, K] (cast to float32); returns [M, *w.out_shape] float32.

    Raises:
        ValueError (at trace time): stacked panels without a ``layer``, or one matrix with one.
        XlaRuntimeError (at run time): x's K differs from the panels', or ``layer`` is outside
            [0, L).
    """
    m = x.shape[0]
    stacked = w.data.ndim == 4
    if stacked != (w.layer is not None):
        raise ValueError("stacked panels [L, N/32, K, 32] need a layer index, one matrix none")
    n = w.data.shape[-3] * PANEL
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))
    data, layer = (w.data, w.layer) if stacked else (w.data[None], 0)  # one matrix: L = 1, a reshape
    return call(x.astype(jnp.float32), data, jnp.asarray(layer, jnp.int32)).reshape(m, *w.out_shape)


available = native.available  # whether the kernels are built and registered
