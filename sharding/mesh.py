"""Build a ``jax.sharding.Mesh`` with axes ``data`` and ``model`` from a layout."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from sharding.layouts import Layout, LayoutError

MESH_AXES = ("data", "model")


def make_mesh(layout: Layout, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, model) mesh over the first ``layout.num_devices`` of ``devices``.

    Both axes are ``AxisType.Auto``: the model code names logical axes only and the jitted steps
    carry explicit ``in_shardings``/``out_shardings``, so the partitioner (Shardy) propagates
    shardings through the body. Explicit axes (the default of ``jax.make_mesh`` since JAX 0.9)
    would require an ``out_sharding=`` on every contraction over a sharded dimension, putting
    layout decisions back into the model code.

    Raises:
        LayoutError: fewer devices than the layout needs.
    """
    devices = list(devices if devices is not None else jax.devices())
    need = layout.num_devices
    if len(devices) < need:
        raise LayoutError(
            f"layout {layout.name!r} needs {need} devices (data {layout.data} x model {layout.model}), "
            f"but only {len(devices)} are present"
        )
    return jax.make_mesh(
        (layout.data, layout.model), MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto), devices=devices[:need]
    )
