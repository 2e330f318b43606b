"""The attention seam: one entry point through which the model's forward pass attends, and the
small pytree of step metadata it reads.

A ragged step (``model.llama.ragged_step``) runs a flat batch of N query tokens that mixes decode
tokens and prefill chunks of several sequences over the paged KV cache
(``model.attention.pages``). Each layer first writes the step's new keys and values into the
pages (``pages.write_kv`` at ``StepMeta.slots``), then calls its backend's ``attend``, which
reads the pages and returns the attention output of every token. Token n attends positions
0 .. ``positions[n]`` of its sequence: causal within a prefill chunk and over everything cached
before it, so no per-sequence length is needed.

The flat batch has two regions (``StepMeta``): tokens [0, decode_tokens) attend each on its own
(decode tokens), tokens [decode_tokens, N) come in blocks of ``seq_block`` consecutive tokens of
one sequence (prefill chunks, each starting at a block boundary), so a backend may read a
sequence's keys once per block. Backends (the protocol of mini-sglang's ``attention/base.py``):

* ``model.attention.xla.XlaAttention``: XLA's gathers and dots, every backend and mesh; the
  reference. It gathers a window of ``window_pages`` pages per token (decode) or per block
  (prefill), so the caller buckets the window to cover the step's longest sequence.
* ``model.attention.cpu.NativeCpuAttention``: the native CPU kernels, reading each token's pages
  in place up to its own position (one CPU device; ``model.kernels.choose``).

``window_buckets`` is how a backend says what shapes it wants compiled: XLA's a power-of-two
ladder of windows, the native one a single window (it ignores the window).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from model.attention.pages import slot_mapping


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepMeta:
    """One ragged step's attention metadata: page tables and per-token facts (traced arrays),
    and the region geometry (static: part of the compiled program's shape).

    Attributes:
        page_tables: [B, max_pages] int32, each sequence's pages in order (unused entries any
            value, e.g. 0).
        rows: [N] int32, each token's row of ``page_tables``; outside [0, B) marks padding.
        positions: [N] int32, each token's absolute position; negative marks padding.
        slots: [N] int32, each token's flat cache slot (``pages.slot_mapping``); -1 for padding.
        window_pages: static, in [1, max_pages]: the leading pages of each table a windowed
            backend reads; must cover every real token's position.
        decode_tokens: static, in [0, N]: tokens [0, decode_tokens) attend each on its own,
            tokens [decode_tokens, N) in blocks of ``seq_block`` (the caller's promise: every
            block's real tokens belong to one sequence; a real token of another sequence than its
            block's first is attended as padding, zeros).
        seq_block: static, >= 1: tokens per block of the prefill region.
    """

    page_tables: jax.Array
    rows: jax.Array
    positions: jax.Array
    slots: jax.Array
    window_pages: int = dataclasses.field(metadata={"static": True})
    decode_tokens: int = dataclasses.field(metadata={"static": True})
    seq_block: int = dataclasses.field(metadata={"static": True})

    @classmethod
    def build(
        cls,
        page_tables: jax.Array,
        rows: jax.Array,
        positions: jax.Array,
        page_size: int,
        *,
        window_pages: int,
        decode_tokens: int | None = None,
        seq_block: int = 1,
    ) -> StepMeta:
        """The metadata of N tokens, their slots computed (``pages.slot_mapping``).

        Args:
            page_tables, rows, positions: as the attributes.
            page_size: positions per page of the cache.
            window_pages, seq_block: as the attributes.
            decode_tokens: as the attribute; None = N (every token on its own).

        Raises:
            ValueError: ``window_pages`` outside [1, max_pages], ``decode_tokens`` outside
                [0, N], or ``seq_block`` below 1.
        """
        N = rows.shape[0]
        decode_tokens = N if decode_tokens is None else decode_tokens
        if not 0 <= decode_tokens <= N:
            raise ValueError(f"decode_tokens must be in [0, {N}], got {decode_tokens}")
        if seq_block < 1:
            raise ValueError(f"seq_block must be >= 1, got {seq_block}")
        if not 1 <= window_pages <= page_tables.shape[1]:
            raise ValueError(f"window_pages must be in [1, {page_tables.shape[1]}], got {window_pages}")
        rows, positions = jnp.asarray(rows, jnp.int32), jnp.asarray(positions, jnp.int32)
        return cls(
            page_tables=page_tables,
            rows=rows,
            positions=positions,
            slots=slot_mapping(page_tables, rows, positions, page_size),
            window_pages=window_pages,
            decode_tokens=decode_tokens,
            seq_block=seq_block,
        )

    def decode_region(self) -> tuple[jax.Array, jax.Array]:
        """(rows, positions) of tokens [0, decode_tokens)."""
        return self.rows[: self.decode_tokens], self.positions[: self.decode_tokens]

    def prefill_region(self) -> tuple[jax.Array, jax.Array]:
        """(rows, positions) of tokens [decode_tokens, N)."""
        return self.rows[self.decode_tokens :], self.positions[self.decode_tokens :]


class AttentionBackend(abc.ABC):
    """How a layer attends over the paged cache. ``name``: for the engine's logs; ``native``:
    whether it runs native kernels (for the benchmarks' reports; what a backend changes in the
    compiled steps is its ``window_buckets``)."""

    name: ClassVar[str]
    native: ClassVar[bool] = False

    @abc.abstractmethod
    def attend(
        self,
        q: jax.Array,
        k_pages: jax.Array,
        v_pages: jax.Array,
        layer: jax.Array | int,
        meta: StepMeta,
        window: jax.Array | int = 0,
    ) -> jax.Array:
        """Softmax attention (Vaswani et al. 2017, §3.2.1; grouped KV heads, Ainslie et al. 2023)
        of the step's N tokens over layer ``layer`` of the stacked pages.

        Args:
            q: [N, K, G, H] queries, already scaled (``LlamaConfig.query_scale``).
            k_pages, v_pages: [L, P, K, page_size, H], every real token's own key and value
                already written (float32 or bfloat16).
            layer: the layer read, an int32 scalar (traced in a scan) or an int.
            meta: the step's ``StepMeta``.
            window: the layer's sliding window, an int32 scalar (may be traced) or an int: a
                token at position p attends p - window + 1 .. p only (Beltagy et al. 2020,
                "Longformer", §3.1, causal); 0 = every position 0 .. p.

        Returns:
            [N, K, G, H] float32; zeros for padding tokens.
        """

    @abc.abstractmethod
    def window_buckets(self, max_pages: int, min_pages: int) -> list[int]:
        """The ``window_pages`` values the engine compiles steps for, ascending, the last
        ``max_pages``; ``min_pages``: the smallest window worth a program of its own."""


def power_of_two_buckets(smallest: int, largest: int) -> list[int]:
    """Powers of two from ``smallest`` while below ``largest``, then ``largest`` itself."""
    out, b = [], max(1, smallest)
    while b < largest:
        out.append(b)
        b *= 2
    out.append(largest)
    return out
