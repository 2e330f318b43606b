"""The penalties, min_p and the EOS ban of ``model.sampling`` against independent references:
Hugging Face's ``RepetitionPenaltyLogitsProcessor``, numpy implementations of OpenAI's
presence/frequency formula, of min_p and of the whole pipeline; the token history's updates;
``sequence_seed``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import penalized

from model.sampling import (
    SamplingParams,
    TokenHistory,
    min_p_filter,
    penalize,
    sample,
    seed_to_key,
    sequence_seed,
)

V = 64
penalize_jit = jax.jit(penalize)
sample_jit = jax.jit(sample)

# Per row: (repetition, presence, frequency); the last row is neutral.
PENALTIES = [(1.3, 0.0, 0.0), (1.0, 0.5, 0.7), (0.8, -0.3, 0.2), (1.7, 1.1, 0.4), (1.0, 0.0, 0.0)]


def _params(**fields: list[float] | list[int] | np.ndarray) -> SamplingParams:
    """Device sampling parameters for len(any field) slots: greedy and unpenalized but for ``fields``."""
    rows = len(next(iter(fields.values())))
    host = SamplingParams.host(rows)
    for name, value in fields.items():
        host[name] = np.asarray(value, host[name].dtype)
    return SamplingParams(**{k: jnp.asarray(v) for k, v in host.items()})


def _penalty_params(**extra: list[float] | list[int] | np.ndarray) -> SamplingParams:
    rep, pres, freq = (list(col) for col in zip(*PENALTIES, strict=True))
    return _params(repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq, **extra)


def _case(seed: int) -> tuple[np.ndarray, list[list[int]], list[list[int]]]:
    """Random logits [R, V] (both signs), and per row prompt ids and generated ids (with repeats);
    each row's generated ids include its raw argmax, so the penalties move the greedy id."""
    rng = np.random.default_rng(seed)
    R = len(PENALTIES)
    logits = (rng.standard_normal((R, V)) * 3).astype(np.float32)
    prompts = [rng.integers(0, V, int(rng.integers(1, 12))).tolist() for _ in range(R)]
    generated = []
    for r in range(R):
        ids = rng.integers(0, V, int(rng.integers(0, 10))).tolist()
        generated.append(ids + [int(np.argmax(logits[r]))] * int(rng.integers(1, 4)))
    return logits, prompts, generated


def _history(prompts: list[list[int]], generated: list[list[int]]) -> TokenHistory:
    counts = np.zeros((len(prompts), V), np.int32)
    in_prompt = np.zeros((len(prompts), V), bool)
    for r, (p, g) in enumerate(zip(prompts, generated, strict=True)):
        in_prompt[r, p] = True
        np.add.at(counts[r], g, 1)
    return TokenHistory(counts=jnp.asarray(counts), in_prompt=jnp.asarray(in_prompt))


def _reference_penalized(logits: np.ndarray, prompts: list[list[int]], generated: list[list[int]]) -> np.ndarray:
    """``helpers.penalized`` (Hugging Face, then OpenAI's formula) row by row, with PENALTIES."""
    return np.stack(
        [
            penalized(logits[r], prompts[r], generated[r], rep, pres, freq)
            for r, (rep, pres, freq) in enumerate(PENALTIES)
        ]
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalties_match_hugging_face_and_openai(seed: int) -> None:
    logits, prompts, generated = _case(seed)
    want = _reference_penalized(logits, prompts, generated)
    sp = _penalty_params()
    history = _history(prompts, generated)
    got = np.asarray(penalize_jit(jnp.asarray(logits), sp, history))
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(got[-1], logits[-1])  # neutral values: exactly the raw logits
    # Greedy slots take the argmax of the penalized logits, which the penalties moved in some rows.
    ids = np.asarray(sample_jit(jnp.asarray(logits), sp, jnp.zeros(len(PENALTIES), jnp.int32), history=history))
    np.testing.assert_array_equal(ids, np.argmax(want, axis=-1))
    assert (ids != np.argmax(logits, axis=-1)).sum() >= 2


def test_repetition_penalty_covers_prompt_and_output_but_counts_only_output() -> None:
    """An id seen only in the prompt gets the repetition penalty but no presence/frequency one."""
    logits = np.array([[2.0, -2.0, 2.0, -2.0] + [0.0] * (V - 4)], np.float32)
    sp = _params(repetition_penalty=[2.0], presence_penalty=[0.25], frequency_penalty=[0.5])
    history = _history([[0, 1]], [[2, 2]])  # prompt {0, 1}; 2 generated twice; 3 never seen
    got = np.asarray(penalize_jit(jnp.asarray(logits), sp, history))[0, :4]
    np.testing.assert_array_equal(got, [1.0, -4.0, 1.0 - 2 * 0.5 - 0.25, -2.0])


def _reference_min_p(scaled: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    """[R, V] bool: the ids whose probability is >= min_p times the row's largest (numpy)."""
    z = scaled - scaled.max(axis=-1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
    return probs >= min_p[:, None] * probs.max(axis=-1, keepdims=True)


def test_min_p_keeps_the_reference_set() -> None:
    rng = np.random.default_rng(5)
    scaled = rng.standard_normal((6, V)).astype(np.float32)
    min_p = np.array([0.0, 0.01, 0.1, 0.3, 0.9, 1.0], np.float32)
    got = np.asarray(jax.jit(min_p_filter)(jnp.asarray(scaled), jnp.asarray(min_p))) > -1e29
    want = _reference_min_p(scaled, min_p)
    np.testing.assert_array_equal(got, want)
    assert got[0].all() and got[-1].sum() == 1  # 0 keeps every id; 1 keeps the most likely only
    assert all(1 < n < V for n in got.sum(axis=-1)[2:4])  # 0.1 and 0.3 cut inside the vocabulary


def _reference_draw(
    scores: np.ndarray,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    gumbel: np.ndarray,
) -> np.ndarray:
    """The ids drawn from penalized ``scores`` [R, V] by temperature, top-k, top-p, then min_p,
    then Gumbel-max with noise ``gumbel`` [R, V], in numpy."""
    out = np.empty(len(scores), np.int64)
    for r in range(len(scores)):
        scaled = scores[r] / temperature[r]
        order = np.argsort(-scaled, kind="stable")
        keep = np.zeros(V, bool)
        k = V if top_k[r] <= 0 or top_k[r] >= V else top_k[r]
        top = scaled[order[:k]]
        p = np.exp(top - top.max())
        p /= p.sum()
        mass_before = np.cumsum(p) - p
        kept = mass_before < top_p[r]
        kept[0] = True
        keep[order[:k][kept]] = True
        keep &= _reference_min_p(np.where(keep, scaled, -np.inf)[None], min_p[r : r + 1])[0]
        out[r] = np.argmax(np.where(keep, scaled, -np.inf) + gumbel[r])
    return out


def test_sampled_slots_draw_what_the_reference_pipeline_draws() -> None:
    """Penalties, temperature, top-k, top-p and min_p in vLLM's order, then the Gumbel-max draw
    with the slot's noise: the same ids as a numpy pipeline, at every position."""
    logits, prompts, generated = _case(7)
    R = len(PENALTIES)
    temperature = np.array([0.7, 1.0, 1.3, 0.9, 1.0], np.float32)
    top_k = np.array([0, 20, 0, 40, 0], np.int32)
    top_p = np.array([1.0, 0.9, 0.8, 1.0, 1.0], np.float32)
    min_p = np.array([0.05, 0.0, 0.1, 0.2, 0.3], np.float32)
    seeds = [11, 12, 13, 14, 15]
    sp = _penalty_params(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, keys=np.stack([seed_to_key(s) for s in seeds])
    )
    history = _history(prompts, generated)
    penalized = _reference_penalized(logits, prompts, generated)
    keys = jax.vmap(jax.random.wrap_key_data)(jnp.asarray(sp.keys))
    draws = set()
    for pos in range(60):
        positions = jnp.full(R, pos, jnp.int32)
        got = np.asarray(sample_jit(jnp.asarray(logits), sp, positions, history=history))
        step_keys = jax.vmap(jax.random.fold_in)(keys, positions)
        gumbel = np.asarray(jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(step_keys))
        np.testing.assert_array_equal(got, _reference_draw(penalized, temperature, top_k, top_p, min_p, gumbel))
        draws.add(tuple(got))
    assert len(draws) > 10  # the rows really sample


def test_min_p_applies_after_top_p() -> None:
    """probs (0.5, 0.3, 0.15, 0.05), top_p 0.82, min_p 0.2: top-p first keeps ids {0, 1, 2} (0.8
    of the mass lies before id 2) and min_p then drops id 3 only; min_p first would renormalise
    to 0.95 and top-p would then drop id 2 too."""
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05] + [1e-12] * (V - 4)], np.float32))
    sp = _params(temperature=[1.0], top_p=[0.82], min_p=[0.2], keys=[seed_to_key(3)])
    seen = {int(sample_jit(jnp.asarray(logits), sp, jnp.array([p]))[0]) for p in range(400)}
    assert seen == {0, 1, 2}


def test_eos_ban_only_where_set() -> None:
    """Rows 0 and 1 ban their EOS ids (the raw argmax is one of them); row 2 has the same ids and
    does not ban; row 3 bans with no EOS ids. Greedy rows then pick the best other id."""
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((4, V)).astype(np.float32)
    logits[:, 5] = 10.0
    logits[:, 9] = 9.0
    eos = np.full((4, 4), -1, np.int32)
    eos[0, :2] = [5, 9]
    eos[1, :1] = [5]
    eos[2, :2] = [5, 9]
    sp = _params(eos_ids=eos, ban_eos=[True, True, False, True])
    ids = np.asarray(sample_jit(jnp.asarray(logits), sp, jnp.zeros(4, jnp.int32)))
    second = int(np.argsort(-logits[0])[2])
    assert ids.tolist() == [second, 9, 5, 5]
    # The ban holds for sampled rows too, at any temperature.
    hot = _params(eos_ids=eos, ban_eos=[True, True, False, True], temperature=[5.0] * 4, keys=[seed_to_key(1)] * 4)
    for pos in range(100):
        out = np.asarray(sample_jit(jnp.asarray(logits), hot, jnp.full(4, pos, jnp.int32)))
        assert out[0] not in (5, 9) and out[1] != 5


def test_history_rows_are_replaced_whole_and_generated_tokens_counted() -> None:
    S = 3
    history = TokenHistory.zeros(S, V)
    in_prompt = np.zeros(V, bool)
    in_prompt[[4, 7, 8, 60]] = True
    history = history.with_row(jnp.int32(1), jnp.zeros(V, jnp.int32).at[3].set(1), jnp.asarray(in_prompt))
    rows = jnp.array([0, 1, 1, 2, -1], jnp.int32)
    generated = jnp.array([True, True, True, False, True])  # row 2's token is a prompt token; -1 padding
    history = history.counted(rows, jnp.array([3, 9, 9, 5, 6], jnp.int32), generated)
    counts, prompt = np.asarray(history.counts), np.asarray(history.in_prompt)
    assert set(np.flatnonzero(prompt[1]).tolist()) == {4, 7, 8, 60} and not prompt[[0, 2]].any()
    assert (counts[0, 3], counts[1, 3], counts[1, 9]) == (1, 1, 2) and counts.sum() == 4
    # A new request in row 1 replaces the row whole (prompt and counts); other rows keep theirs.
    fresh = np.zeros(V, bool)
    fresh[5] = True
    history = history.with_row(jnp.int32(1), jnp.zeros(V, jnp.int32), jnp.asarray(fresh))
    counts, prompt = np.asarray(history.counts), np.asarray(history.in_prompt)
    assert np.flatnonzero(prompt[1]).tolist() == [5] and not counts[1].any()
    assert counts[0, 3] == 1


def test_sequence_seed() -> None:
    assert sequence_seed(0, 0) == 0 and sequence_seed(12345, 0) == 12345
    # SplitMix64 seeded with 0: its first two outputs (Vigna's splitmix64.c).
    assert sequence_seed(0, 1) == 0xE220A8397B1DCDAF
    assert sequence_seed(0, 2) == 0x6E789E6AA1B965F4
    seeds = [sequence_seed(2**64 - 1, i) for i in range(1, 200)] + [sequence_seed(7, i) for i in range(1, 200)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**64 for s in seeds)
    assert sequence_seed(7, 3) == sequence_seed(7, 3)
    keys = {tuple(seed_to_key(sequence_seed(42, i))) for i in range(8)}
    assert len(keys) == 8  # each sequence gets its own PRNG key
    with pytest.raises(ValueError):
        sequence_seed(1, -1)
