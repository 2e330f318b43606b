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
"""

from __future__ import annotations

import dataclasses
import math

from model.config import LlamaConfig
from model.kv_cache import KVCache
from sharding.layouts import Layout, LayoutError


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

    def weight_bytes_per_device(self, cfg: LlamaConfig, itemsize: int) -> int:
        """Predicted parameter bytes on each device: split weights count 1/model, the rest whole."""
        L, D, N, K, H, F, V = cfg.dims
        tp = self.layout.model
        attn = L * D * H * (2 * N + 2 * K)
        if self.attention == "heads":
            attn //= tp
        mlp = L * 3 * D * F // tp
        vocab = V * D * (1 if cfg.tie_word_embeddings else 2) // tp
        norms = (2 * L + 1) * D
        return (attn + mlp + vocab + norms) * itemsize

    def kv_bytes_per_device(self, cfg: LlamaConfig, num_slots: int, max_len: int, itemsize: int) -> int:
        """Predicted KV-cache bytes on each device: slots split over ``data``, KV heads over
        ``model`` in ``heads`` mode."""
        total = math.prod(KVCache.shape(cfg, num_slots, max_len)) * 2 * itemsize
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
        "cache_len": None,
        "vocab": "model",
        "mlp": "model",
        "q_heads": heads_axis,
        "kv_heads": heads_axis,
        "qkv": None,  # a KV head's group of query heads, its key and its value (wqkv)
        "gate_up": None,  # gate or up (w_gate_up)
        "slots": "data",
        "pages": "data",  # the paged pool: each data replica its own pages (service/paged_engine.py)
    }
    return ShardingPlan(layout=layout, attention=attention, rules=rules)
