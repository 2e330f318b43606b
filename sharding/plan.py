"""A layout resolved against one model: attention mode, rule table, predicted bytes per device.

Head counts that tensor parallelism does not divide (SmolLM2: 9 query / 3 KV heads, so only
model-axis sizes 1 and 3 split heads evenly; JAX rejects uneven shardings at jit boundaries)
are handled here, once, at startup:

* ``heads`` — Megatron attention (Shoeybi et al. 2019, §3): Q/K/V column-split and O row-split
  over heads, the KV cache split over KV heads. Two all-reduces per layer (after O, after
  down). Valid only when ``model`` divides both head counts.
* ``replicated`` — attention weights and the KV cache whole on every ``model`` device, MLP and
  vocabulary still split. One all-reduce per layer (after down). Exact for any ``model``;
  costs the attention weights (and KV cache) once per device, which for SmolLM2 is 53 MB of
  float32 attention weights — cheap at small batch, the latency regime (jax-llm-examples'
  Nemotron-3 leaves KV heads unsharded for the same reason).
* ``auto`` — ``heads`` if valid, else ``replicated``.

An explicit ``heads`` request that cannot work fails here with the head counts and the valid
sizes, never on the first request.

Weight bytes per device (``param_bytes_per_device``) are priced by the placement code itself:
the parameter's shardings from ``sharding.rules`` on an abstract mesh of the layout's shape, so a
prediction is what ``service.engine.runner.bytes_per_device`` measures once the weights are
placed, for float weights and for weights held as GGUF blocks
(``model.weights.quant_panels.QuantPanels``,
whose arrays split differently from the float weight's: ``sharding.rules.quant_shardings``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from model.config import LlamaConfig, kv_row_bytes
from model.weights import block_params
from model.weights.build import abstract_llama
from sharding.layouts import Layout, LayoutError
from sharding.mesh import MESH_AXES
from sharding.rules import Rules, quant_shardings, spec_for


def head_split_sizes(cfg: LlamaConfig, limit: int = 64) -> list[int]:
    """Model-axis sizes up to ``limit`` that divide both the query and the KV head counts."""
    return [n for n in range(1, limit + 1) if cfg.num_heads % n == 0 and cfg.num_kv_heads % n == 0]


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """A layout plus the decisions it implies for one model.

    Attributes:
        layout: the requested layout.
        attention: the resolved mode, ``"heads"`` or ``"replicated"``.
        rules: logical axis -> mesh axis (None = replicated).
    """

    layout: Layout
    attention: str
    rules: dict[str, str | None]

    @property
    def all_reduces_per_layer(self) -> int:
        """All-reduces over ``model`` in one decoder block of the decode step (0 without TP)."""
        if self.layout.model == 1:
            return 0
        return 2 if self.attention == "heads" else 1

    def weight_bytes_per_device(self, cfg: LlamaConfig, itemsize: int, formats: Mapping[str, str] | None = None) -> int:
        """Predicted parameter bytes on each device (the sum of ``param_bytes``): float weights
        split over ``model`` count 1/model, the rest whole; weights held as blocks as
        ``quant_shardings`` splits them."""
        return sum(self.param_bytes(cfg, itemsize, formats).values())

    def param_bytes(self, cfg: LlamaConfig, itemsize: int, formats: Mapping[str, str] | None = None) -> dict[str, int]:
        """Predicted bytes of each parameter on each device of this layout's mesh.

        Args:
            cfg: the model.
            itemsize: bytes per element of the float parameters (4 float32, 2 bfloat16).
            formats: the parameters held as GGUF blocks, by name -> format ({"wqkv": "q4_1",
                "embed": "q8_0", ...}, as ``service.server.startup.stored_formats`` and
                ``ModelInfo.weight_formats`` name them); None or {}: every weight float.

        Returns:
            {parameter name ("wqkv", "attn_norm", "embed", ...): bytes on each device}. Every
            device of a mesh holds the same bytes: nothing is split over ``data``.

        Raises:
            ValueError: a format is unknown, names a parameter that is not a matmul weight, or
                one whose widths are not whole 32-blocks.
        """
        mesh = AbstractMesh((self.layout.data, self.layout.model), MESH_AXES)
        formats = formats or {}
        unknown = set(formats) - {path.rsplit("/", 1)[-1] for path, _, _ in model_params(cfg)}
        if unknown:
            raise ValueError(f"formats name parameters the model does not have: {sorted(unknown)}")
        out = {}
        for path, axes, shape in model_params(cfg):
            name = path.rsplit("/", 1)[-1]
            out[name] = param_bytes_per_device(path, axes, shape, formats.get(name, itemsize), mesh, self.rules)
        return out

    def kv_bytes_per_device(self, cfg: LlamaConfig, tokens: int, kv_dtype: str) -> int:
        """Predicted bytes on each device of a KV pool of ``tokens`` positions (keys and values
        of every layer, rows in ``kv_dtype``: ``model.config.kv_row_bytes``): pages split over
        ``data``, KV heads over ``model`` in ``heads`` mode."""
        total = 2 * cfg.num_layers * tokens * cfg.num_kv_heads * kv_row_bytes(cfg.head_dim, kv_dtype)
        split = self.layout.data * (self.layout.model if self.attention == "heads" else 1)
        return total // split


def make_plan(layout: Layout, cfg: LlamaConfig, num_slots: int | None = None) -> ShardingPlan:
    """Resolve ``layout`` for ``cfg`` and check every split divides.

    Raises:
        LayoutError: ``attention: heads`` with a model axis that does not divide the head counts
            (the message names both head counts and the valid sizes), a vocabulary or MLP width
            the model axis does not divide, or a slot count the data axis does not divide.
    """
    tp = layout.model
    valid = head_split_sizes(cfg)
    heads_ok = tp in valid
    if layout.attention == "heads" and not heads_ok:
        raise LayoutError(
            f"layout {layout.name!r}: attention 'heads' needs the model axis ({tp}) to divide "
            f"{cfg.num_heads} query heads and {cfg.num_kv_heads} KV heads; valid model-axis sizes "
            f"are {{{', '.join(map(str, valid))}}}. Use attention 'replicated' or 'auto' to keep "
            f"attention whole on each device and split only the MLP and vocabulary."
        )
    attention = "heads" if layout.attention == "heads" or (layout.attention == "auto" and heads_ok) else "replicated"
    for what, size in (("vocabulary", cfg.vocab_size), ("MLP width", cfg.intermediate_size)):
        if size % tp:
            raise LayoutError(f"layout {layout.name!r}: the model axis ({tp}) does not divide the {what} ({size})")
    if num_slots is not None and num_slots % layout.data:
        raise LayoutError(
            f"layout {layout.name!r}: the data axis ({layout.data}) must divide the number of slots ({num_slots})"
        )
    heads_axis = "model" if attention == "heads" else None
    rules: dict[str, str | None] = {
        "layers": None,
        "embed": None,
        "head_dim": None,
        "vocab": "model",
        "mlp": "model",
        "q_heads": heads_axis,
        "kv_heads": heads_axis,
        "qkv": None,  # a KV head's group of query heads, its key and its value (wqkv)
        "gate_up": None,  # gate or up (w_gate_up)
        "pages": "data",  # the paged pool: each data replica its own pages (service/engine/runner.py)
    }
    return ShardingPlan(layout=layout, attention=attention, rules=rules)


@functools.cache
def model_params(cfg: LlamaConfig) -> tuple[tuple[str, tuple[str, ...], tuple[int, ...]], ...]:
    """(path, logical axes, float shape) of every parameter of ``model.llama.Llama(cfg)`` in its
    stacked form ("layers/wqkv": ("layers", "embed", "kv_heads", "qkv", "head_dim"),
    [L, D, K, G + 2, H]; "embed": ("vocab", "embed"), [V, D]; ...), read from the module's
    abstract state (allocates nothing)."""
    _, state = abstract_llama(cfg)
    leaves = jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return tuple(
        (
            "/".join(str(getattr(k, "key", k)) for k in path),
            tuple(var.get_metadata()["logical_axes"]),
            tuple(int(d) for d in var.get_value().shape),
        )
        for path, var in leaves
    )


def param_bytes_per_device(
    path: str,
    axes: tuple[str, ...],
    shape: tuple[int, ...],
    storage: int | str,
    mesh: Mesh | AbstractMesh,
    rules: Rules,
) -> int:
    """Bytes one parameter takes on each device of ``mesh`` when placed with ``rules``.

    Args:
        path: the parameter's path in the state ("layers/wqkv", "embed", "final_norm", ...).
        axes: its logical axes (``model.llama``'s ``logical_axes``).
        shape: its float shape ([L, D, K, G + 2, H] for "layers/wqkv").
        storage: an int: a float array of that itemsize (bytes per element); or a block format
            (``model.weights.quant_panels.FORMATS``): the parameter held as ``QuantPanels`` of that
            format (``model.weights.block_params.abstract_panels``: int8/uint8 codes and float16
            scales, plus float16 minimums for Q4_1, 34, 18 and 20 bytes per 32 weights; or a record
            format's uint8 records), split as
            ``sharding.rules.quant_shardings`` splits them (panels over the outputs' first axis,
            blocks over the inputs' first axis, where it is the only split one and divides; else
            replicated).
        mesh: a ``Mesh``, or an ``AbstractMesh`` of the same axis sizes (only the sizes matter).
        rules: logical axis -> mesh axis (``ShardingPlan.rules``).

    Returns:
        Bytes on each device (every device holds the same: JAX splits only evenly).

    Raises:
        ValueError: an unknown block format, or a parameter that cannot be held as blocks
            (``block_params.abstract_panels``).
        LayoutError: a float parameter's split axis does not divide (``spec_for``).
    """
    if isinstance(storage, str):
        panels = block_params.abstract_panels(path, shape, storage)
        shardings = quant_shardings(axes, panels, mesh, rules)
        pairs: tuple[tuple[Any, Any], ...] = (
            (panels.codes, shardings.codes),
            (panels.scales, shardings.scales),  # None for the record formats
            (panels.mins, shardings.mins),  # Q4_1's minimums, split as the scales
        )
        return sum((_shard_bytes(tuple(a.shape), a.dtype.itemsize, s) for a, s in pairs if a is not None), 0)
    sharding = NamedSharding(mesh, spec_for(axes, shape, rules, mesh, f"parameter {path}"))
    return _shard_bytes(shape, storage, sharding)


def _shard_bytes(shape: tuple[int, ...], itemsize: int, sharding: NamedSharding) -> int:
    """Bytes of one device's shard of a [shape] array of ``itemsize``-byte elements."""
    return math.prod(sharding.shard_shape(shape)) * itemsize
