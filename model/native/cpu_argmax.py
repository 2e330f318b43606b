"""Greedy decoding's argmax as a native XLA:CPU custom call (``native/first_argmax.cc``).

XLA:CPU (jaxlib 0.10) runs :func:`model.sampling.first_argmax` over a decode step's logits
[S, V] float32 as a single-threaded reduce_max fusion, a select and a reduce-window, many times
slower than one pass over the logits (docs/cpu-kernels.md has the trace). The kernel takes one
row per work item on XLA's intra-op threads: a vectorised max, then the first index holding it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model import native

TARGET = native.FIRST_ARGMAX  # the FFI target (registered by model.native)
available = native.available  # whether the kernels are built and registered


def first_argmax(logits: jax.Array) -> jax.Array:
    """Each row's first index of its largest value, by the native kernel (call ``available()``
    first; CPU only): logits [R, V] float32 -> [R] int32, ``jnp.argmax``'s tie rule; a row
    holding a NaN gives V - 1 (a valid id, as :func:`model.sampling.first_argmax` gives).

    Raises:
        XlaRuntimeError (at run time): logits that are not [R, V] with V >= 1.
    """
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(logits.shape[:1], jnp.int32))
    return call(logits.astype(jnp.float32))
