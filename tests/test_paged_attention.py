"""The paged KV cache (``model/attention/pages.py``) and ragged paged attention (``model/attention/xla.py``)
against a dense reference: numpy float64 softmax attention over each sequence's whole K/V, built
independently of the pages.

The scenario (``mixed_step``) is one ragged step over five sequences whose pages are scattered
over the pool in random order: a decode token; a prefill chunk starting mid-page in the middle of
a sequence that shares its first two pages with the first sequence (prefix sharing); a decode
token at position 0; a first prefill chunk crossing a page boundary; a sequence with no token in
the step; and padding tokens of each kind, all shuffled. The earlier positions are written first,
as earlier steps would have, then the step writes its own tokens' K/V and attends. The pages are
one layer's [P, K, page_size, H] array or, ``stacked``, layer 1 of a stacked [3, P, K, page_size,
H] array whose other layers hold other values (``write_kv``/attention with ``layer=1``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from model.attention import cpu as cpu_attention
from model.attention.pages import PAGE_AXES, PagedKVCache, slot_mapping, write_kv
from model.attention.xla import ragged_paged_attention, ragged_paged_attention_blocks
from model.config import LlamaConfig, kv_row_bytes
from model.native import cpu_paged_attention

CFG = LlamaConfig.tiny(num_heads=6)  # K = 2 KV heads, G = 3 query heads each, H = 16
K, G, H = CFG.num_kv_heads, CFG.q_per_kv, CFG.head_dim


def as_bf16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to bfloat16 (nearest even) and widened back to float32, as the cache holds it."""
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


def as_int8(x: np.ndarray) -> np.ndarray:
    """``x`` [..., H] as an 8-bit cache holds it, decoded: gguf's Q8_0 blocks (llama.cpp's
    reference quantization) of each row when H is one block of 32, else each row's absmax codes
    times its float16 scale, in numpy (the rule ``pages.to_stored`` implements)."""
    x = np.asarray(x, np.float32)
    if x.shape[-1] == 32:
        from gguf import GGMLQuantizationType, quants

        blocks = quants.quantize(x.reshape(-1, 32), GGMLQuantizationType.Q8_0)
        return quants.dequantize(blocks, GGMLQuantizationType.Q8_0).reshape(x.shape)
    d = np.abs(x).max(-1, keepdims=True) / 127
    inv = np.where(d == 0, 0, 1 / np.where(d == 0, 1, d))
    codes = np.trunc(x * inv + np.copysign(0.5, x))  # round half away from zero, as ggml
    return codes * d.astype(np.float16).astype(np.float32)


@dataclasses.dataclass
class Step:
    """One ragged step and everything its reference needs (numpy arrays)."""

    page_size: int
    num_pages: int
    page_tables: np.ndarray  # [B, max_pages] int32, unused columns -1
    window_pages: int
    dense_k: list[np.ndarray]  # per sequence [length, K, H] float32: the whole K it has after the step
    dense_v: list[np.ndarray]
    history: list[tuple[int, int]]  # (sequence, position) written before the step
    seq_of_token: np.ndarray  # [N] int32, padding marked
    positions: np.ndarray  # [N] int32
    q: np.ndarray  # [N, K, G, H] float32, scaled

    def new_kv(self) -> tuple[np.ndarray, np.ndarray]:
        """The step's tokens' K and V [N, K, H] (zeros for padding)."""
        k = np.zeros((len(self.positions), K, H), np.float32)
        v = np.zeros_like(k)
        for n, (s, p) in enumerate(zip(self.seq_of_token, self.positions, strict=True)):
            if 0 <= s < len(self.dense_k) and p >= 0:
                k[n], v[n] = self.dense_k[s][p], self.dense_v[s][p]
        return k, v


def mixed_step(page_size: int, seed: int = 0) -> Step:
    ps = page_size
    rng = np.random.default_rng([seed, ps])
    # (length after the step, positions of its tokens in the step)
    seqs = [
        (2 * ps + 3, [2 * ps + 2]),  # 0: decode
        (4 * ps + 2, list(range(3 * ps - 2, 4 * ps + 2))),  # 1: a chunk from mid-page, crossing a boundary
        (1, [0]),  # 2: decode at position 0
        (ps + 5, list(range(ps + 5))),  # 3: a first chunk, crossing a boundary
        (3, []),  # 4: no token in this step
    ]
    shared = 2  # sequence 1's first two pages are sequence 0's (a cached prefix)
    pages_of = [-(-n // ps) for n, _ in seqs]
    own = [n - (shared if s == 1 else 0) for s, n in enumerate(pages_of)]
    num_pages = sum(own) + 6  # some pages stay free
    perm = iter(rng.permutation(num_pages).tolist())  # scattered, non-contiguous
    tables = []
    for s, n in enumerate(pages_of):
        tables.append(
            tables[0][:shared] + [next(perm) for _ in range(n - shared)] if s == 1 else [next(perm) for _ in range(n)]
        )
    max_pages = max(pages_of) + 2  # the window bucket may exceed what any sequence needs
    page_tables = np.full((len(seqs), max_pages), -1, np.int32)
    for s, t in enumerate(tables):
        page_tables[s, : len(t)] = t

    dense_k = [rng.standard_normal((n, K, H)).astype(np.float32) for n, _ in seqs]
    dense_v = [rng.standard_normal((n, K, H)).astype(np.float32) for n, _ in seqs]
    dense_k[1][: shared * ps], dense_v[1][: shared * ps] = dense_k[0][: shared * ps], dense_v[0][: shared * ps]
    in_step = {(s, p) for s, (_, ps_) in enumerate(seqs) for p in ps_}
    history = [
        (s, p)
        for s, (n, _) in enumerate(seqs)
        for p in range(n)
        if (s, p) not in in_step and not (s == 1 and p < shared * ps)  # shared pages: written once, by 0
    ]

    tokens = [(s, p) for s, (_, ps_) in enumerate(seqs) for p in ps_]
    tokens += [(-1, 5), (len(seqs), 0), (0, -1)]  # padding: below, at B, and a negative position
    order = rng.permutation(len(tokens))
    seq_of_token = np.array([tokens[i][0] for i in order], np.int32)
    positions = np.array([tokens[i][1] for i in order], np.int32)
    q = (rng.standard_normal((len(tokens), K, G, H)) * H**-0.5).astype(np.float32)
    return Step(ps, num_pages, page_tables, max_pages, dense_k, dense_v, history, seq_of_token, positions, q)


def dense_attention(step: Step, dense_k: list[np.ndarray], dense_v: list[np.ndarray], window: int = 0) -> np.ndarray:
    """[N, K, G, H] float64: token n attends to its sequence's positions 0..positions[n] (with a
    sliding ``window``, only the ``window`` latest of them); padding 0."""
    out = np.zeros(step.q.shape, np.float64)
    for n, (s, p) in enumerate(zip(step.seq_of_token, step.positions, strict=True)):
        if not (0 <= s < len(dense_k) and p >= 0):
            continue
        lo = max(0, p + 1 - window) if window else 0
        k = dense_k[s][lo : p + 1].astype(np.float64)  # [S, K, H]
        v = dense_v[s][lo : p + 1].astype(np.float64)
        scores = np.einsum("kgh,skh->kgs", step.q[n].astype(np.float64), k)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[n] = np.einsum("kgs,skh->kgh", probs, v)
    return out


STACK_LAYERS, LAYER = 3, 1  # the stacked form: layer 1 of 3


def run_step(
    step: Step,
    dtype: jnp.dtype,
    query_block: int | None = None,
    stacked: bool = False,
    block: int | None = None,
    native: bool = False,
    window: int = 0,
) -> tuple[np.ndarray, jax.Array, jax.Array]:
    """Write the history, then the step's tokens, through ``write_kv`` at ``slot_mapping``'s
    slots; attend (``ragged_paged_attention``, ``ragged_paged_attention_blocks`` with
    ``block``, or with ``native`` the CPU kernel of ``model.native.cpu_paged_attention``). Returns (attention [N, K, G, H], key pages, value pages [P, K, page_size, H]);
    ``stacked``: the pages are layer ``LAYER`` of a stacked array whose other layers are
    filled with 7s (so reading the wrong layer shows); ``window``: the sliding window (a traced
    operand, as a scanned layer passes it)."""
    shape = PagedKVCache.shape(CFG, step.num_pages, step.page_size, dtype)[1:]
    layer = LAYER if stacked else None
    if stacked:
        kp = jnp.full((STACK_LAYERS, *shape), 7, dtype).at[LAYER].set(0)
        vp = jnp.full((STACK_LAYERS, *shape), 7, dtype).at[LAYER].set(0)
    else:
        kp, vp = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    tables = jnp.asarray(step.page_tables)
    hs = np.array([s for s, _ in step.history], np.int32)
    hp = np.array([p for _, p in step.history], np.int32)
    hk = np.stack([step.dense_k[s][p] for s, p in step.history])
    hv = np.stack([step.dense_v[s][p] for s, p in step.history])
    history = slot_mapping(tables, jnp.asarray(hs), jnp.asarray(hp), step.page_size)
    kp, vp = write_kv(kp, vp, history, hk, hv, layer)
    k_new, v_new = step.new_kv()
    seq, pos = jnp.asarray(step.seq_of_token), jnp.asarray(step.positions)

    @jax.jit
    def attend(kp, vp, q, seq, pos, sw):  # type: ignore[no-untyped-def]
        kp, vp = write_kv(kp, vp, slot_mapping(tables, seq, pos, step.page_size), k_new, v_new, layer)
        if native and block is not None:  # the kernels read stacked pages: one layer is a stack of one
            stack = (kp, vp) if stacked else (kp[None], vp[None])
            out = cpu_paged_attention.paged_prefill(q, *stack, tables, seq, pos, LAYER if stacked else 0, block, sw)
        elif native:
            stack = (kp, vp) if stacked else (kp[None], vp[None])
            out = cpu_paged_attention.paged_attention(q, *stack, tables, seq, pos, LAYER if stacked else 0, sw)
        elif block is not None:
            out = ragged_paged_attention_blocks(
                q, kp, vp, tables, seq, pos, window_pages=step.window_pages, block=block, layer=layer, sliding_window=sw
            )
        else:
            out = ragged_paged_attention(
                q, kp, vp, tables, seq, pos, window_pages=step.window_pages, query_block=query_block, layer=layer,
                sliding_window=sw,
            )  # fmt: skip
        return out, kp, vp

    out, kp, vp = attend(kp, vp, jnp.asarray(step.q), seq, pos, jnp.int32(window))
    if stacked:
        others = np.delete(np.asarray(kp), LAYER, axis=0)
        assert (others == 7).all()  # the other layers were not written
        kp, vp = kp[LAYER], vp[LAYER]
    return np.asarray(out), kp, vp


def in_sequence_blocks(step: Step, block: int) -> Step:
    """The step's tokens reordered for ``ragged_paged_attention_blocks``: each sequence's
    tokens in one run (positions shuffled within it) starting at a block boundary, the run's
    last block filled with padding tokens of every kind, the step's own padding tokens in a
    block of their own."""
    rng = np.random.default_rng(block)
    real = (step.seq_of_token >= 0) & (step.seq_of_token < len(step.dense_k)) & (step.positions >= 0)
    order: list[int] = []
    fillers = [(-1, 3), (len(step.dense_k), 0), (0, -1)]
    seq_pad: list[tuple[int, int]] = []
    for s in range(len(step.dense_k)):
        run = rng.permutation(np.flatnonzero(real & (step.seq_of_token == s))).tolist()
        if not run:
            continue
        order += run
        while len(order) % block:
            order.append(-1 - len(seq_pad))
            seq_pad.append(fillers[len(seq_pad) % 3])
    order += np.flatnonzero(~real).tolist()
    seq = [int(step.seq_of_token[i]) if i >= 0 else seq_pad[-1 - i][0] for i in order]
    pos = [int(step.positions[i]) if i >= 0 else seq_pad[-1 - i][1] for i in order]
    q = np.stack([step.q[i] if i >= 0 else step.q[0] for i in order])
    return dataclasses.replace(step, seq_of_token=np.array(seq, np.int32), positions=np.array(pos, np.int32), q=q)


@pytest.mark.parametrize("stacked", [False, True], ids=["one-layer", "stacked"])
@pytest.mark.parametrize("page_size", [8, 16, 128])
def test_float32_matches_dense_attention(page_size: int, stacked: bool) -> None:
    step = mixed_step(page_size)
    out, _, _ = run_step(step, jnp.float32, stacked=stacked)
    ref = dense_attention(step, step.dense_k, step.dense_v)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    padding = (step.seq_of_token < 0) | (step.seq_of_token >= len(step.dense_k)) | (step.positions < 0)
    assert padding.sum() == 3 and not out[padding].any()  # padding tokens give exact zeros


needs_kernels = pytest.mark.skipif(
    jax.devices()[0].platform != "cpu" or not cpu_paged_attention.available(), reason="native CPU kernels not built"
)


@needs_kernels
@pytest.mark.parametrize("stacked", [False, True], ids=["one-layer", "stacked"])
@pytest.mark.parametrize("page_size", [8, 16, 128])
def test_the_native_kernel_matches_dense_attention(page_size: int, stacked: bool) -> None:
    """``cpu_paged_attention.paged_attention`` on the mixed step (every token on its own, -1
    filler in the tables, padding of every kind): the dense reference, padding exact zeros."""
    step = mixed_step(page_size)
    out, _, _ = run_step(step, jnp.float32, stacked=stacked, native=True)
    np.testing.assert_allclose(out, dense_attention(step, step.dense_k, step.dense_v), rtol=1e-5, atol=1e-5)
    padding = (step.seq_of_token < 0) | (step.seq_of_token >= len(step.dense_k)) | (step.positions < 0)
    assert padding.sum() == 3 and not out[padding].any()


@needs_kernels
def test_the_native_kernel_reads_a_bfloat16_cache() -> None:
    step = mixed_step(16, seed=1)
    out, kp, _ = run_step(step, jnp.bfloat16, stacked=True, native=True)
    assert kp.dtype == jnp.bfloat16
    rounded_k, rounded_v = [as_bf16(k) for k in step.dense_k], [as_bf16(v) for v in step.dense_v]
    np.testing.assert_allclose(out, dense_attention(step, rounded_k, rounded_v), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize(("group", "head_dim"), [(1, 16), (4, 64), (8, 128), (7, 32)])
def test_the_native_kernel_equals_xla_for_every_group_size(group: int, head_dim: int) -> None:
    """Random pages, tables and positions (up to a window of 8 pages of 16) for G query heads per
    KV head: the kernel's register tiles are compiled per G, each checked against XLA's path."""
    rng = np.random.default_rng(group)
    L, num_pages, kv_heads, ps, rows, n = 2, 40, 2, 16, 6, 9
    kp = jnp.asarray(rng.standard_normal((L, num_pages, kv_heads, ps, head_dim)), jnp.float32)
    vp = jnp.asarray(rng.standard_normal((L, num_pages, kv_heads, ps, head_dim)), jnp.float32)
    tables = jnp.asarray(rng.integers(0, num_pages, (rows, 8)), jnp.int32)
    seq = jnp.asarray(rng.integers(0, rows, n), jnp.int32)
    pos = jnp.asarray(rng.integers(0, 8 * ps, n), jnp.int32)
    q = jnp.asarray(rng.standard_normal((n, kv_heads, group, head_dim)) * head_dim**-0.5, jnp.float32)
    got = cpu_paged_attention.paged_attention(q, kp, vp, tables, seq, pos, 1)
    want = ragged_paged_attention(q, kp, vp, tables, seq, pos, window_pages=8, layer=1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_the_native_kernel_gives_zeros_past_the_table_and_clips_page_ids() -> None:
    """A token whose position is at or past M x page_size (an idle row, as the per-slot engine
    passed T_max) gets zeros while the other tokens are unaffected; page ids outside [0, P) in a
    table are clipped into it, as XLA's path clips them."""
    rng = np.random.default_rng(10)
    kp = jnp.asarray(rng.standard_normal((1, 8, 1, 4, 16)), jnp.float32)
    vp = jnp.asarray(rng.standard_normal((1, 8, 1, 4, 16)), jnp.float32)
    tables = jnp.asarray([[3, 99, -5]], jnp.int32)  # 12 positions, on pages 3, 7 and 0
    rows = jnp.zeros(4, jnp.int32)
    positions = jnp.asarray([9, 12, 5, 40], jnp.int32)
    q = jnp.asarray(rng.standard_normal((4, 1, 2, 16)) * 0.25, jnp.float32)
    got = np.asarray(cpu_paged_attention.paged_attention(q, kp, vp, tables, rows, positions, 0))
    assert not got[[1, 3]].any() and np.abs(got[[0, 2]]).min() > 0
    clipped = jnp.asarray([[3, 7, 0]], jnp.int32)
    want = ragged_paged_attention(
        q, kp, vp, clipped, rows, positions.at[1].set(0).at[3].set(0), window_pages=3, layer=0
    )
    np.testing.assert_allclose(got[[0, 2]], np.asarray(want)[[0, 2]], rtol=1e-5, atol=1e-5)


@needs_kernels
def test_the_native_kernels_bad_operands_are_errors_not_crashes() -> None:
    """Shapes, dtypes and a layer the decode kernel does not take: its error message, no crash
    (the prefill kernel's are in test_native_paged_prefill.py)."""
    rng = np.random.default_rng(11)
    kp = jnp.asarray(rng.standard_normal((2, 4, 2, 8, 32)), jnp.float32)
    vp = jnp.asarray(rng.standard_normal((2, 4, 2, 8, 32)), jnp.float32)
    tables = jnp.zeros((1, 4), jnp.int32)
    rows = jnp.zeros(5, jnp.int32)
    positions = jnp.arange(5, dtype=jnp.int32)
    q = jnp.zeros((5, 2, 3, 32), jnp.float32)

    def call(q=q, kp=kp, vp=vp, tables=tables, rows=rows, positions=positions, layer=0):  # type: ignore[no-untyped-def]
        return np.asarray(cpu_paged_attention.paged_attention(q, kp, vp, tables, rows, positions, layer))

    call()  # the operands as they are are fine
    bad: list[tuple[dict, str]] = [
        ({"q": jnp.zeros((5, 2, 9, 32))}, "between 1 and 8"),
        ({"q": jnp.zeros((5, 2, 3, 24)), "kp": kp[..., :24], "vp": vp[..., :24]}, "multiple of 16"),
        ({"q": jnp.zeros((5, 3, 3, 32))}, "with q's K and H"),
        ({"vp": vp[:, :3]}, "keys and values alike"),
        ({"kp": kp.astype(jnp.bfloat16)}, "both float32, both bfloat16 \\(or its bits, uint16\\) or both int8"),
        (
            {"kp": kp.astype(jnp.float16), "vp": vp.astype(jnp.float16)},
            "both float32, both bfloat16 \\(or its bits, uint16\\) or both int8",
        ),
        ({"kp": kp.astype(jnp.int8), "vp": vp.astype(jnp.int8)}, r"\(H \+ 2 in int8\)"),  # rows without scales
        ({"positions": positions[:4]}, r"rows and positions must be \[N\]"),
        ({"tables": jnp.zeros(4, jnp.int32)}, r"page tables must be \[R, M\]"),
        ({"layer": 2}, "layer out of range"),
        ({"layer": -1}, "layer out of range"),
    ]
    for kwargs, message in bad:
        # The kernel's INVALID_ARGUMENT: a JaxRuntimeError, or a ValueError from a call whose
        # executable jax has cached (the layer cases).
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match=message):
            call(**kwargs)


def test_the_native_kernels_support_what_they_are_instantiated_for() -> None:
    """1 to 8 query heads per KV head, head_dim a multiple of 16, a float32, bfloat16 or int8
    cache; the backend's ``supports`` is the kernels'."""
    assert cpu_paged_attention.supports(3, 64, jnp.float32)
    assert cpu_paged_attention.supports(8, 128, jnp.bfloat16)
    assert cpu_paged_attention.supports(4, 64, jnp.int8)
    assert cpu_paged_attention.supports(1, 16, jnp.float32)
    assert not cpu_paged_attention.supports(3, 60, jnp.float32)  # head_dim not a multiple of 16
    assert not cpu_paged_attention.supports(9, 64, jnp.float32)  # more than 8 query heads per KV head
    assert not cpu_paged_attention.supports(0, 64, jnp.float32)
    assert not cpu_paged_attention.supports(3, 64, jnp.float16)
    assert cpu_attention.supports is cpu_paged_attention.supports


def rounding_bound(step: Step) -> np.ndarray:
    """[N, K, G] first-order bound on how far bfloat16 rounding of the keys and values moves
    each output row: with dk, dv = rounded - exact over the token's positions, a convex
    combination of value rows moves by at most max |dv|, and the softmax weights' total change
    is at most 2 max_s |q . dk_s| (each score moves by q . dk_s; the weights' first-order change
    p_s (d_s - sum p d) sums in absolute value to at most twice the largest |d_s|), which moves
    the output by at most that times max |v|. 1.25x covers the second-order terms."""
    bound = np.zeros(step.q.shape[:3])
    for n, (s, p) in enumerate(zip(step.seq_of_token, step.positions, strict=True)):
        if not (0 <= s < len(step.dense_k) and p >= 0):
            continue
        k, v = step.dense_k[s][: p + 1], step.dense_v[s][: p + 1]  # [S, K, H]
        dk, dv = as_bf16(k) - k, as_bf16(v) - v
        score_moves = np.abs(np.einsum("kgh,skh->kgs", step.q[n], dk)).max(-1)  # [K, G]
        bound[n] = 1.25 * (np.abs(dv).max((0, 2))[:, None] + 2 * score_moves * np.abs(v).max((0, 2))[:, None])
    return bound


@pytest.mark.parametrize("page_size", [8, 16])
def test_bfloat16_cache(page_size: int) -> None:
    """A bfloat16 cache: against the reference over the same rounded K/V to 1e-5 (attention
    widens them exactly and computes in float32), and against the unrounded K/V within the
    first-order bound of the rounding (``rounding_bound``), row by row."""
    step = mixed_step(page_size, seed=1)
    out, kp, _ = run_step(step, jnp.bfloat16)
    assert kp.dtype == jnp.bfloat16
    rounded_k, rounded_v = [as_bf16(k) for k in step.dense_k], [as_bf16(v) for v in step.dense_v]
    np.testing.assert_allclose(out, dense_attention(step, rounded_k, rounded_v), rtol=1e-5, atol=1e-5)

    err = np.abs(out - dense_attention(step, step.dense_k, step.dense_v)).max(-1)  # [N, K, G]
    bound = rounding_bound(step)
    assert (err <= bound).all(), (err / np.maximum(bound, 1e-30)).max()
    assert err.max() > 0  # the rounding did change the result: the cache really is bfloat16


@pytest.mark.parametrize("path", ["xla", pytest.param("native", marks=needs_kernels)])
@pytest.mark.parametrize("page_size", [8, 16])
def test_an_int8_cache(page_size: int, path: str) -> None:
    """An 8-bit cache: every path against the reference over the same K/V quantized by numpy's
    rule (``as_int8``) to 1e-5 (each path decodes codes x scale exactly and computes in
    float32), and within 2% of the largest output of the unquantized K/V's."""
    step = mixed_step(page_size, seed=1)
    kwargs: dict[str, Any] = {"native": path == "native", "stacked": True}
    for block in (None, 4):
        blocks = in_sequence_blocks(step, block) if block else step
        out, kp, _ = run_step(blocks, jnp.int8, block=block, **kwargs)
        assert kp.dtype == jnp.int8 and kp.shape[-1] == CFG.head_dim + 2
        quantized_k, quantized_v = [as_int8(k) for k in blocks.dense_k], [as_int8(v) for v in blocks.dense_v]
        np.testing.assert_allclose(out, dense_attention(blocks, quantized_k, quantized_v), rtol=1e-5, atol=1e-5)
        exact = dense_attention(blocks, blocks.dense_k, blocks.dense_v)
        err = np.abs(out - exact).max()
        assert 0 < err < 0.02 * np.abs(exact).max()  # the codes really are read


@pytest.mark.parametrize("stacked", [False, True], ids=["one-layer", "stacked"])
@pytest.mark.parametrize(("page_size", "block"), [(8, 8), (8, 5), (16, 32), (16, 1)])
def test_sequence_blocks_match_dense_attention(page_size: int, block: int, stacked: bool) -> None:
    """``ragged_paged_attention_blocks`` on a layout that keeps the promise (each block's real
    tokens of one sequence; blocks not aligned with pages when ``block`` is 5) equals the
    dense reference, padding zeros included."""
    step = in_sequence_blocks(mixed_step(page_size, seed=6), block)
    out, _, _ = run_step(step, jnp.float32, stacked=stacked, block=block)
    np.testing.assert_allclose(out, dense_attention(step, step.dense_k, step.dense_v), rtol=1e-5, atol=1e-5)
    padding = (step.seq_of_token < 0) | (step.seq_of_token >= len(step.dense_k)) | (step.positions < 0)
    assert not out[padding].any()


@pytest.mark.parametrize(
    "path",
    [
        "xla",
        "xla-blocks",
        pytest.param("native", marks=needs_kernels),
        pytest.param("native-blocks", marks=needs_kernels),
    ],
)
@pytest.mark.parametrize("window", [1, 5, 16, 21])
def test_a_sliding_window_attends_only_its_latest_positions(window: int, path: str) -> None:
    """A local layer's window (Gemma 3's sliding window, passed traced as the scanned layers pass
    it): each token attends only its ``window`` latest positions, on XLA's paths and the native
    kernels, per token and in sequence blocks (5 tokens, not aligned with the 8-position pages).
    Windows of 1 (the token alone), shorter and longer than a page and than some sequences."""
    block = 5 if path.endswith("blocks") else None
    step = mixed_step(8, seed=window)
    step = in_sequence_blocks(step, block) if block else step
    out, _, _ = run_step(step, jnp.float32, stacked=True, block=block, native=path.startswith("native"), window=window)
    want = dense_attention(step, step.dense_k, step.dense_v, window)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    whole = dense_attention(step, step.dense_k, step.dense_v)
    assert np.abs(want - whole).max() > 1e-2  # the window does cut keys off here


def test_a_broken_block_promise_zeroes_only_the_strays() -> None:
    """A block whose real tokens belong to two sequences: the tokens of the block's first
    sequence are right, the others' outputs are exact zeros (not another sequence's keys, not
    NaN)."""
    step = mixed_step(8, seed=7)
    block = len(step.positions)  # one block: its first real token's sequence is the block's
    out, _, _ = run_step(step, jnp.float32, block=block)
    ref = dense_attention(step, step.dense_k, step.dense_v)
    real = (step.seq_of_token >= 0) & (step.seq_of_token < len(step.dense_k)) & (step.positions >= 0)
    first = step.seq_of_token[np.flatnonzero(real)[0]]
    member = real & (step.seq_of_token == first)
    assert member.any() and (real & ~member).any()
    np.testing.assert_allclose(out[member], ref[member], rtol=1e-5, atol=1e-5)
    assert np.isfinite(out).all() and not out[~member].any()


def test_query_blocks_give_the_same_result() -> None:
    """Blocks of 7 tokens (N is not a multiple: the last block is padded) equal all at once."""
    step = mixed_step(8, seed=2)
    whole, _, _ = run_step(step, jnp.float32)
    blocked, _, _ = run_step(step, jnp.float32, query_block=7)
    assert len(step.positions) % 7 != 0
    np.testing.assert_allclose(blocked, whole, rtol=1e-6, atol=1e-6)


def test_the_pages_hold_each_sequence_at_its_slots() -> None:
    """After the step every sequence's dense K/V is where its page table says, shared pages once."""
    step = mixed_step(16, seed=3)
    _, kp, vp = run_step(step, jnp.float32)
    kp, vp = np.asarray(kp), np.asarray(vp)
    for s, (k, v) in enumerate(zip(step.dense_k, step.dense_v, strict=True)):
        for p in range(len(k)):
            page, off = step.page_tables[s, p // 16], p % 16
            np.testing.assert_array_equal(kp[page, :, off], k[p])
            np.testing.assert_array_equal(vp[page, :, off], v[p])


def test_slot_mapping() -> None:
    tables = jnp.asarray([[5, 2, 7], [1, 0, 3]], jnp.int32)
    seq = jnp.asarray([0, 0, 1, 1, -1, 2, 0], jnp.int32)
    pos = jnp.asarray([0, 9, 4, 11, 3, 0, -2], jnp.int32)
    # page size 4: (0, 0) -> page 5 offset 0; (0, 9) -> page 7 offset 1; (1, 4) -> page 0 offset 0;
    # (1, 11) -> page 3 offset 3; then three padding tokens
    assert slot_mapping(tables, seq, pos, 4).tolist() == [20, 29, 0, 15, -1, -1, -1]


def test_write_kv_drops_out_of_range_slots() -> None:
    """-1, P * page_size and beyond are dropped: never clamped onto the last slot, never wrapped
    (a scatter would send -1 to the last page's last offset)."""
    num_pages, ps = 3, 4
    shape = PagedKVCache.shape(CFG, num_pages, ps)  # [L, P, K, ps, H]
    slots = jnp.asarray([-1, num_pages * ps, 5, num_pages * ps + 7, -ps - 1, 11], jnp.int32)
    new = jnp.arange(1, 7, dtype=jnp.float32)[:, None, None] * jnp.ones((6, K, H))
    expected = np.zeros(shape[1:], np.float32)
    expected[1, :, 1] = 3.0  # slot 5
    expected[2, :, 3] = 6.0  # slot 11, the last one: written once, by its own token only

    kp, vp = jax.jit(write_kv)(jnp.zeros(shape[1:]), jnp.zeros(shape[1:]), slots, new, -new)  # one layer
    np.testing.assert_array_equal(np.asarray(kp), expected)
    np.testing.assert_array_equal(np.asarray(vp), -expected)

    # The stacked form, layer 1 (a traced index): the other layers stay untouched.
    kp, vp = jax.jit(write_kv)(jnp.zeros(shape), jnp.zeros(shape), slots, new, -new, jnp.int32(1))
    stacked = np.zeros(shape, np.float32)
    stacked[1] = expected
    np.testing.assert_array_equal(np.asarray(kp), stacked)
    np.testing.assert_array_equal(np.asarray(vp), -stacked)


def test_a_jitted_step_has_2_plus_metadata_leaves_whatever_the_pool() -> None:
    """A step over L layers (each: write the new tokens into the stacked pages at its layer,
    attend) takes 2 cache arrays and six metadata arrays, for a pool of 16 pages as for 256; and
    its result is dense attention over the new tokens (two first chunks, nothing cached
    before)."""
    L, ps = 3, 8
    cfg = dataclasses.replace(CFG, num_layers=L)
    rng = np.random.default_rng(4)
    lens = [5, 11]
    seq = np.array([0] * lens[0] + [1] * lens[1] + [-1], np.int32)
    pos = np.array([*range(lens[0]), *range(lens[1]), 0], np.int32)
    N = len(seq)
    q = (rng.standard_normal((N, K, G, H)) * H**-0.5).astype(np.float32)
    k_new = rng.standard_normal((N, K, H)).astype(np.float32)
    v_new = rng.standard_normal((N, K, H)).astype(np.float32)
    tables = np.array([[6, 1], [3, 9]], np.int32)

    def step(cache, q, k_new, v_new, page_tables, seq_of_token, positions):  # type: ignore[no-untyped-def]
        slots = slot_mapping(page_tables, seq_of_token, positions, cache.page_size)
        outs, k, v = [], cache.k, cache.v
        for i in range(cache.num_layers):
            k, v = write_kv(k, v, slots, k_new * (i + 1), v_new, i)
            outs.append(ragged_paged_attention(q, k, v, page_tables, seq_of_token, positions, window_pages=2, layer=i))
        return jnp.stack(outs), PagedKVCache(k=k, v=v)

    fn = jax.jit(step, donate_argnums=0)
    for num_pages in (16, 256):
        cache = PagedKVCache.zeros(cfg, num_pages, ps)
        args = (cache, q, k_new, v_new, tables, seq, pos)
        assert len(jax.tree.leaves(args)) == 2 + 6
        out, cache = fn(*args)
        assert cache.num_pages == num_pages and len(jax.tree.leaves(cache)) == 2
    for i in range(L):
        ref_step = Step(ps, 256, tables, 2, [], [], [], seq, pos, q)
        dense_k = [k_new[seq == s] * (i + 1) for s in range(2)]
        dense_v = [v_new[seq == s] for s in range(2)]
        np.testing.assert_allclose(
            np.asarray(out[i]), dense_attention(ref_step, dense_k, dense_v), rtol=1e-5, atol=1e-5
        )


def test_the_cache_container() -> None:
    cache = PagedKVCache.zeros(CFG, num_pages=10, page_size=16, dtype=jnp.bfloat16)
    assert (cache.num_layers, cache.num_pages, cache.page_size, cache.num_slots) == (CFG.num_layers, 10, 16, 160)
    # A bfloat16 cache's pages hold its bits (``storage_dtype``); an 8-bit one's rows H + 2 bytes.
    assert all(a.shape == (CFG.num_layers, 10, K, 16, H) and a.dtype == jnp.uint16 for a in (cache.k, cache.v))
    int8 = PagedKVCache.zeros(CFG, num_pages=10, page_size=16, dtype=jnp.int8)
    assert int8.k.shape == (CFG.num_layers, 10, K, 16, H + 2) and int8.k.dtype == jnp.int8
    assert int8.nbytes() == 2 * CFG.num_layers * 10 * K * 16 * kv_row_bytes(H, "int8")
    assert cache.nbytes() == 2 * CFG.num_layers * 10 * K * 16 * H * 2
    assert cache.nbytes() == CFG.kv_bytes_per_token(2) * cache.num_slots
    abstract = PagedKVCache.abstract(CFG, 10, 16, jnp.bfloat16)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(lambda a: (a.shape, a.dtype), cache)
    assert len(jax.tree.leaves(cache)) == 2
    assert PagedKVCache.shape(CFG, 10, 16) == (CFG.num_layers, 10, K, 16, H)
    for bad in ((0, 16), (10, 0)):
        with pytest.raises(ValueError, match="must be >= 1"):
            PagedKVCache.zeros(CFG, *bad)
    with pytest.raises(ValueError, match="window_pages"):
        ragged_paged_attention(jnp.zeros((1, K, G, H)), cache.k, cache.v, jnp.zeros((1, 2), jnp.int32),
                               jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), window_pages=3, layer=0)  # fmt: skip
    with pytest.raises(ValueError, match="window_pages"):
        ragged_paged_attention_blocks(jnp.zeros((1, K, G, H)), cache.k[0], cache.v[0], jnp.zeros((1, 2), jnp.int32),
                                      jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), window_pages=0, block=4)  # fmt: skip
    with pytest.raises(ValueError, match="block must be >= 1"):
        ragged_paged_attention_blocks(jnp.zeros((1, K, G, H)), cache.k[0], cache.v[0], jnp.zeros((1, 2), jnp.int32),
                                      jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), window_pages=1, block=0)  # fmt: skip


def test_kv_heads_split_over_the_model_axis() -> None:
    """With a 1x2 layout the rules split the stacked pages' kv_heads axis over ``model``, pages
    over ``data`` (of size 1 here: each data replica its own pool) and nothing else (layers and
    page_len whole); the step on pages sharded that way gives the unsharded result."""
    from sharding.layouts import load_layout
    from sharding.mesh import make_mesh
    from sharding.plan import make_plan
    from sharding.rules import spec_for

    layout = load_layout("1x2")
    mesh = make_mesh(layout)
    step = mixed_step(8, seed=5)
    shape = PagedKVCache.shape(CFG, step.num_pages, step.page_size)
    spec = spec_for(PAGE_AXES, shape, make_plan(layout, CFG).rules, mesh, "pages")
    assert spec == P(None, "data", "model", None, None)
    whole, kp, vp = run_step(step, jnp.float32)
    sharding = NamedSharding(mesh, spec)
    # The one layer as layer 1 of a stacked [2, P, K, page_size, H] array (layer 0 zeros).
    kp = jax.device_put(jnp.stack([jnp.zeros_like(kp), kp]), sharding)
    vp = jax.device_put(jnp.stack([jnp.zeros_like(vp), vp]), sharding)
    fn = jax.jit(
        lambda q, kp, vp: ragged_paged_attention(
            q, kp, vp, jnp.asarray(step.page_tables), jnp.asarray(step.seq_of_token), jnp.asarray(step.positions),
            window_pages=step.window_pages, layer=jnp.int32(1),
        )
    )  # fmt: skip
    out = fn(jnp.asarray(step.q), kp, vp)
    assert math.prod(mesh.devices.shape) == 2 and len(kp.addressable_shards) == 2
    np.testing.assert_allclose(np.asarray(out), whole, rtol=1e-6, atol=1e-6)
