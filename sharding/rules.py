"""Logical axes -> mesh axes: one mapping gives every weight and the KV cache its NamedSharding.

Megatron-style tensor parallelism (Shoeybi et al. 2019, §3): Q/K/V and gate/up are split over
heads and MLP columns, O and down over rows, the embedding and LM head over the vocabulary, so
each block needs one all-reduce after attention and one after the MLP. The KV cache is split
over KV heads on ``model`` and over slots on ``data``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model.kv_cache import BLOCK_K_AXES, BLOCK_V_AXES, CACHE_AXES, BlockedKVCache, KVCache
from model.paged_kv import PAGE_AXES, PagedKVCache
from sharding.layouts import LayoutError

Rules = Mapping[str, str | None]


def spec_for(axes: tuple[str, ...], shape: tuple[int, ...], rules: Rules, mesh: Mesh, what: str) -> P:
    """PartitionSpec for an array with logical ``axes`` and ``shape``.

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


def param_shardings(abstract_state: nnx.State, mesh: Mesh, rules: Rules) -> Any:
    """A tree of NamedSharding matching ``abstract_state`` (leaves carry ``logical_axes``).

    A parameter in the per-layer form of ``model.llama.unstack_layers`` (a tuple of L arrays
    for logical axes ("layers", ...)) gets the same Variable holding a tuple of L shardings
    over the remaining axes.
    """

    def one(path: tuple[Any, ...], var: nnx.Variable) -> NamedSharding | nnx.Variable:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        axes = var.get_metadata()["logical_axes"]
        value = var.get_value()
        if isinstance(value, tuple):
            return var.replace(
                tuple(
                    NamedSharding(mesh, spec_for(axes[1:], a.shape, rules, mesh, f"parameter {name}[{i}]"))
                    for i, a in enumerate(value)
                )
            )
        return NamedSharding(mesh, spec_for(axes, var.shape, rules, mesh, f"parameter {name}"))

    return jax.tree_util.tree_map_with_path(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def cache_shardings(abstract_cache: KVCache | BlockedKVCache | PagedKVCache, mesh: Mesh, rules: Rules) -> Any:
    """The cache's tree of NamedSharding (same structure as ``abstract_cache``, whose leaves
    need only ``.shape``): [L, S, K, T, H] arrays of a ``KVCache``, the key blocks
    [S, K, H, n] and value blocks [S, K, n, H] of a ``BlockedKVCache``, or the [L, P, K,
    page_size, H] pages of a ``PagedKVCache`` (KV heads over ``model``; pages over ``data``,
    each data replica its own contiguous range, its own pool).

    Raises:
        LayoutError: a split axis (slots or pages over ``data``, KV heads over ``model``) does
            not divide.
    """
    if isinstance(abstract_cache, KVCache):
        one = NamedSharding(mesh, spec_for(CACHE_AXES, tuple(abstract_cache.k.shape), rules, mesh, "KV cache"))
        return KVCache(k=one, v=one)  # type: ignore[arg-type]
    if isinstance(abstract_cache, PagedKVCache):
        pages = NamedSharding(mesh, spec_for(PAGE_AXES, tuple(abstract_cache.k.shape), rules, mesh, "KV pages"))
        return PagedKVCache(k=pages, v=pages)  # type: ignore[arg-type]

    def blocks(layers: Any, axes: tuple[str, ...]) -> Any:
        return tuple(
            tuple(NamedSharding(mesh, spec_for(axes, b.shape, rules, mesh, "KV cache block")) for b in layer)
            for layer in layers
        )

    return BlockedKVCache(
        k_blocks=blocks(abstract_cache.k_blocks, BLOCK_K_AXES), v_blocks=blocks(abstract_cache.v_blocks, BLOCK_V_AXES)
    )


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding (token ids, positions, sampling parameters, logits)."""
    return NamedSharding(mesh, P())
