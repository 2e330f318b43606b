"""The native CPU attention backend (``NativeCpuAttention``): both regions of a ragged step
through the custom calls of ``model.native.cpu_paged_attention``, which read each token's pages
in place, only up to its own position.

XLA:CPU runs the XLA backend's per-token windows as gathers and many tiny batched dots, bound by
per-product overhead rather than by memory, and the prefill region's blocks score every key of
the window, the masked upper triangle included; the kernels skip both. Since they never read
past a token's position, the window is irrelevant here: one window bucket, so a step's programs
are one per (decode region, prefill region) and none more as sequences grow.

Runs on one CPU device, where ``model.kernels.choose`` picks it (``supports`` and the kernels
built).
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp

from model.attention.base import AttentionBackend, StepMeta
from model.native import cpu_paged_attention

supports = cpu_paged_attention.supports  # the heads, head_dim and cache dtypes the kernels take
available = cpu_paged_attention.available  # whether the kernels are built and registered


class NativeCpuAttention(AttentionBackend):
    """Decode tokens through ``cpu_paged_attention.paged_attention`` (one work item per token
    and KV head), the prefill region through ``cpu_paged_attention.paged_prefill`` (one per
    block and KV head, the block's queries sharing each key read)."""

    name: ClassVar[str] = "native CPU kernels"
    native: ClassVar[bool] = True

    def attend(
        self,
        q: jax.Array,
        k_pages: jax.Array,
        v_pages: jax.Array,
        layer: jax.Array | int,
        meta: StepMeta,
        window: jax.Array | int = 0,
    ) -> jax.Array:
        D, N = meta.decode_tokens, q.shape[0]
        parts = []
        if D > 0:
            rows, positions = meta.decode_region()
            parts.append(
                cpu_paged_attention.paged_attention(
                    q[:D], k_pages, v_pages, meta.page_tables, rows, positions, layer, window
                )
            )
        if D < N:
            rows, positions = meta.prefill_region()
            parts.append(
                cpu_paged_attention.paged_prefill(
                    q[D:], k_pages, v_pages, meta.page_tables, rows, positions, layer, meta.seq_block, window
                )
            )
        return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

    def window_buckets(self, max_pages: int, min_pages: int) -> list[int]:
        return [max_pages]  # the kernels read up to each token's position, whatever the window
