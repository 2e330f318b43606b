"""The native prefill kernel over the paged KV cache (``cpu_paged_attention.paged_prefill``,
``model/native/paged_prefill.cc``) against XLA's ``ragged_paged_attention_blocks`` with the same
blocks and a window of every page of the tables.

Each case is a pool of random keys and values (every layer of a stacked pool different, so
reading the wrong layer shows) with sequences' pages scattered over it in random order (-1
filler past each sequence's pages), and a flat batch of prefill chunks laid out as the engine
lays out its prefill region: each chunk starts at a block boundary and is padded to whole blocks
with padding tokens of every kind (a row below 0, a row at R, a negative position). Chunks start
at position 0 or after a cached prefix (position 37 and on), and may come in any order of
positions within a block.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.attention.pages import to_stored
from model.attention.xla import ragged_paged_attention_blocks
from model.native import cpu_paged_attention

pytestmark = pytest.mark.skipif(
    jax.devices()[0].platform != "cpu" or not cpu_paged_attention.available(), reason="native CPU kernels not built"
)


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    """Equal to float32 rounding (the kernel sums in another order than XLA)."""
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@functools.partial(jax.jit, static_argnames=("window_pages", "block"))
def reference(q, kp, vp, tables, rows, positions, layer, sliding=0, *, window_pages, block):  # type: ignore[no-untyped-def]
    return ragged_paged_attention_blocks(
        q, kp, vp, tables, rows, positions, window_pages=window_pages, block=block, layer=layer,
        sliding_window=sliding,
    )  # fmt: skip


def pool(
    rng: np.random.Generator, layers: int, pages: int, kv_heads: int, page_size: int, head_dim: int, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """Random stacked key and value pages [L, P, K, page_size, H] (an 8-bit cache's rows of
    codes and a scale, [..., H + 2], ``to_stored``)."""
    shape = (layers, pages, kv_heads, page_size, head_dim)
    return (
        to_stored(jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.1, 4, (*shape[:-1], 1))), dtype),
        to_stored(jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.1, 4, (*shape[:-1], 1))), dtype),
    )


def scattered_tables(
    rng: np.random.Generator, lengths: list[int], page_size: int, pages: int, extra: int = 1
) -> np.ndarray:
    """[R, M] int32: sequence r's ceil(lengths[r] / page_size) pages, distinct and in random
    order over the pool; -1 filler past them (``extra`` more columns than the longest needs)."""
    need = [-(-n // page_size) for n in lengths]
    assert sum(need) <= pages
    perm = iter(rng.permutation(pages).tolist())
    tables = np.full((len(lengths), max(need) + extra), -1, np.int32)
    for r, n in enumerate(need):
        tables[r, :n] = [next(perm) for _ in range(n)]
    return tables


def layout(
    chunks: list[tuple[int, int, int]],
    block: int,
    num_rows: int,
    rng: np.random.Generator,
    shuffle: bool = False,
    pad_last: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """(rows, positions) [N] int32 for chunks (sequence, first position, tokens): each chunk from
    a block boundary, its last block filled with padding tokens of every kind in turn (but for
    the last chunk's without ``pad_last``: N need not be a multiple of the block); ``shuffle``
    permutes the positions within each block."""
    fillers = [(-1, 3), (num_rows, 0), (0, -1)]  # a row below 0, a row at R, a negative position
    rows: list[int] = []
    positions: list[int] = []
    used = 0
    for i, (seq, start, n) in enumerate(chunks):
        assert len(rows) % block == 0
        chunk = np.arange(start, start + n)
        if shuffle:
            for b0 in range(0, n, block):
                chunk[b0 : b0 + block] = rng.permutation(chunk[b0 : b0 + block])
        rows += [seq] * n
        positions += chunk.tolist()
        while len(rows) % block and (pad_last or i < len(chunks) - 1):
            r, p = fillers[used % 3]
            rows.append(r)
            positions.append(p)
            used += 1
    return np.array(rows, np.int32), np.array(positions, np.int32)


def padding_of(rows: np.ndarray, positions: np.ndarray, num_rows: int) -> np.ndarray:
    return (rows < 0) | (rows >= num_rows) | (positions < 0)


def run_both(
    rng: np.random.Generator,
    *,
    page_size: int,
    block: int,
    chunks: list[tuple[int, int, int]],
    lengths: list[int],
    group: int = 3,
    head_dim: int = 64,
    kv_heads: int = 2,
    layers: int = 1,
    layer: int = 0,
    dtype: jnp.dtype = jnp.float32,
    shuffle: bool = False,
    pad_last: bool = True,
    window: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(native, reference, rows, positions) for one case; ``lengths`` are the sequences'
    lengths (each at least the end of its chunks); ``window``: a sliding window (0: none)."""
    pages = sum(-(-n // page_size) for n in lengths) + 3  # a few pages stay free
    kp, vp = pool(rng, layers, pages, kv_heads, page_size, head_dim, dtype)
    tables = scattered_tables(rng, lengths, page_size, pages)
    rows, positions = layout(chunks, block, len(lengths), rng, shuffle, pad_last)
    q = jnp.asarray(rng.standard_normal((len(rows), kv_heads, group, head_dim)) * head_dim**-0.5, jnp.float32)
    args = (q, kp, vp, jnp.asarray(tables), jnp.asarray(rows), jnp.asarray(positions), jnp.int32(layer))
    got = cpu_paged_attention.paged_prefill(*args, block, jnp.int32(window))
    want = reference(*args, jnp.int32(window), window_pages=tables.shape[1], block=block)
    return np.asarray(got), np.asarray(want), rows, positions


# Three sequences' chunks in one call: a first chunk, a chunk after a 37-position cached prefix,
# and a short chunk after a 90-position prefix.
CHUNKS = [(0, 0, 70), (2, 37, 50), (1, 90, 5)]
LENGTHS = [70, 95, 87]


@pytest.mark.parametrize(("page_size", "block"), [(1, 1), (1, 16), (8, 1), (8, 16), (8, 64), (16, 16), (16, 64)])
def test_chunks_of_several_sequences_match_xla(page_size: int, block: int) -> None:
    """Scattered pages of every size, blocks of 1, 16 and 64: XLA's result, padding exact zeros."""
    rng = np.random.default_rng([page_size, block])
    got, want, rows, positions = run_both(rng, page_size=page_size, block=block, chunks=CHUNKS, lengths=LENGTHS)
    assert_close(got, want)
    padding = padding_of(rows, positions, len(LENGTHS))
    assert padding.any() == (block > 1) and not got[padding].any()
    assert (np.abs(got[~padding]).max(axis=-1) > 0).all()  # every real token's rows were written


@pytest.mark.parametrize("window", [1, 7, 12, 30, 64])
@pytest.mark.parametrize(("page_size", "block", "shuffle"), [(8, 64, True), (16, 16, False), (1, 128, True)])
def test_a_sliding_window_matches_xla(window: int, page_size: int, block: int, shuffle: bool) -> None:
    """A local layer's sliding window: every token attends its ``window`` latest positions only.
    Windows of one position, of less than, about and more than a key block (12 on AVX-512, 6 on
    AVX2) and a tile of rows, in blocks whose rows span more than the window (so a tile's rows
    share no key), positions shuffled within blocks."""
    rng = np.random.default_rng([window, page_size, block])
    got, want, rows, positions = run_both(
        rng, page_size=page_size, block=block, chunks=CHUNKS, lengths=LENGTHS, window=window, shuffle=shuffle
    )
    assert_close(got, want)
    padding = padding_of(rows, positions, len(LENGTHS))
    assert not got[padding].any() and (np.abs(got[~padding]).max(axis=-1) > 0).all()
    _, whole, _, _ = run_both(np.random.default_rng([window, page_size, block]), page_size=page_size, block=block,
                              chunks=CHUNKS, lengths=LENGTHS, shuffle=shuffle)  # fmt: skip
    assert np.abs(want - whole).max() > 1e-2  # the window does cut keys off


@pytest.mark.parametrize(("group", "head_dim"), [(1, 16), (3, 64), (4, 128), (7, 16), (8, 64), (8, 128)])
def test_every_group_size_and_head_dim(group: int, head_dim: int) -> None:
    """G query heads per KV head (the rows of a tile are tokens x heads) and head_dim (whole and
    partial passes of value vectors), over chunks that start mid-page after a cached prefix."""
    rng = np.random.default_rng([group, head_dim])
    got, want, _, _ = run_both(
        rng,
        page_size=16,
        block=16,
        chunks=[(1, 37, 40), (0, 0, 21)],
        lengths=[21, 77],
        group=group,
        head_dim=head_dim,
    )
    assert_close(got, want)


def test_a_bfloat16_cache() -> None:
    """bfloat16 pages are widened exactly: XLA's result over the same pages to float32 rounding."""
    rng = np.random.default_rng(3)
    got, want, _, _ = run_both(rng, page_size=16, block=64, chunks=CHUNKS, lengths=LENGTHS, dtype=jnp.bfloat16)
    assert_close(got, want)


@pytest.mark.parametrize(("page_size", "block"), [(16, 64), (8, 16)])
def test_an_int8_cache(page_size: int, block: int) -> None:
    """8-bit rows (codes and a float16 scale each) decoded as XLA's path decodes them
    (``pages.from_stored``): its result to float32 rounding, windows too."""
    rng = np.random.default_rng(5)
    for window in (0, 12):
        got, want, _, _ = run_both(
            rng, page_size=page_size, block=block, chunks=CHUNKS, lengths=LENGTHS, dtype=jnp.int8, window=window
        )
        assert_close(got, want)


@pytest.mark.parametrize("layer", [1, 2])
def test_layer_of_a_stacked_pool(layer: int) -> None:
    """Layer ``layer`` of a 3-layer pool whose layers all differ, the layer traced under jit."""
    rng = np.random.default_rng(layer)
    lengths = [60, 45]
    pages = sum(-(-n // 8) for n in lengths) + 2
    kp, vp = pool(rng, 3, pages, 2, 8, 32, jnp.float32)
    tables = jnp.asarray(scattered_tables(rng, lengths, 8, pages))
    rows, positions = (jnp.asarray(a) for a in layout([(1, 13, 32), (0, 30, 30)], 16, 2, rng, shuffle=True))
    q = jnp.asarray(rng.standard_normal((len(rows), 2, 4, 32)) * 32**-0.5, jnp.float32)
    native = jax.jit(lambda lay: cpu_paged_attention.paged_prefill(q, kp, vp, tables, rows, positions, lay, 16))
    got = np.asarray(native(jnp.int32(layer)))
    want = np.asarray(reference(q, kp, vp, tables, rows, positions, layer, window_pages=tables.shape[1], block=16))
    assert_close(got, want)
    other = np.asarray(native(jnp.int32(0)))
    assert np.abs(other - got).max() > 0.1  # another layer gives another result


def test_one_long_block_in_any_order() -> None:
    """One block of 64 tokens whose positions come shuffled, one KV head of 8 query heads: a
    single (block, KV head), so its 512 query rows are split into parts, work items of their
    own, whatever the number of threads."""
    rng = np.random.default_rng(5)
    got, want, _, _ = run_both(
        rng, page_size=8, block=64, chunks=[(0, 100, 64)], lengths=[164], group=8, kv_heads=1, shuffle=True
    )
    assert_close(got, want)


def test_a_short_last_block() -> None:
    """N not a multiple of the block: the last block holds what is left."""
    rng = np.random.default_rng(6)
    got, want, _, _ = run_both(
        rng, page_size=8, block=16, chunks=[(0, 0, 20), (1, 30, 9)], lengths=[20, 39], pad_last=False
    )
    assert got.shape[0] == 32 + 9
    assert_close(got, want)


def test_a_broken_promise_zeroes_only_the_strays() -> None:
    """A block whose tokens belong to two sequences: the tokens of its first real token's
    sequence are right, the others (strays) are exact zeros, never another sequence's keys."""
    rng = np.random.default_rng(9)
    lengths = [40, 50]
    pages = sum(-(-n // 8) for n in lengths) + 2
    kp, vp = pool(rng, 1, pages, 2, 8, 32, jnp.float32)
    tables = jnp.asarray(scattered_tables(rng, lengths, 8, pages))
    # Block 0: a padding token first, then sequence 1's chunk with sequence 0's tokens in it.
    rows = np.array([-1] + [1] * 6 + [0, 0] + [1] * 7, np.int32)
    positions = np.array([0, 20, 21, 22, 23, 24, 25, 30, 31, 26, 27, 28, 29, 30, 31, 32], np.int32)
    q = jnp.asarray(rng.standard_normal((16, 2, 3, 32)) * 32**-0.5, jnp.float32)
    args = (q, kp, vp, tables, jnp.asarray(rows), jnp.asarray(positions), 0)
    got = np.asarray(cpu_paged_attention.paged_prefill(*args, 16))
    want = np.asarray(reference(*args, window_pages=tables.shape[1], block=16))
    member = rows == 1
    assert_close(got[member], want[member])
    assert (np.abs(got[member]).max(axis=-1) > 0).all()
    assert np.isfinite(got).all() and not got[~member].any()
    # Blocks of 8: the second block starts with a token of sequence 0, so it is sequence 0's and
    # its tokens of sequence 1 are the strays.
    got8 = np.asarray(cpu_paged_attention.paged_prefill(*args, 8))
    assert_close(got8, np.asarray(reference(*args, window_pages=tables.shape[1], block=8)))
    assert np.abs(got8[rows == 0]).max() > 0


def test_a_position_past_the_table_gives_zeros_and_page_ids_are_clipped() -> None:
    """A member whose position is at or past M x page_size (forbidden to the XLA path, whose
    window cannot reach it) gets zeros, its block's other tokens are unaffected; page ids outside
    [0, P) in a table are clipped into it, as XLA's path clips them."""
    rng = np.random.default_rng(10)
    kp, vp = pool(rng, 1, 8, 1, 4, 16, jnp.float32)
    tables = jnp.asarray([[3, 99, -5]], jnp.int32)  # 12 positions, on pages 3, 7 and 0
    rows = jnp.zeros(4, jnp.int32)
    positions = jnp.asarray([9, 12, 5, 40], jnp.int32)
    q = jnp.asarray(rng.standard_normal((4, 1, 2, 16)) * 0.25, jnp.float32)
    got = np.asarray(cpu_paged_attention.paged_prefill(q, kp, vp, tables, rows, positions, 0, 4))
    want = np.asarray(reference(q, kp, vp, tables, rows, positions, 0, window_pages=3, block=4))
    assert not got[[1, 3]].any()
    assert_close(got[[0, 2]], want[[0, 2]])
    clipped = np.asarray(
        reference(q, kp, vp, jnp.asarray([[3, 7, 0]], jnp.int32), rows, positions, 0, window_pages=3, block=4)
    )
    assert_close(got[[0, 2]], clipped[[0, 2]])


def test_bad_operands_are_errors_not_crashes() -> None:
    """Shapes, dtypes and a layer the kernel does not take: its error message, no crash."""
    rng = np.random.default_rng(11)
    kp, vp = pool(rng, 2, 4, 2, 8, 32, jnp.float32)
    tables = jnp.zeros((1, 4), jnp.int32)
    rows = jnp.zeros(5, jnp.int32)
    positions = jnp.arange(5, dtype=jnp.int32)
    q = jnp.zeros((5, 2, 3, 32), jnp.float32)

    def call(q=q, kp=kp, vp=vp, tables=tables, rows=rows, positions=positions, layer=0, block=4):  # type: ignore[no-untyped-def]
        return np.asarray(cpu_paged_attention.paged_prefill(q, kp, vp, tables, rows, positions, layer, block))

    call()  # the operands as they are are fine
    bad: list[tuple[dict[str, Any], str]] = [
        ({"q": jnp.zeros((5, 2, 9, 32))}, "between 1 and 8"),
        ({"q": jnp.zeros((5, 2, 3, 24)), "kp": kp[..., :24], "vp": vp[..., :24]}, "multiple of 16"),
        ({"q": jnp.zeros((5, 3, 3, 32))}, "with q's K and H"),
        ({"vp": vp[:, :3]}, "keys and values alike"),
        ({"kp": kp.astype(jnp.bfloat16)}, "both float32, both bfloat16 \\(or its bits, uint16\\) or both int8"),
        (
            {"kp": kp.astype(jnp.float16), "vp": vp.astype(jnp.float16)},
            "both float32, both bfloat16 \\(or its bits, uint16\\) or both int8",
        ),
        ({"positions": positions[:4]}, r"rows and positions must be \[N\]"),
        ({"tables": jnp.zeros(4, jnp.int32)}, r"page tables must be \[R, M\]"),
        ({"layer": 2}, "layer out of range"),
        ({"layer": -1}, "layer out of range"),
    ]
    for kwargs, message in bad:
        # The kernel's INVALID_ARGUMENT: jax raises it as a JaxRuntimeError, or as a ValueError
        # from a call whose executable it has cached (the layer cases).
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match=message):
            call(**kwargs)
    with pytest.raises(ValueError, match="block must be >= 1"):
        call(block=0)
