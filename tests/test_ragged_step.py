"""``model.llama.ragged_step`` (a flat batch of decode tokens and prefill chunks over a paged cache)
on the tiny random model, against the cache-less dense reference forward (``reference.py``) and
against the same sequences run alone, through each attention backend (XLA's, and the native CPU
kernels where they are built).

The flat batches are built by ``flat_batch``: decode tokens and a padding token first, then the
prefill chunks. With ``block`` set, the chunks go to the blocked region (``decode_tokens``), each
starting at a block boundary and padded to whole blocks with padding tokens of every kind (the
layout ``ragged_step`` asks of the caller); without it, every token, padding included, is shuffled
(any order is allowed when every token attends on its own); then padding up to a multiple of 16
tokens. Page tables are drawn scattered over the pool (``Pool``), in random order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from reference import dense_kv, dense_logits

from model.attention import cpu as cpu_attention
from model.attention.base import AttentionBackend, StepMeta
from model.attention.pages import PagedKVCache, from_stored
from model.attention.xla import XlaAttention
from model.config import LlamaConfig
from model.llama import ragged_step, unstack_layers
from model.weights.build import random_llama

CFG = LlamaConfig.tiny()
GRAPHDEF, PARAMS = random_llama(CFG, seed=0)
TOL: dict = dict(rtol=1e-5, atol=1e-5)
NATIVE = jax.devices()[0].platform == "cpu" and cpu_attention.available()
BACKENDS = [XlaAttention()] + ([cpu_attention.NativeCpuAttention()] if NATIVE else [])


def _ragged(params, cache, tokens, positions, seq, tables, last, window_pages, prefill_from, seq_block, attention):  # type: ignore[no-untyped-def]
    model = nnx.merge(GRAPHDEF, params)
    meta = StepMeta.build(
        tables, seq, positions, cache.page_size, window_pages=window_pages, decode_tokens=prefill_from,
        seq_block=seq_block,
    )  # fmt: skip
    return ragged_step(model, cache, tokens, meta, last, attention)


RAGGED = jax.jit(_ragged, static_argnames=("window_pages", "prefill_from", "seq_block", "attention"), donate_argnums=1)


def dense(ids: np.ndarray) -> np.ndarray:
    """The reference's logits [len(ids), V] of one sequence."""
    return dense_logits(GRAPHDEF, PARAMS, np.asarray(ids, np.int32))


@dataclasses.dataclass
class Pool:
    """A paged cache and page tables for ``rows`` sequences of up to ``max_pages`` pages each,
    drawn without repetition from a shuffled pool (so scattered and out of order)."""

    cache: PagedKVCache
    tables: np.ndarray  # [rows, max_pages] int32

    @classmethod
    def make(
        cls, rows: int, max_pages: int, page_size: int, seed: int = 0, dtype: jnp.dtype = jnp.float32, spare: int = 5
    ) -> Pool:
        num_pages = rows * max_pages + spare
        perm = np.random.default_rng([seed, page_size]).permutation(num_pages)
        tables = perm[: rows * max_pages].reshape(rows, max_pages).astype(np.int32)
        return cls(PagedKVCache.zeros(CFG, num_pages, page_size, dtype), tables)

    def step(self, batch: Batch, window_pages: int, attention: AttentionBackend = BACKENDS[0]) -> np.ndarray:
        """One ``ragged_step`` over ``batch``; updates the cache, returns logits [rows, V]."""
        logits, self.cache = RAGGED(
            PARAMS, self.cache, batch.tokens, batch.positions, batch.seq, self.tables, batch.last,
            window_pages, batch.prefill_from, batch.block, attention,
        )  # fmt: skip
        return np.asarray(logits)


@dataclasses.dataclass
class Batch:
    tokens: np.ndarray
    positions: np.ndarray
    seq: np.ndarray
    last: np.ndarray  # [rows] int32
    prefill_from: int | None
    block: int


def flat_batch(
    rows: int,
    decode: list[tuple[int, int, int]],
    chunks: list[tuple[int, np.ndarray, int]],
    block: int | None = None,
    seed: int = 0,
    bucket: int = 16,
) -> Batch:
    """A flat batch: ``decode`` (row, token id, position) and ``chunks`` (row, ids, start
    position); ``last[row]`` = the index of the row's highest position (0 for a row with no token).
    ``block``: decode tokens and one padding token in the per-token region, then each chunk at a
    block boundary of the blocked region, its last block filled with padding; None: everything
    shuffled, three padding tokens among it. Then padding up to a multiple of ``bucket`` tokens
    (as an engine buckets N; fewer shapes to compile)."""
    toks: list[tuple[int, int, int]] = [(r, t, p) for r, t, p in decode]  # (row, id, position)
    fillers = [(-1, 0, 3), (rows, 0, 0), (0, 0, -1)]  # padding: seq below, seq at B, negative position
    if block is None:
        toks += [(r, int(t), s + i) for r, ids, s in chunks for i, t in enumerate(ids)] + fillers
        order = np.random.default_rng(seed).permutation(len(toks))
        toks = [toks[i] for i in order]
        prefill_from = None
    else:
        toks.append(fillers[0])
        prefill_from = len(toks)
        for r, ids, s in chunks:
            toks += [(r, int(t), s + i) for i, t in enumerate(ids)]
            k = 0
            while (len(toks) - prefill_from) % block:
                toks.append(fillers[k % 3])
                k += 1
    while len(toks) % bucket:
        toks.append(fillers[len(toks) % 3])
    seq = np.array([r for r, _, _ in toks], np.int32)
    tokens = np.array([t for _, t, _ in toks], np.int32)
    positions = np.array([p for _, _, p in toks], np.int32)
    last = np.zeros(rows, np.int32)
    for r in range(rows):
        mine = np.flatnonzero((seq == r) & (positions >= 0))
        if len(mine):
            last[r] = mine[np.argmax(positions[mine])]
    return Batch(tokens, positions, seq, last, prefill_from, block or 1)


def ids_of(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, n).astype(np.int32)


# ---- (a) one prompt ------------------------------------------------------------------------
@pytest.mark.parametrize("attention", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("block", [None, 8], ids=["per-token", "blocks-of-8"])
def test_one_prompt_matches_the_dense_reference(block: int | None, attention: AttentionBackend) -> None:
    """20 tokens of one prompt in one flat batch: the last position's logits are the dense
    reference's, and the pages hold every layer's keys and values the reference computes."""
    ids = ids_of(1, 20)
    pool = Pool.make(rows=1, max_pages=3, page_size=8)
    logits = pool.step(flat_batch(1, [], [(0, ids, 0)], block), window_pages=3, attention=attention)
    np.testing.assert_allclose(logits[0], dense(ids)[-1], **TOL)

    k, v = np.asarray(pool.cache.k), np.asarray(pool.cache.v)  # [L, P, K, ps, H]
    pages, offsets = pool.tables[0, np.arange(20) // 8], np.arange(20) % 8
    ref_k, ref_v = dense_kv(GRAPHDEF, PARAMS, ids)  # [L, 20, K, H]
    np.testing.assert_allclose(k[:, pages, :, offsets].transpose(1, 0, 2, 3), ref_k, **TOL)
    np.testing.assert_allclose(v[:, pages, :, offsets].transpose(1, 0, 2, 3), ref_v, **TOL)


# ---- (b) a mixed batch ---------------------------------------------------------------------
# Rows: 0 a prompt of 13 whose first 8 tokens an earlier step wrote (its later chunk here);
# 1 a prompt of 11, first chunk here; 2 and 3 decode tokens after prompts of 9 and 17.
PROMPTS = {0: ids_of(10, 13), 1: ids_of(11, 11), 2: ids_of(12, 9), 3: ids_of(13, 17)}
DECODED = {2: 77, 3: 5}  # the decode tokens of rows 2 and 3
FIRST_CHUNK_0 = 8
WINDOW_POSITIONS = 32  # covers every position of the scenario (at most 17); whole pages of 1, 8 and 16


def mixed_scenario(
    page_size: int, block: int | None, seed: int = 0, attention: AttentionBackend = BACKENDS[0]
) -> np.ndarray:
    """Step 1: row 0's first chunk and rows 2, 3's prompts; step 2 (the mixed batch): row 0's
    later chunk, row 1's prompt, rows 2, 3's decode tokens. Returns step 2's logits [4, V]."""
    wp = WINDOW_POSITIONS // page_size
    pool = Pool.make(rows=4, max_pages=wp + 1, page_size=page_size, seed=seed)
    first = [(0, PROMPTS[0][:FIRST_CHUNK_0], 0), (2, PROMPTS[2], 0), (3, PROMPTS[3], 0)]
    pool.step(flat_batch(4, [], first, block, seed), wp, attention)
    decode = [(r, DECODED[r], len(PROMPTS[r])) for r in (2, 3)]
    chunks = [(0, PROMPTS[0][FIRST_CHUNK_0:], FIRST_CHUNK_0), (1, PROMPTS[1], 0)]
    return pool.step(flat_batch(4, decode, chunks, block, seed + 1), wp, attention)


def alone(row: int, page_size: int = 8) -> np.ndarray:
    """Row ``row``'s sequence through its own ragged steps (one row, nothing else in the batch):
    its logits after the tokens the mixed scenario gives it."""
    wp = WINDOW_POSITIONS // page_size
    pool = Pool.make(rows=1, max_pages=wp + 1, page_size=page_size, seed=row + 7)
    ids = PROMPTS[row]
    if row == 0:
        pool.step(flat_batch(1, [], [(0, ids[:FIRST_CHUNK_0], 0)]), wp)
        return pool.step(flat_batch(1, [], [(0, ids[FIRST_CHUNK_0:], FIRST_CHUNK_0)]), wp)[0]
    logits = pool.step(flat_batch(1, [], [(0, ids, 0)]), wp)[0]
    if row in DECODED:
        logits = pool.step(flat_batch(1, [(0, DECODED[row], len(ids))], []), wp)[0]
    return logits


@pytest.fixture(scope="module")
def alone_logits() -> np.ndarray:
    return np.stack([alone(r) for r in range(4)])


# The shuffled per-token layout (block None) is XLA's only: the native prefill kernel reads blocks.
MIXED_CASES = [(b, a) for a in BACKENDS for b in (None, 4, 16) if b is not None or not a.native]


@pytest.mark.parametrize(("block", "attention"), MIXED_CASES, ids=lambda x: getattr(x, "name", f"block-{x}"))
def test_a_mixed_batch_gives_each_row_what_it_gets_alone(
    block: int | None, attention: AttentionBackend, alone_logits: np.ndarray
) -> None:
    """Two prompts' chunks (one a later chunk) and two decode tokens in one flat batch: each
    row's logits are those of its sequence run alone, in the per-token layout (shuffled) and in
    the blocked one (chunks at block boundaries; 4 splits both chunks over blocks, 16 holds each
    in one)."""
    mixed = mixed_scenario(page_size=8, block=block, attention=attention)
    np.testing.assert_allclose(mixed, alone_logits, **TOL)


def test_alone_matches_the_dense_reference(alone_logits: np.ndarray) -> None:
    """The rows run alone (row 0 in two chunks, rows 2 and 3 a decode token after their prompt)
    agree with the dense reference over each sequence: the reference of the mixed test is
    itself right."""
    ref = []
    for row in range(4):
        seq = list(PROMPTS[row]) + ([DECODED[row]] if row in DECODED else [])
        ref.append(dense(np.asarray(seq))[-1])
    np.testing.assert_allclose(alone_logits, np.stack(ref), **TOL)


# ---- (c) greedy generation -----------------------------------------------------------------
GREEDY_PROMPTS = [ids_of(20, 5), ids_of(21, 12), ids_of(22, 9)]
NEW_TOKENS = 8


def greedy_ragged(page_size: int, dtype: jnp.dtype = jnp.float32, block: int | None = 8) -> tuple[list, np.ndarray]:
    """Greedy generation of ``NEW_TOKENS`` for the three prompts through ``ragged_step``: one
    step with the three prompts, then one decode token per sequence per step, fed back.
    Returns (the generated ids per sequence, the logits of every step [steps, 3, V])."""
    wp = 32 // page_size
    pool = Pool.make(rows=3, max_pages=wp, page_size=page_size, dtype=dtype)
    logits = pool.step(flat_batch(3, [], [(r, p, 0) for r, p in enumerate(GREEDY_PROMPTS)], block), wp)
    out: list[list[int]] = [[] for _ in GREEDY_PROMPTS]
    all_logits = [logits]
    for step in range(NEW_TOKENS):
        for r in range(3):
            out[r].append(int(np.argmax(logits[r])))
        if step == NEW_TOKENS - 1:
            break
        decode = [(r, out[r][-1], len(p) + step) for r, p in enumerate(GREEDY_PROMPTS)]
        logits = pool.step(flat_batch(3, decode, [], block), wp)
        all_logits.append(logits)
    return out, np.stack(all_logits)


def test_greedy_generation_matches_the_dense_reference() -> None:
    """8 greedy tokens for 3 sequences, decode tokens fed back step by step: ``ragged_step``
    generates the ids (and logits) the dense reference gives each sequence alone."""
    out, ragged_logits = greedy_ragged(page_size=8)
    for r, p in enumerate(GREEDY_PROMPTS):
        seq = np.concatenate([p, out[r]])
        ref = dense(seq)[len(p) - 1 : len(p) - 1 + NEW_TOKENS]  # the logits each generated id came from
        assert [int(i) for i in np.argmax(ref, axis=-1)] == out[r]
        np.testing.assert_allclose(ragged_logits[:, r], ref, **TOL)


# ---- (d) page sizes and page tables --------------------------------------------------------
def test_page_sizes_and_scattered_tables_give_the_same_result() -> None:
    """Page sizes 1, 8 and 16 (the same window of 32 positions), each over its own scattered
    page tables, generate the same ids and logits; so does the mixed batch with page size 8 over
    other scattered tables and over contiguous ones (pages 0, 1, 2, ... in order) whose unused
    columns are 0, a page of row 0 (never read: masked)."""
    ref_ids, ref_logits = greedy_ragged(page_size=8)
    for ps in (1, 16):
        ids, logits = greedy_ragged(page_size=ps)
        assert ids == ref_ids, ps
        np.testing.assert_allclose(logits, ref_logits, rtol=1e-6, atol=1e-6)

    for seed in (3, None):  # other scattered tables; contiguous ones
        wp = 4
        pool = Pool.make(rows=4, max_pages=wp, page_size=8, seed=seed or 0)
        if seed is None:
            pool.tables = np.arange(4 * wp, dtype=np.int32).reshape(4, wp)
            for r, n in ((0, 13), (1, 11), (2, 10), (3, 18)):  # each row's positions after the step
                pool.tables[r, -(-n // 8) :] = 0
        first = [(0, PROMPTS[0][:FIRST_CHUNK_0], 0), (2, PROMPTS[2], 0), (3, PROMPTS[3], 0)]
        pool.step(flat_batch(4, [], first, 4), wp)
        decode = [(r, DECODED[r], len(PROMPTS[r])) for r in (2, 3)]
        chunks = [(0, PROMPTS[0][FIRST_CHUNK_0:], FIRST_CHUNK_0), (1, PROMPTS[1], 0)]
        got = pool.step(flat_batch(4, decode, chunks, 4), wp)
        np.testing.assert_allclose(got, mixed_scenario(page_size=8, block=4), rtol=1e-6, atol=1e-6)


def test_mixed_batch_with_page_size_1_and_16(alone_logits: np.ndarray) -> None:
    """The mixed batch with one position per page and with 16 (row 3's 18 positions over two
    pages) gives the rows' alone results too."""
    for ps in (1, 16):
        np.testing.assert_allclose(mixed_scenario(page_size=ps, block=4), alone_logits, **TOL)


# ---- (e) bfloat16 ------------------------------------------------------------------------------
def test_bfloat16_cache() -> None:
    """A bfloat16 cache: the pages hold bfloat16 bits, layer 0's keys and values are the float32
    run's rounded to bfloat16 (layer 0's inputs are the embeddings either way), and the logits
    stay close to the float32 run's."""
    _, logits32 = greedy_ragged(page_size=8)
    wp = 4
    caches = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        pool = Pool.make(rows=3, max_pages=wp, page_size=8, dtype=dtype)
        pool.step(flat_batch(3, [], [(r, p, 0) for r, p in enumerate(GREEDY_PROMPTS)], 8), wp)
        caches[dtype] = pool
    bf = caches[jnp.bfloat16].cache
    assert bf.k.dtype == jnp.uint16 and bf.v.dtype == jnp.uint16  # bfloat16's bits (pages.storage_dtype)
    tables = caches[jnp.float32].tables
    for r, p in enumerate(GREEDY_PROMPTS):
        pages, offsets = tables[r, np.arange(len(p)) // 8], np.arange(len(p)) % 8
        for name in ("k", "v"):
            f32 = np.asarray(getattr(caches[jnp.float32].cache, name)[0][pages, :, offsets])
            b16 = np.asarray(from_stored(getattr(bf, name)[0][pages, :, offsets]))
            np.testing.assert_array_equal(b16, np.asarray(jnp.asarray(f32, jnp.bfloat16).astype(jnp.float32)))

    _, logits16 = greedy_ragged(page_size=8, dtype=jnp.bfloat16)
    assert np.isfinite(logits16).all()
    err = np.abs(logits16 - logits32).max()
    # bfloat16 keeps 8 significant bits (relative rounding <= 2^-9); the logits move by less than
    # that relative to their largest magnitude (about 5e-4 of 1.1 here), and do move.
    assert 0 < err < 2**-9 * np.abs(logits32).max(), err


# ---- (f) the jitted step's arguments -------------------------------------------------------
def test_the_cache_is_two_donated_leaves_whatever_the_pool() -> None:
    """The cache is 2 leaves, donated (the old arrays are deleted after the call); the step's
    argument leaves are the same for 16 or 64 pages and 4 or 8 columns of page tables."""
    counts = set()
    ids = ids_of(30, 6)
    for num_pages, max_pages in ((16, 4), (64, 4), (64, 8)):
        cache = PagedKVCache.zeros(CFG, num_pages, 8)
        assert len(jax.tree.leaves(cache)) == 2
        tables = np.random.default_rng(num_pages).permutation(num_pages)[:max_pages][None].astype(np.int32)
        batch = flat_batch(1, [], [(0, ids, 0)])
        args = (PARAMS, cache, batch.tokens, batch.positions, batch.seq, tables, batch.last)
        counts.add(len(jax.tree.leaves(args)))
        old = cache.k
        logits, cache = RAGGED(*args, 2, None, 1, BACKENDS[0])
        assert old.is_deleted()
        assert cache.num_pages == num_pages and len(jax.tree.leaves(cache)) == 2
        assert logits.shape == (1, CFG.vocab_size)
    assert counts == {len(jax.tree.leaves(PARAMS)) + 2 + 5}


def test_bad_arguments() -> None:
    tables = jnp.zeros((1, 2), jnp.int32)
    z = jnp.zeros(3, jnp.int32)
    for kwargs, match in (
        (dict(window_pages=3), "window_pages"),
        (dict(window_pages=0), "window_pages"),
        (dict(window_pages=1, decode_tokens=4), "decode_tokens"),
        (dict(window_pages=1, decode_tokens=-1), "decode_tokens"),
        (dict(window_pages=1, decode_tokens=0, seq_block=0), "seq_block"),
    ):
        with pytest.raises(ValueError, match=match):
            StepMeta.build(tables, z, z, 8, **kwargs)  # type: ignore[arg-type]


def test_unrolled_layers_give_the_scanned_result(alone_logits: np.ndarray) -> None:
    """The per-layer weights (``unstack_layers``: an unrolled loop over the layers, a static
    layer index into the stacked pages) give the scanned form's logits on the mixed batch."""
    wp = WINDOW_POSITIONS // 8
    pool = Pool.make(rows=4, max_pages=wp + 1, page_size=8)
    per_layer = unstack_layers(PARAMS)

    def step(batch: Batch) -> np.ndarray:
        logits, pool.cache = RAGGED(
            per_layer, pool.cache, batch.tokens, batch.positions, batch.seq, pool.tables, batch.last,
            wp, batch.prefill_from, batch.block, BACKENDS[0],
        )  # fmt: skip
        return np.asarray(logits)

    step(flat_batch(4, [], [(0, PROMPTS[0][:FIRST_CHUNK_0], 0), (2, PROMPTS[2], 0), (3, PROMPTS[3], 0)], 4))
    decode = [(r, DECODED[r], len(PROMPTS[r])) for r in (2, 3)]
    got = step(flat_batch(4, decode, [(0, PROMPTS[0][FIRST_CHUNK_0:], FIRST_CHUNK_0), (1, PROMPTS[1], 0)], 4, 1))
    np.testing.assert_allclose(got, alone_logits, **TOL)
