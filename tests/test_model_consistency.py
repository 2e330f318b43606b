"""The model's one forward (``model.llama.ragged_step``) on the tests' tiny model, in every form
its weights take and through every attention backend, against the cache-less dense reference
(``reference.dense_logits``) at every position of two prompts; the forms and the backends
against each other; a bfloat16 KV cache against the float32 one; and ``fuse_projections``.

The scenario (``SCRIPT``): two sequences in rows 1 (prompt A, 37 tokens) and 0 (prompt B, 15)
over scattered pages of 4 positions, fed over four steps of one shape (``N`` tokens: a decode
region of ``D`` tokens, then blocks of ``BLOCK``): first chunks of both, second chunks that
attend to their cached prefixes, then two decode steps, the next prompt token fed each time
(teacher forcing, so every position's logits have a reference). Every token's logits are taken
(``last_index`` = every index), so each step checks every real token.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from reference import CFG, GRAPHDEF, PARAMS, dense_logits

from model.attention import cpu as cpu_attention
from model.attention.base import StepMeta
from model.attention.pages import PagedKVCache, from_stored
from model.attention.xla import XlaAttention
from model.kernels import choose, to_form
from model.llama import fuse_projections, ragged_step, unstack_layers
from model.native import cpu_matmul

NATIVE = jax.devices()[0].platform == "cpu" and cpu_attention.available()
BACKENDS = {"xla": XlaAttention(), **({"native": cpu_attention.NativeCpuAttention()} if NATIVE else {})}
FORMS = ["scan", "unrolled", *(["panels"] if cpu_matmul.available() else [])]

PAGE, ROWS, MAX_PAGES = 4, 2, 10  # 40 positions a sequence
N, D, BLOCK = 48, 8, 8  # every step: 8 decode tokens, then 40 in blocks of 8
_rng = np.random.default_rng(11)
PROMPTS = {
    1: _rng.integers(0, CFG.vocab_size, 37).astype(np.int32),
    0: _rng.integers(0, CFG.vocab_size, 15).astype(np.int32),
}
TABLES = _rng.permutation(ROWS * MAX_PAGES + 3)[: ROWS * MAX_PAGES].reshape(ROWS, MAX_PAGES).astype(np.int32)
NUM_PAGES = ROWS * MAX_PAGES + 3
# Each step: ("decode" | "chunk", row, first position, tokens).
SCRIPT = [
    [("chunk", 1, 0, 16), ("chunk", 0, 0, 7)],
    [("chunk", 1, 16, 19), ("chunk", 0, 7, 6)],
    [("decode", 1, 35, 1), ("decode", 0, 13, 1)],
    [("decode", 0, 14, 1), ("decode", 1, 36, 1)],
]


def step_inputs(step: list[tuple[str, int, int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, rows, positions) [N] of one step: decode tokens from 0, chunks from block
    boundaries of the region at ``D``, the rest padding (row -1, position -1)."""
    tokens, rows, positions = np.zeros(N, np.int32), np.full(N, -1, np.int32), np.full(N, -1, np.int32)
    decode_at, chunk_at = 0, D
    for kind, row, start, n in step:
        if kind == "decode":
            i, decode_at = decode_at, decode_at + 1
        else:
            i, chunk_at = chunk_at, chunk_at + -(-n // BLOCK) * BLOCK
        tokens[i : i + n] = PROMPTS[row][start : start + n]
        rows[i : i + n], positions[i : i + n] = row, np.arange(start, start + n)
    assert decode_at <= D and chunk_at <= N
    return tokens, rows, positions


def params_in(form: str) -> tuple[nnx.GraphDef, nnx.State]:
    """The tiny model's weights stacked (scan), per layer (unrolled), or stacked with the matmul
    weights packed into panels (``model.kernels.to_form``)."""
    if form == "unrolled":
        return GRAPHDEF, unstack_layers(PARAMS)
    if form == "panels":
        kernels = dataclasses.replace(
            choose(jax.devices()[:1], CFG, jnp.float32, jnp.float32), panels=True, layer_loop="scan"
        )
        return to_form(GRAPHDEF, PARAMS, kernels)
    return GRAPHDEF, PARAMS


@functools.cache
def run(form: str, backend: str, kv_dtype: str = "float32") -> tuple[list[np.ndarray], PagedKVCache]:
    """Every step of ``SCRIPT`` through ``ragged_step``: each step's logits [N, V] (every token's),
    and the cache after the last."""
    graphdef, params = params_in(form)
    attention = BACKENDS[backend]

    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, cache, tokens, rows, positions):  # type: ignore[no-untyped-def]
        meta = StepMeta.build(
            jnp.asarray(TABLES), rows, positions, PAGE, window_pages=MAX_PAGES, decode_tokens=D, seq_block=BLOCK
        )
        return ragged_step(nnx.merge(graphdef, params), cache, tokens, meta, jnp.arange(N, dtype=jnp.int32), attention)

    cache = PagedKVCache.zeros(CFG, NUM_PAGES, PAGE, jnp.dtype(kv_dtype))
    out = []
    for s in SCRIPT:
        logits, cache = step(params, cache, *step_inputs(s))
        out.append(np.asarray(logits))
    return out, cache


def real_tokens(step: list[tuple[str, int, int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(indices, rows, positions) of a step's real tokens."""
    _, rows, positions = step_inputs(step)
    real = np.flatnonzero(rows >= 0)
    return real, rows[real], positions[real]


@functools.cache
def dense(row: int) -> np.ndarray:
    return dense_logits(GRAPHDEF, PARAMS, PROMPTS[row])


def by_position(logits: list[np.ndarray]) -> dict[int, np.ndarray]:
    """Each row's logits [len(prompt), V] gathered from the steps, by position."""
    out = {row: np.full((len(p), CFG.vocab_size), np.nan, np.float32) for row, p in PROMPTS.items()}
    for step, step_logits in zip(SCRIPT, logits, strict=True):
        real, rows, positions = real_tokens(step)
        for i, r, p in zip(real, rows, positions, strict=True):
            out[int(r)][p] = step_logits[i]
    return out


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("form", FORMS)
def test_every_position_matches_the_dense_reference(form: str, backend: str) -> None:
    """Every position of both prompts (first chunks, chunks after a cached prefix, decode
    tokens), each form of the weights, each backend: the dense forward's logits."""
    logits, _ = run(form, backend)
    got = by_position(logits)
    for row in PROMPTS:
        assert not np.isnan(got[row]).any()  # the script covers every position
        np.testing.assert_allclose(got[row], dense(row), rtol=1e-5, atol=1e-5, err_msg=f"row {row}")


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_stacked_and_per_layer_weights_give_the_same_logits_and_cache(backend: str) -> None:
    """The scanned loop over stacked weights and the unrolled loop over per-layer weights: the
    same logits of every token and the same pages, step after step."""
    (scan, scan_cache), (unrolled, unrolled_cache) = run("scan", backend), run("unrolled", backend)
    for a, b in zip(scan, unrolled, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(scan_cache.k), np.asarray(unrolled_cache.k), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(scan_cache.v), np.asarray(unrolled_cache.v), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not NATIVE, reason="native CPU kernels not built")
@pytest.mark.parametrize("form", FORMS)
def test_the_native_backend_gives_xlas_logits(form: str) -> None:
    """Both regions through the native kernels against XLA's gathers and dots, real tokens and
    padding alike (a padding token attends to nothing, its output zeros, in both)."""
    for a, b in zip(run(form, "native")[0], run(form, "xla")[0], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_bfloat16_cache_is_close_to_float32(backend: str) -> None:
    """Keys and values rounded to bfloat16 once, when written (a relative error of at most
    2^-9 each): every real token's logits within 1% of the logits' spread of the float32
    cache's, not equal to them (the cache really is bfloat16), and the pages hold the float32
    run's keys rounded."""
    (bf16, bf16_cache), (f32, f32_cache) = run("scan", backend, "bfloat16"), run("scan", backend)
    assert bf16_cache.k.dtype == jnp.uint16  # bfloat16's bits (pages.storage_dtype)
    errors = []
    for step, a, b in zip(SCRIPT, bf16, f32, strict=True):
        real, _, _ = real_tokens(step)
        spread = np.abs(b[real]).max()
        err = np.abs(a[real] - b[real]).max()
        assert err <= 1e-2 * spread, (err, spread)
        errors.append(err)
    assert max(errors) > 0
    # Layer 0's keys are the same in both runs up to the rounding (its inputs are the
    # embeddings); later layers' inputs have moved by the rounding of the layers before.
    k32 = np.asarray(f32_cache.k[0])
    np.testing.assert_array_equal(
        np.asarray(from_stored(bf16_cache.k[0])), np.asarray(jnp.asarray(k32, jnp.bfloat16).astype(jnp.float32))
    )


def test_fuse_projections_groups_query_heads_by_kv_head() -> None:
    """``fuse_projections`` puts query head k*G + g at ``wqkv[..., k, g, :]`` (the head that
    Hugging Face's ``repeat_kv`` pairs with KV head k), the key and value of KV head k at
    ``wqkv[..., k, G, :]`` and ``[..., k, G + 1, :]``, gate and up at ``w_gate_up[..., 0/1, :]``,
    and passes the other weights through."""
    L, Dm, Nh, K, H, F = 2, 5, 6, 2, 4, 7
    G = Nh // K
    rng = np.random.default_rng(0)
    sep = {
        "wq": rng.standard_normal((L, Dm, Nh, H)),
        "wk": rng.standard_normal((L, Dm, K, H)),
        "wv": rng.standard_normal((L, Dm, K, H)),
        "w_gate": rng.standard_normal((L, Dm, F)),
        "w_up": rng.standard_normal((L, Dm, F)),
        "wo": rng.standard_normal((L, Nh, H, Dm)),
    }
    fused = fuse_projections(sep, K)
    assert set(fused) == {"wqkv", "w_gate_up", "wo"}
    assert fused["wqkv"].shape == (L, Dm, K, G + 2, H) and fused["w_gate_up"].shape == (L, Dm, 2, F)
    for k in range(K):
        for g in range(G):
            np.testing.assert_array_equal(fused["wqkv"][:, :, k, g], sep["wq"][:, :, k * G + g])
        np.testing.assert_array_equal(fused["wqkv"][:, :, k, G], sep["wk"][:, :, k])
        np.testing.assert_array_equal(fused["wqkv"][:, :, k, G + 1], sep["wv"][:, :, k])
    np.testing.assert_array_equal(fused["w_gate_up"][:, :, 0], sep["w_gate"])
    np.testing.assert_array_equal(fused["w_gate_up"][:, :, 1], sep["w_up"])
    assert fused["wo"] is sep["wo"]
