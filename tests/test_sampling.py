"""Sampling inside the jitted step: per-slot parameters, edge values, determinism."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.native import cpu_argmax
from model.sampling import SamplingParams, first_argmax, sample, seed_to_key

V = 50
sample_jit = jax.jit(sample)


def _params(temperature, top_k, top_p, seeds) -> SamplingParams:  # type: ignore[no-untyped-def]
    host = SamplingParams.host(len(seeds))
    host.update(
        temperature=np.asarray(temperature, np.float32),
        top_k=np.asarray(top_k, np.int32),
        top_p=np.asarray(top_p, np.float32),
        keys=np.stack([seed_to_key(s) for s in seeds]),
    )
    return SamplingParams(**{k: jnp.asarray(v) for k, v in host.items()})


def _logits(rows: int, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=(rows, V)).astype(np.float32) * 2)


def test_greedy_rows_take_argmax_whatever_other_rows_do() -> None:
    logits = _logits(4)
    sp = _params([0.0, 1.0, 0.0, 0.7], [0, 0, 0, 3], [1.0, 1.0, 1.0, 0.5], [1, 2, 3, 4])
    out = np.asarray(sample_jit(logits, sp, jnp.arange(4)))
    greedy = np.asarray(jnp.argmax(logits, -1))
    assert out[0] == greedy[0] and out[2] == greedy[2]


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = _logits(3, seed=1)
    sp = _params([0.7, 0.7, 5.0], [1, 0, 1], [1.0, 1e-6, 1.0], [1, 2, 3])
    for pos in range(20):
        out = np.asarray(sample_jit(logits, sp, jnp.full(3, pos)))
        np.testing.assert_array_equal(out, np.asarray(jnp.argmax(logits, -1)))


def test_top_k_at_or_above_vocab_is_disabled() -> None:
    logits = _logits(1, seed=2)
    draws = {}
    for k in (0, V, 10 * V):
        sp = _params([1.0], [k], [1.0], [9])
        draws[k] = [int(sample_jit(logits, sp, jnp.array([p]))[0]) for p in range(30)]
    assert draws[0] == draws[V] == draws[10 * V]


def test_top_k_restricts_to_the_k_most_likely() -> None:
    logits = _logits(1, seed=3)
    allowed = set(np.argsort(-np.asarray(logits[0]))[:3].tolist())
    sp = _params([2.0], [3], [1.0], [5])
    seen = {int(sample_jit(logits, sp, jnp.array([p]))[0]) for p in range(200)}
    assert seen <= allowed and len(seen) > 1


def test_top_p_keeps_the_nucleus() -> None:
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)], jnp.float32))
    sp = _params([1.0], [0], [0.7], [11])
    seen = {int(sample_jit(logits, sp, jnp.array([p]))[0]) for p in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.7 needs token 1; 0.8 >= 0.7 stops before token 2


def test_a_huge_temperature_still_filters_the_most_likely_ids() -> None:
    """At temperature 1e38 the scaled logits round to equal zeros; top-k and top-p must still
    keep the ids the raw logits rank first (ranking the ties gave ids 0, 1, ...: the field's
    top_k = 1 at 1e38 answered <|endoftext|>, id 0, every time)."""
    logits = _logits(1, seed=4)
    ranked = np.argsort(-np.asarray(logits[0]), kind="stable")
    assert ranked[0] != 0  # else the old ranking of ties would pass by chance
    greedy = [int(sample_jit(logits, _params([1e38], [1], [1.0], [s]), jnp.array([0]))[0]) for s in range(5)]
    assert greedy == [int(ranked[0])] * 5
    top5 = {int(sample_jit(logits, _params([3e38], [5], [1.0], [7]), jnp.array([p]))[0]) for p in range(200)}
    assert top5 == set(ranked[:5].tolist())  # uniform over the five: each drawn in 200 tries
    # Uniform mass 1/50 each: the nucleus of 0.45 is the 23 ids ranked first (0.44 < 0.45 <= 0.46).
    nucleus = {int(sample_jit(logits, _params([1e38], [0], [0.45], [8]), jnp.array([p]))[0]) for p in range(400)}
    assert nucleus <= set(ranked[:23].tolist()) and len(nucleus) > 10


def test_frequencies_follow_the_softmax() -> None:
    probs = np.array([0.6, 0.3, 0.1] + [0.0] * (V - 3))
    logits = jnp.log(jnp.asarray(probs[None] + 1e-12, jnp.float32))
    sp = _params([1.0], [0], [1.0], [123])
    n = 3000
    draws = np.array([int(sample_jit(logits, sp, jnp.array([p]))[0]) for p in range(n)])
    freq = np.bincount(draws, minlength=V)[:3] / n
    np.testing.assert_allclose(freq, probs[:3], atol=0.04)


def test_same_seed_same_position_same_token_in_any_row() -> None:
    logits = jnp.tile(_logits(1, seed=4), (3, 1))
    sp = _params([1.0, 1.0, 1.0], [0, 0, 0], [1.0, 1.0, 1.0], [42, 7, 42])
    outs = [np.asarray(sample_jit(logits, sp, jnp.array([p, p, p]))) for p in range(40)]
    assert all(o[0] == o[2] for o in outs)
    assert any(o[0] != o[1] for o in outs)


@pytest.fixture(params=["xla", "native"])
def argmax(request: pytest.FixtureRequest) -> Callable[[jax.Array], jax.Array]:
    """``first_argmax`` in XLA and as the native CPU kernel (``model.native.cpu_argmax``)."""
    if request.param == "xla":
        return first_argmax
    assert cpu_argmax.available(), "the kernel must build on a machine with g++ (CI has it)"
    return cpu_argmax.first_argmax


@pytest.mark.parametrize("width", [1000, 49152, 7])  # a vector tail; SmolLM2's vocabulary; tail only
def test_first_argmax_matches_argmax_with_ties_and_infinities(
    argmax: Callable[[jax.Array], jax.Array], width: int
) -> None:
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((7, width)).astype(np.float32)
    logits[1, [3, width - 2]] = 50.0  # a tie: the first index wins, as with argmax
    logits[2, :] = -np.inf  # a fully masked row: index 0
    logits[3, width - 1] = np.inf
    logits[4, :] = 7.0  # all equal
    logits[5, [width // 2, width // 2 + 1]] = 60.0  # a tie inside one 16-float vector
    got = np.asarray(jax.jit(argmax)(jnp.asarray(logits)))
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    assert got.dtype == np.int32 and got.shape == (7,)
    logits[6, width // 3] = np.nan  # a NaN row still gives a valid id; the kernel's is width - 1
    nan_row = int(jax.jit(argmax)(jnp.asarray(logits))[6])
    assert 0 <= nan_row < width
    assert argmax is first_argmax or nan_row == width - 1


def test_sample_with_the_native_argmax_matches_xla() -> None:
    """Greedy and seeded sampled slots draw the same ids whichever argmax ``sample`` uses."""
    logits = _logits(4, seed=9)
    sp = _params([0.0, 1.0, 0.7, 0.0], [0, 0, 40, 0], [1.0, 1.0, 0.9, 1.0], [1, 2, 3, 4])
    positions = jnp.array([5, 6, 7, 8])
    want = np.asarray(jax.jit(sample)(logits, sp, positions))
    got = np.asarray(jax.jit(lambda *a: sample(*a, argmax=cpu_argmax.first_argmax))(logits, sp, positions))
    np.testing.assert_array_equal(got, want)


def _random_mask(rows: int, vocab: int, seed: int) -> np.ndarray:
    """A packed token mask [rows, W] int32 (llguidance's layout) with random allowed ids, at least
    one per row; the last row allows every id."""
    rng = np.random.default_rng(seed)
    allowed = rng.random((rows, vocab)) < 0.2
    allowed[:, rng.integers(0, vocab)] = True
    allowed[-1] = True
    bits = np.zeros((rows, -(-vocab // 32) * 32), bool)
    bits[:, :vocab] = allowed
    bits[-1] = True
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


def test_the_token_mask_is_llguidances_and_sampling_stays_inside_it() -> None:
    """``apply_token_mask`` forbids exactly the ids llguidance's own numpy reference
    (``apply_token_bitmask_inplace``) does; greedy and sampled ids stay among the allowed ids,
    greedy ones the best allowed; a row with every bit set samples as without a mask."""
    import llguidance.numpy

    from model.sampling import NEG_INF, apply_token_mask

    rows = 6
    logits = np.asarray(_logits(rows, seed=4))
    mask = _random_mask(rows, V, seed=2)
    expected = logits.copy()
    llguidance.numpy.apply_token_bitmask_inplace(expected, mask)
    got = np.asarray(apply_token_mask(jnp.asarray(logits), jnp.asarray(mask)))
    allowed = np.isfinite(expected)
    assert np.array_equal(got[allowed], logits[allowed]) and np.all(got[~allowed] == np.float32(NEG_INF))
    greedy = np.asarray(sample_jit(jnp.asarray(logits), _params([0.0] * rows, [0] * rows, [1.0] * rows, range(rows)), jnp.zeros(rows, jnp.int32), mask=jnp.asarray(mask)))  # fmt: skip
    assert np.array_equal(greedy, np.argmax(expected, axis=-1))
    for seed in range(5):
        sp = _params([1.0] * rows, [0] * rows, [1.0] * rows, [seed + 10 * r for r in range(rows)])
        drawn = np.asarray(sample_jit(jnp.asarray(logits), sp, jnp.full(rows, 7, jnp.int32), mask=jnp.asarray(mask)))
        assert all(allowed[r, drawn[r]] for r in range(rows))
        free = np.asarray(sample_jit(jnp.asarray(logits), sp, jnp.full(rows, 7, jnp.int32)))
        assert drawn[-1] == free[-1]  # the unconstrained row draws what it draws without any mask
