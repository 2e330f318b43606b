"""Ragged attention over a paged KV cache (``model.paged_kv``): one call attends a flat batch of
query tokens that mixes decode tokens and prefill chunks of several sequences; the XLA path.

Building blocks of the paged engine (issue 19), not yet used by the engine.

A step's metadata, all step inputs (none of it is static but the window):

* ``seq_of_token`` [N] int32: the sequence (row of ``page_tables``) each query token belongs
  to; a value outside [0, B) marks a padding token;
* ``positions`` [N] int32: each token's absolute position in its sequence (its RoPE angle);
  a negative one also marks padding;
* ``page_tables`` [B, max_pages] int32: each sequence's pages in order (``model.paged_kv``);
* ``window_pages`` (static): how many leading pages of a table are read, a bucket the caller
  picks to cover its longest sequence, as today's engine buckets its decode window.

Token n attends to positions 0 .. ``positions[n]`` of its sequence: causal within a prefill
chunk and over everything cached before it. A step writes every token's key and value
(``paged_kv.write_kv`` at ``paged_kv.slot_mapping``'s slots) before attending, so a token's
own key is in the pages when it attends and a chunk's tokens see each other through the
pages. No per-sequence length is needed: what a token may read is fixed by its own position
(vLLM's ``seq_lens``/``kv_lens`` give the same bound for the last token of each sequence).

This path is written for correctness on every backend, not speed: each query token gathers its
sequence's whole window (``window_pages`` pages) and computes scores against all of it, masked
(see ``ragged_paged_attention`` for the cost). The native CPU kernel over pages is issue 19's
next piece.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, as in model.llama: a fully masked (padding) row gives no NaN


def padding_mask(seq_of_token: jax.Array, positions: jax.Array, num_seqs: int) -> jax.Array:
    """[N] bool, True for a real token: ``seq_of_token`` in [0, num_seqs) and a position >= 0."""
    return (seq_of_token >= 0) & (seq_of_token < num_seqs) & (positions >= 0)


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    seq_of_token: jax.Array,
    positions: jax.Array,
    *,
    window_pages: int,
    query_block: int | None = None,
) -> jax.Array:
    """Softmax attention (Vaswani et al. 2017, §3.2.1; grouped KV heads, Ainslie et al. 2023)
    of N ragged query tokens over one layer's pages.

    Args:
        q: [N, K, G, H] queries, already scaled by 1/sqrt(H) (cast to float32).
        k_pages, v_pages: [P, K, page_size, H], the layer's pages (float32 or bfloat16), with
            every real token's own key and value already written (``paged_kv.write_kv``).
        page_tables: [B, max_pages] int32. The entries covering positions 0 .. positions[n]
            of token n's sequence must be its pages; the rest (unused columns, any filler such
            as -1) are clipped into [0, P) and then masked, so never read into a result.
        seq_of_token: [N] int32, each token's sequence; outside [0, B) = padding.
        positions: [N] int32, each token's absolute position; negative = padding. A real
            token's position must be below ``window_pages * page_size``: keys past the window
            are not read (inside jit this cannot be checked; the caller's bucket guarantees it).
        window_pages: static, 1 <= window_pages <= max_pages: the leading pages of each table
            that are gathered.
        query_block: static; None gathers for all N tokens at once, else tokens go through in
            blocks of this many (``lax.map``; N padded to a multiple with padding tokens), which
            bounds the gathered copy to ``query_block`` windows.

    Returns:
        [N, K, G, H] float32; zeros for padding tokens.

    Keys and values are widened exactly to float32 and both products run in float32 at
    ``Precision.HIGHEST`` (TPUs and GPUs would otherwise multiply float32 in bfloat16 or
    TF32 passes), so a bfloat16 cache changes the result only by its rounding of the stored
    keys and values.

    Cost, per call (one layer): each token gathers its sequence's window, 2 x window_pages x
    page_size x K x H elements (keys and values), and computes K x G x window_pages x page_size
    scores, masked past its position. A decode token thus reads what it needs once (rounded up
    to the window); a prefill chunk of n tokens copies its sequence's window n times, and the
    peak memory is N (or ``query_block``) windows. Gathering per token rather than per
    sequence keeps the products batched over tokens with none wasted on other sequences' keys
    (a per-sequence gather would need N x B windows of scores to reach every token's own).

    Raises:
        ValueError: ``window_pages`` outside [1, max_pages], or ``query_block`` below 1.
    """
    N, K, G, H = q.shape
    P, _, page_size, _ = k_pages.shape
    B, max_pages = page_tables.shape
    if not 1 <= window_pages <= max_pages:
        raise ValueError(f"window_pages must be in [1, {max_pages}], got {window_pages}")
    if query_block is not None and query_block < 1:
        raise ValueError(f"query_block must be >= 1, got {query_block}")
    f32 = jnp.float32
    hi = jax.lax.Precision.HIGHEST
    width = window_pages * page_size
    tables = jnp.clip(page_tables[:, :window_pages], 0, P - 1)  # [B, W]: filler entries stay in range
    keys_at = jnp.arange(width, dtype=jnp.int32)

    def attend(qb: jax.Array, sb: jax.Array, pb: jax.Array) -> jax.Array:
        n = qb.shape[0]
        real = padding_mask(sb, pb, B)
        pages = tables[jnp.clip(sb, 0, B - 1)]  # [n, W]
        # [n, W, K, page_size, H] -> [n, K, W * page_size, H]: window position w * page_size + o.
        kw = k_pages[pages].transpose(0, 2, 1, 3, 4).reshape(n, K, width, H).astype(f32)
        vw = v_pages[pages].transpose(0, 2, 1, 3, 4).reshape(n, K, width, H).astype(f32)
        scores = jnp.einsum("nKGH,nKSH->nKGS", qb.astype(f32), kw, precision=hi, preferred_element_type=f32)
        mask = (keys_at[None, :] <= pb[:, None]) & real[:, None]  # [n, S]
        probs = jax.nn.softmax(jnp.where(mask[:, None, None, :], scores, NEG_INF), axis=-1)
        out = jnp.einsum("nKGS,nKSH->nKGH", probs, vw, precision=hi, preferred_element_type=f32)
        return jnp.where(real[:, None, None, None], out, 0.0)

    if query_block is None or query_block >= N:
        return attend(q, seq_of_token, positions)
    blocks = -(-N // query_block)
    pad = blocks * query_block - N
    qp = jnp.pad(q, ((0, pad), (0, 0), (0, 0), (0, 0)))
    sp = jnp.pad(seq_of_token, (0, pad), constant_values=-1)  # padding tokens
    pp = jnp.pad(positions, (0, pad), constant_values=-1)
    out = jax.lax.map(
        lambda xs: attend(*xs),
        (qp.reshape(blocks, query_block, K, G, H), sp.reshape(blocks, query_block), pp.reshape(blocks, query_block)),
    )
    return out.reshape(blocks * query_block, K, G, H)[:N]
