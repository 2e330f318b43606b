"""Logical axes -> mesh axes: one mapping gives every weight and the KV cache its NamedSharding.

Megatron-style tensor parallelism (Shoeybi et al. 2019, §3): Q/K/V and gate/up are split over
heads and MLP columns, O and down over rows, the embedding and LM head over the vocabulary, so
each block needs one all-reduce after attention and one after the MLP. The paged KV cache is
split over KV heads on ``model`` and over pages on ``data``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model.attention.pages import PAGE_AXES, PagedKVCache
from model.native.cpu_matmul import Panels
from model.weights.quant_panels import QuantPanels
from sharding.layouts import LayoutError

Rules = Mapping[str, str | None]


def spec_for(axes: tuple[str, ...], shape: tuple[int, ...], rules: Rules, mesh: Mesh | AbstractMesh, what: str) -> P:
    """PartitionSpec for an array with logical ``axes`` and ``shape`` on ``mesh`` (a ``Mesh``, or
    an ``AbstractMesh`` of its axis sizes, as ``sharding.plan`` prices a layout with).

    Raises:
        LayoutError: a sharded dimension is not divisible by its mesh axis (JAX rejects uneven
            shardings at jit boundaries); the message names the array, the axis and the sizes.
    """
    spec = []
    for axis, dim in zip(axes, shape, strict=True):
        mesh_axis = rules.get(axis)
        if mesh_axis is not None:
            size = mesh.shape[mesh_axis]
            if dim % size:
                raise LayoutError(
                    f"{what}: logical axis {axis!r} of size {dim} cannot be split over mesh axis "
                    f"{mesh_axis!r} of size {size}"
                )
        spec.append(mesh_axis)
    return P(*spec)


def block_axis(axes: tuple[str, ...], size: int, rules: Rules, mesh: Mesh | AbstractMesh) -> str | None:
    """The mesh axis for a ``QuantPanels`` axis of ``size`` panels or blocks that flattens the
    weight's logical ``axes`` (its outputs, or its inputs) in units of 32: the mesh axis of the
    first of ``axes`` when it is the only one split and it divides ``size`` (a contiguous split
    of the flat axis is then the split of that axis: whole heads, whole MLP columns), else None
    (replicated: the split would cut across the first axis, e.g. gate/up's (gate_up, mlp))."""
    split = tuple(a for a in axes if rules.get(a) is not None)
    if not split or split != axes[:1]:
        return None
    mesh_axis = rules[split[0]]
    assert mesh_axis is not None  # split holds the axes with a rule
    return mesh_axis if size % mesh.shape[mesh_axis] == 0 else None


def quant_shardings(axes: tuple[str, ...], value: QuantPanels, mesh: Mesh | AbstractMesh, rules: Rules) -> QuantPanels:
    """NamedShardings for the arrays of a ``QuantPanels`` parameter with logical ``axes`` (the
    float weight's: ("layers", *inputs, *outputs), or the embedding's ("vocab", "embed"), which
    the panels hold transposed): the panel axis follows the outputs, the block axis the inputs
    (``block_axis``), the layer axis and the 32-wide axes are not split."""
    n_out = len(value.out_shape)
    ins: tuple[str, ...]
    outs: tuple[str, ...]
    lead: tuple[str, ...]
    if axes == ("vocab", "embed"):  # the embedding table [V, D] as W = table.T [D, V]
        ins, outs, lead = ("embed",), ("vocab",), ()
    else:
        lead = axes[:1] if axes[:1] == ("layers",) and value.codes.ndim == 5 else ()
        ins, outs = axes[len(lead) : len(axes) - n_out], axes[len(axes) - n_out :]
    p, kb = value.codes.shape[-4], value.codes.shape[-3]
    panel, block = block_axis(outs, p, rules, mesh), block_axis(ins, kb, rules, mesh)
    head = (None,) * len(lead)
    codes = NamedSharding(mesh, P(*head, panel, block, None, None))
    scales = NamedSharding(mesh, P(*head, panel, block, None))
    return dataclasses.replace(
        value,
        codes=codes,
        scales=None if value.scales is None else scales,  # the record formats have none
        mins=None if value.mins is None else scales,
    )  # type: ignore[arg-type]


def param_shardings(abstract_state: nnx.State, mesh: Mesh, rules: Rules) -> Any:
    """A tree of NamedSharding matching ``abstract_state`` (leaves carry ``logical_axes``).

    A parameter in the per-layer form of ``model.llama.unstack_layers`` (a tuple of L arrays
    for logical axes ("layers", ...)) gets the same Variable holding a tuple of L shardings
    over the remaining axes. A parameter held as GGUF blocks (``QuantPanels``) gets a
    ``QuantPanels`` of shardings (``quant_shardings``). Float32 weights packed into panels for
    the native CPU kernel (``Panels``, held on one CPU device only) are replicated.
    """

    def one(path: tuple[Any, ...], var: nnx.Variable) -> NamedSharding | nnx.Variable:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        axes = var.get_metadata()["logical_axes"]
        value = var.get_value()
        if isinstance(value, QuantPanels):
            return var.replace(quant_shardings(axes, value, mesh, rules))
        if isinstance(value, Panels):
            return var.replace(dataclasses.replace(value, data=NamedSharding(mesh, P())))
        if isinstance(value, tuple):
            return var.replace(
                tuple(
                    quant_shardings(axes[1:], a, mesh, rules)
                    if isinstance(a, QuantPanels)
                    else NamedSharding(mesh, spec_for(axes[1:], a.shape, rules, mesh, f"parameter {name}[{i}]"))
                    for i, a in enumerate(value)
                )
            )
        return NamedSharding(mesh, spec_for(axes, var.shape, rules, mesh, f"parameter {name}"))

    return jax.tree_util.tree_map_with_path(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def cache_shardings(abstract_cache: PagedKVCache, mesh: Mesh, rules: Rules) -> PagedKVCache:
    """The cache's NamedShardings (same structure as ``abstract_cache``, whose leaves need only
    ``.shape``): the [L, P, K, page_size, H] pages of a ``PagedKVCache``, KV heads over
    ``model``, pages over ``data`` (each data replica its own contiguous range, its own pool).

    Raises:
        LayoutError: a split axis (pages over ``data``, KV heads over ``model``) does not divide.
    """
    pages = NamedSharding(mesh, spec_for(PAGE_AXES, tuple(abstract_cache.k.shape), rules, mesh, "KV pages"))
    return PagedKVCache(k=pages, v=pages)  # type: ignore[arg-type]


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding (token ids, positions, sampling parameters, logits)."""
    return NamedSharding(mesh, P())
