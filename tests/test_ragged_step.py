"""``model.llama.ragged_step`` (a flat batch of decode tokens and prefill chunks over a paged cache,
stacked weights) against the model's other entry points on the tiny random model: ``prefill`` and
``decode_step`` on a ``KVCache``, and the same sequences run alone.

The flat batches are built by ``flat_batch``: decode tokens and a padding token first, then the
prefill chunks. With ``block`` set, the chunks go to the blocked region (``prefill_from``), each
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

from model.config import LlamaConfig
from model.kv_cache import KVCache
from model.llama import decode_step, prefill, ragged_step, unstack_layers
from model.weights.loader import random_llama
from model.attention.pages import PagedKVCache

CFG = LlamaConfig.tiny()
GRAPHDEF, PARAMS = random_llama(CFG, seed=0)
TOL: dict = dict(rtol=1e-5, atol=1e-5)


def _ragged(params, cache, tokens, positions, seq, tables, last, window_pages, prefill_from, seq_block):  # type: ignore[no-untyped-def]
    model = nnx.merge(GRAPHDEF, params)
    return ragged_step(
        model, cache, tokens, positions, seq, tables, last,
        window_pages=window_pages, prefill_from=prefill_from, seq_block=seq_block,
    )  # fmt: skip


RAGGED = jax.jit(_ragged, static_argnames=("window_pages", "prefill_from", "seq_block"), donate_argnums=1)
PREFILL = jax.jit(
    lambda p, c, t, s, n, slot, kv_len: prefill(nnx.merge(GRAPHDEF, p), c, t, s, n, slot, kv_len=kv_len),
    static_argnames="kv_len",
    donate_argnums=1,
)
DECODE = jax.jit(
    lambda p, c, t, pos, kv_len: decode_step(nnx.merge(GRAPHDEF, p), c, t, pos, kv_len=kv_len),
    static_argnames="kv_len",
    donate_argnums=1,
)


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

    def step(self, batch: Batch, window_pages: int) -> np.ndarray:
        """One ``ragged_step`` over ``batch``; updates the cache, returns logits [rows, V]."""
        logits, self.cache = RAGGED(
            PARAMS, self.cache, batch.tokens, batch.positions, batch.seq, self.tables, batch.last,
            window_pages, batch.prefill_from, batch.block,
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


def padded(ids: np.ndarray, bucket: int) -> np.ndarray:
    out = np.zeros(bucket, np.int32)
    out[: len(ids)] = ids
    return out


# ---- (a) one prompt ------------------------------------------------------------------------
@pytest.mark.parametrize("block", [None, 8], ids=["per-token", "blocks-of-8"])
def test_one_prompt_matches_prefill(block: int | None) -> None:
    """20 tokens of one prompt in one flat batch: the last position's logits are ``prefill``'s on
    a ``KVCache`` (stacked weights), and the pages hold the keys and values ``prefill`` wrote."""
    ids = ids_of(1, 20)
    ref_logits, ref_cache = PREFILL(PARAMS, KVCache.zeros(CFG, 2, 32), padded(ids, 32), 0, 20, 1, 0)
    pool = Pool.make(rows=1, max_pages=3, page_size=8)
    logits = pool.step(flat_batch(1, [], [(0, ids, 0)], block), window_pages=3)
    np.testing.assert_allclose(logits[0], np.asarray(ref_logits), **TOL)

    k, v = np.asarray(pool.cache.k), np.asarray(pool.cache.v)  # [L, P, K, ps, H]
    pages, offsets = pool.tables[0, np.arange(20) // 8], np.arange(20) % 8
    ref_k = np.asarray(ref_cache.k[:, 1, :, :20]).transpose(0, 2, 1, 3)  # [L, 20, K, H]
    ref_v = np.asarray(ref_cache.v[:, 1, :, :20]).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(k[:, pages, :, offsets].transpose(1, 0, 2, 3), ref_k, **TOL)
    np.testing.assert_allclose(v[:, pages, :, offsets].transpose(1, 0, 2, 3), ref_v, **TOL)


# ---- (b) a mixed batch ---------------------------------------------------------------------
# Rows: 0 a prompt of 13 whose first 8 tokens an earlier step wrote (its later chunk here);
# 1 a prompt of 11, first chunk here; 2 and 3 decode tokens after prompts of 9 and 17.
PROMPTS = {0: ids_of(10, 13), 1: ids_of(11, 11), 2: ids_of(12, 9), 3: ids_of(13, 17)}
DECODED = {2: 77, 3: 5}  # the decode tokens of rows 2 and 3
FIRST_CHUNK_0 = 8
WINDOW_POSITIONS = 32  # covers every position of the scenario (at most 17); whole pages of 1, 8 and 16


def mixed_scenario(page_size: int, block: int | None, seed: int = 0) -> np.ndarray:
    """Step 1: row 0's first chunk and rows 2, 3's prompts; step 2 (the mixed batch): row 0's
    later chunk, row 1's prompt, rows 2, 3's decode tokens. Returns step 2's logits [4, V]."""
    wp = WINDOW_POSITIONS // page_size
    pool = Pool.make(rows=4, max_pages=wp + 1, page_size=page_size, seed=seed)
    first = [(0, PROMPTS[0][:FIRST_CHUNK_0], 0), (2, PROMPTS[2], 0), (3, PROMPTS[3], 0)]
    pool.step(flat_batch(4, [], first, block, seed), wp)
    decode = [(r, DECODED[r], len(PROMPTS[r])) for r in (2, 3)]
    chunks = [(0, PROMPTS[0][FIRST_CHUNK_0:], FIRST_CHUNK_0), (1, PROMPTS[1], 0)]
    return pool.step(flat_batch(4, decode, chunks, block, seed + 1), wp)


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


@pytest.mark.parametrize("block", [None, 4, 16], ids=["per-token", "blocks-of-4", "blocks-of-16"])
def test_a_mixed_batch_gives_each_row_what_it_gets_alone(block: int | None, alone_logits: np.ndarray) -> None:
    """Two prompts' chunks (one a later chunk) and two decode tokens in one flat batch: each
    row's logits are those of its sequence run alone, in the per-token layout (shuffled) and in
    the blocked one (chunks at block boundaries; 4 splits both chunks over blocks, 16 holds each
    in one)."""
    mixed = mixed_scenario(page_size=8, block=block)
    np.testing.assert_allclose(mixed, alone_logits, **TOL)


def test_alone_matches_prefill_and_decode(alone_logits: np.ndarray) -> None:
    """The rows run alone agree with ``prefill`` (whole, and chunked for row 0) and
    ``decode_step`` on a ``KVCache``: the reference of the mixed test is itself right."""
    ref = []
    for row in range(4):
        ids = PROMPTS[row]
        cache = KVCache.zeros(CFG, 4, 32)
        if row == 0:
            _, cache = PREFILL(PARAMS, cache, padded(ids[:FIRST_CHUNK_0], 8), 0, FIRST_CHUNK_0, row, 0)
            logits, _ = PREFILL(PARAMS, cache, padded(ids[FIRST_CHUNK_0:], 8), FIRST_CHUNK_0, 5, row, 32)
        else:
            logits, cache = PREFILL(PARAMS, cache, padded(ids, 32), 0, len(ids), row, 0)
        if row in DECODED:
            tokens = np.zeros(4, np.int32)
            positions = np.full(4, 32, np.int32)  # idle slots: writes dropped
            tokens[row], positions[row] = DECODED[row], len(ids)
            logits = DECODE(PARAMS, cache, tokens, positions, 32)[0][row]
        ref.append(np.asarray(logits))
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


def test_greedy_generation_matches_prefill_and_decode_step() -> None:
    """8 greedy tokens for 3 sequences: ``ragged_step`` generates the ids (and logits) that
    ``prefill`` per slot then ``decode_step`` over the 3 slots of a ``KVCache`` do."""
    cache = KVCache.zeros(CFG, 3, 32)
    logits = []
    for slot, p in enumerate(GREEDY_PROMPTS):
        lg, cache = PREFILL(PARAMS, cache, padded(p, 16), 0, len(p), slot, 0)
        logits.append(np.asarray(lg))
    step_logits = [np.stack(logits)]
    ref: list[list[int]] = [[] for _ in GREEDY_PROMPTS]
    for step in range(NEW_TOKENS):
        for r in range(3):
            ref[r].append(int(np.argmax(step_logits[-1][r])))
        if step == NEW_TOKENS - 1:
            break
        tokens = np.array([ref[r][-1] for r in range(3)], np.int32)
        positions = np.array([len(p) + step for p in GREEDY_PROMPTS], np.int32)
        lg, cache = DECODE(PARAMS, cache, tokens, positions, 32)
        step_logits.append(np.asarray(lg))

    out, ragged_logits = greedy_ragged(page_size=8)
    assert out == ref
    np.testing.assert_allclose(ragged_logits, np.stack(step_logits), **TOL)


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
    """A bfloat16 cache: the pages stay bfloat16, layer 0's keys and values are the float32
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
    assert bf.k.dtype == jnp.bfloat16 and bf.v.dtype == jnp.bfloat16
    tables = caches[jnp.float32].tables
    for r, p in enumerate(GREEDY_PROMPTS):
        pages, offsets = tables[r, np.arange(len(p)) // 8], np.arange(len(p)) % 8
        for name in ("k", "v"):
            f32 = np.asarray(getattr(caches[jnp.float32].cache, name)[0][pages, :, offsets])
            b16 = np.asarray(getattr(bf, name)[0][pages, :, offsets])
            np.testing.assert_array_equal(b16, np.asarray(jnp.asarray(f32, jnp.bfloat16)))

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
        logits, cache = RAGGED(*args, 2, None, 1)
        assert old.is_deleted()
        assert cache.num_pages == num_pages and len(jax.tree.leaves(cache)) == 2
        assert logits.shape == (1, CFG.vocab_size)
    assert counts == {len(jax.tree.leaves(PARAMS)) + 2 + 5}


def test_bad_arguments() -> None:
    model = nnx.merge(GRAPHDEF, PARAMS)
    cache = PagedKVCache.zeros(CFG, 4, 8)
    z = jnp.zeros(3, jnp.int32)
    tables = jnp.zeros((1, 2), jnp.int32)
    last = jnp.zeros(1, jnp.int32)
    for kwargs, match in (
        (dict(window_pages=3), "window_pages"),
        (dict(window_pages=0), "window_pages"),
        (dict(window_pages=1, prefill_from=4), "prefill_from"),
        (dict(window_pages=1, prefill_from=-1), "prefill_from"),
        (dict(window_pages=1, prefill_from=0, seq_block=0), "seq_block"),
    ):
        with pytest.raises(ValueError, match=match):
            ragged_step(model, cache, z, z, z, tables, last, **kwargs)  # type: ignore[arg-type]


def test_unrolled_layers_give_the_scanned_result(alone_logits: np.ndarray) -> None:
    """The per-layer weights (``unstack_layers``: an unrolled loop over the layers, a static
    layer index into the stacked pages) give the scanned form's logits on the mixed batch."""
    wp = WINDOW_POSITIONS // 8
    pool = Pool.make(rows=4, max_pages=wp + 1, page_size=8)
    per_layer = unstack_layers(PARAMS)

    def step(batch: Batch) -> np.ndarray:
        logits, pool.cache = RAGGED(
            per_layer, pool.cache, batch.tokens, batch.positions, batch.seq, pool.tables, batch.last,
            wp, batch.prefill_from, batch.block,
        )  # fmt: skip
        return np.asarray(logits)

    step(flat_batch(4, [], [(0, PROMPTS[0][:FIRST_CHUNK_0], 0), (2, PROMPTS[2], 0), (3, PROMPTS[3], 0)], 4))
    decode = [(r, DECODED[r], len(PROMPTS[r])) for r in (2, 3)]
    got = step(flat_batch(4, decode, [(0, PROMPTS[0][FIRST_CHUNK_0:], FIRST_CHUNK_0), (1, PROMPTS[1], 0)], 4, 1))
    np.testing.assert_allclose(got, alone_logits, **TOL)
