"""Penalties, min_tokens and ignore_eos through the engine loop on the tiny random model,
against a step-by-step reference (``reference.reference``: one dense forward over prompt + ids
so far, no cache, its logits penalized by Hugging Face's processor and OpenAI's formula, then
the argmax). The engine instead decodes from its KV pages and keeps the counts on the device,
so both paths agree only if the counts, the prompt mask and the EOS ban are right at every
step."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import jax
import numpy as np
import pytest
from reference import PROMPT_A, PROMPT_B, N, make, reference, run, tiny_loop

from service.engine.loop import EngineLoop
from service.engine.request import FinishReason
from sharding.layouts import Layout


@pytest.fixture(scope="module")
def loop() -> Iterator[EngineLoop]:
    loop = tiny_loop(num_slots=2, max_queue=8)
    loop.start()
    assert loop.ready.wait(300)
    yield loop
    loop.stop()


def test_greedy_penalties_match_the_reference_batched_and_solo(loop: EngineLoop) -> None:
    a = dict(repetition_penalty=3.0)
    b = dict(frequency_penalty=0.8, presence_penalty=0.3)
    ref_a = reference(PROMPT_A, N, repetition=3.0)
    ref_b = reference(PROMPT_B, N, presence=0.3, frequency=0.8)
    # The penalties change the greedy ids (the unpenalized tiny model repeats one id).
    assert ref_a[0] != reference(PROMPT_A, N)[0] and ref_b[0] != reference(PROMPT_B, N)[0]
    assert run(loop, [make(PROMPT_A, **a), make(PROMPT_B, **b)]) == [ref_a, ref_b]
    # Each alone (both in row 0, which A's history held before: the install replaces it).
    assert run(loop, [make(PROMPT_B, **b)]) == [ref_b]
    assert run(loop, [make(PROMPT_A, **a)]) == [ref_a]
    # Both penalties at once, and a plain greedy request beside it keeps its unpenalized ids.
    ref_ab = reference(PROMPT_B, N, repetition=1.2, presence=0.2, frequency=0.5)
    both = make(PROMPT_B, repetition_penalty=1.2, presence_penalty=0.2, frequency_penalty=0.5)
    assert run(loop, [make(PROMPT_A), both]) == [reference(PROMPT_A, N), ref_ab]


def test_seeded_sampling_with_penalties_is_the_same_whatever_shares_the_batch(loop: EngineLoop) -> None:
    c = dict(temperature=0.9, seed=1234, repetition_penalty=1.3, frequency_penalty=0.4, min_p=0.05, top_k=40)
    (solo,) = run(loop, [make(PROMPT_B, **c)])  # row 0
    shared = run(loop, [make(PROMPT_A, repetition_penalty=2.0), make(PROMPT_B, **c)])[1]  # row 1
    assert shared == solo and len(solo[0]) == N
    assert solo[0] != reference(PROMPT_B, N, repetition=1.3, frequency=0.4)[0]  # it samples
    other_seed = run(loop, [make(PROMPT_B, **{**c, "seed": 99})])[0]
    assert other_seed != solo


def test_min_tokens_bans_eos_and_ignore_eos_runs_to_max_tokens(loop: EngineLoop) -> None:
    greedy, _ = reference(PROMPT_A, 10)
    eos = frozenset({greedy[2]})  # an id the greedy run produces by its third step
    first = greedy.index(greedy[2])
    # Without min_tokens the request ends at that id.
    assert run(loop, [make(PROMPT_A, 10, eos)]) == [(greedy[:first], FinishReason.EOS)]
    # With min_tokens=5 the EOS id is banned for the first 5 ids (and may end it afterwards).
    want = reference(PROMPT_A, 10, eos=eos, min_tokens=5)
    got = run(loop, [make(PROMPT_A, 10, eos, min_tokens=5)])[0]
    assert got == want and len(got[0]) >= 5 and not eos & set(got[0])
    # ignore_eos: the EOS id is an ordinary output id; generation runs to max_tokens (and
    # min_tokens then bans nothing).
    assert run(loop, [make(PROMPT_A, 10, eos, ignore_eos=True)]) == [(greedy, FinishReason.LENGTH)]
    assert run(loop, [make(PROMPT_A, 10, eos, ignore_eos=True, min_tokens=5)]) == [(greedy, FinishReason.LENGTH)]


def test_history_moves_with_a_live_layout_switch() -> None:
    """Half a penalized stream on 1x1, the other half on 1x2 (tensor parallel over 2 devices):
    the new runner adopts the counts and prompt mask, and the ids are the reference's."""
    loop = tiny_loop(num_slots=2, max_queue=8)
    old = loop.runner
    request = make(PROMPT_A, repetition_penalty=1.5, frequency_penalty=0.5)
    ids: list[int] = []
    request.emit = lambda chunk: ids.extend(chunk.token_ids)
    loop.scheduler.add(request)
    for _ in range(8):  # two prefill chunks of 16 and 4 tokens, then six decode steps
        loop.step(loop.scheduler.schedule())
    new = old.relayout(Layout("1x2", model=2), jax.devices()[:2])
    loop._switch = (new, threading.Event())
    loop._apply_switch()  # the step in flight lands first
    assert loop.runner is new
    np.testing.assert_array_equal(np.asarray(new.history.counts), np.asarray(old.history.counts))
    np.testing.assert_array_equal(np.asarray(new.history.in_prompt), np.asarray(old.history.in_prompt))
    assert np.asarray(new.history.counts)[0].sum() == len(ids) - 1  # every id but the newest was fed back
    while request.finish_reason is None:
        plan = loop.scheduler.schedule()
        if plan.empty:
            loop._finish_inflight()
        else:
            loop.step(plan)
    assert (ids, request.finish_reason) == reference(PROMPT_A, N, repetition=1.5, frequency=0.5)
