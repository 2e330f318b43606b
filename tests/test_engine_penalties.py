"""Penalties, min_tokens and ignore_eos through the engine loop on the tiny random model,
against a step-by-step reference: the model's whole-sequence forward (``model.llama.prefill``
over prompt + ids so far, a fresh cache each step), its logits penalized by Hugging Face's
processor and OpenAI's formula (``helpers.penalized``), then the argmax. The engine instead
decodes from its KV cache and keeps the counts on the device, so both paths agree only if the
counts, the prompt mask and the EOS ban are right at every step."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import penalized

from model.weights.build import random_llama
from model.config import LlamaConfig
from model.kv_cache import KVCache
from model.llama import prefill
from service.engine import Engine, EngineConfig
from service.loop import EngineLoop
from service.engine.request import Chunk, FinishReason, Request, SamplingOptions
from service.scheduler import Scheduler
from service.engine.text_stream import TextStream
from sharding.layouts import Layout

CFG = LlamaConfig.tiny()
T, CHUNK = 64, 16
ECFG = EngineConfig(num_slots=2, max_seq_len=T, chunk_size=CHUNK)
GRAPHDEF, PARAMS = random_llama(CFG, seed=3)
_rng = np.random.default_rng(0)
PROMPT_A = _rng.integers(0, CFG.vocab_size, 20).tolist()  # two prefill chunks
PROMPT_B = _rng.integers(0, CFG.vocab_size, 7).tolist()
N = 16


class Pieces:
    def push(self, token_id: int) -> str:
        return f"<{token_id}>"

    def flush(self) -> str:
        return ""


@jax.jit
def _forward(tokens: jax.Array, n: jax.Array) -> jax.Array:
    """Raw logits [V] after ``tokens[:n]`` (tokens [T] int32), by a whole-sequence prefill."""
    model = nnx.merge(GRAPHDEF, PARAMS)
    logits, _ = prefill(model, KVCache.zeros(CFG, 1, T), tokens, jnp.int32(0), n, jnp.int32(0), kv_len=0)
    return logits


def reference(
    prompt: list[int],
    n: int,
    repetition: float = 1.0,
    presence: float = 0.0,
    frequency: float = 0.0,
    eos: frozenset[int] = frozenset(),
    min_tokens: int = 0,
) -> tuple[list[int], FinishReason]:
    """Greedy ids and finish reason, one whole forward per id; EOS ids get -inf before the
    penalties while fewer than ``min_tokens`` ids are out (vLLM's order)."""
    out: list[int] = []
    for i in range(n):
        padded = np.zeros(T, np.int32)
        seq = prompt + out
        padded[: len(seq)] = seq
        logits = np.array(_forward(padded, jnp.int32(len(seq))))
        if i < min_tokens:
            logits[sorted(eos)] = -np.inf
        token = int(np.argmax(penalized(logits, prompt, out, repetition, presence, frequency)))
        if token in eos:
            return out, FinishReason.EOS
        out.append(token)
    return out, FinishReason.LENGTH


@pytest.fixture(scope="module")
def loop() -> Iterator[EngineLoop]:
    engine = Engine(CFG, GRAPHDEF, PARAMS, Layout("1x1"), ECFG)
    loop = EngineLoop(engine, Scheduler(num_slots=2, max_queue=8, chunk_size=CHUNK))
    loop.start()
    assert loop.ready.wait(300)
    yield loop
    loop.stop()


def make(prompt: list[int], max_tokens: int = N, eos: frozenset[int] = frozenset(), **kw: object) -> Request:
    """A request; ``kw``: SamplingOptions fields (temperature 0 unless given) or min_tokens/ignore_eos."""
    request_kw = {k: kw.pop(k) for k in ("min_tokens", "ignore_eos") if k in kw}
    kw.setdefault("temperature", 0.0)
    return Request(
        request_id=str(id(prompt)),
        prompt_ids=list(prompt),
        max_tokens=max_tokens,
        sampling=SamplingOptions(**kw),  # type: ignore[arg-type]
        text=TextStream(Pieces()),
        emit=lambda chunk: None,
        eos_ids=eos,
        **request_kw,  # type: ignore[arg-type]
    )


def run(loop: EngineLoop, requests: list[Request]) -> list[tuple[list[int], FinishReason | None]]:
    """Submit ``requests`` together (in order: the first takes the lower free slot) and wait
    for all; each one's ids and finish reason."""
    done = [threading.Event() for _ in requests]
    ids: list[list[int]] = [[] for _ in requests]
    reasons: list[FinishReason | None] = [None] * len(requests)

    def emit_for(i: int):  # type: ignore[no-untyped-def]
        def emit(chunk: Chunk) -> None:
            ids[i].extend(chunk.token_ids)
            if chunk.finish_reason is not None or chunk.error is not None:
                reasons[i] = chunk.finish_reason
                done[i].set()

        return emit

    for i, r in enumerate(requests):
        r.emit = emit_for(i)
        loop.submit(r)
    for d in done:
        assert d.wait(300)
    return list(zip(ids, reasons, strict=True))


def test_greedy_penalties_match_the_reference_batched_and_solo(loop: EngineLoop) -> None:
    a = dict(repetition_penalty=3.0)
    b = dict(frequency_penalty=0.8, presence_penalty=0.3)
    ref_a = reference(PROMPT_A, N, repetition=3.0)
    ref_b = reference(PROMPT_B, N, presence=0.3, frequency=0.8)
    # The penalties change the greedy ids (the unpenalized tiny model repeats one id).
    assert ref_a[0] != reference(PROMPT_A, N)[0] and ref_b[0] != reference(PROMPT_B, N)[0]
    assert run(loop, [make(PROMPT_A, **a), make(PROMPT_B, **b)]) == [ref_a, ref_b]
    # Each alone (both in slot 0, which A's history held before: the first chunk resets it).
    assert run(loop, [make(PROMPT_B, **b)]) == [ref_b]
    assert run(loop, [make(PROMPT_A, **a)]) == [ref_a]
    # Both penalties at once, and a plain greedy request beside it keeps its unpenalized ids.
    ref_ab = reference(PROMPT_B, N, repetition=1.2, presence=0.2, frequency=0.5)
    both = make(PROMPT_B, repetition_penalty=1.2, presence_penalty=0.2, frequency_penalty=0.5)
    assert run(loop, [make(PROMPT_A), both]) == [reference(PROMPT_A, N), ref_ab]


def test_seeded_sampling_with_penalties_is_the_same_whatever_shares_the_batch(loop: EngineLoop) -> None:
    c = dict(temperature=0.9, seed=1234, repetition_penalty=1.3, frequency_penalty=0.4, min_p=0.05, top_k=40)
    (solo,) = run(loop, [make(PROMPT_B, **c)])  # slot 0
    shared = run(loop, [make(PROMPT_A, repetition_penalty=2.0), make(PROMPT_B, **c)])[1]  # slot 1
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
    the new engine adopts the counts and prompt mask, and the ids are the reference's."""
    engine = Engine(CFG, GRAPHDEF, PARAMS, Layout("1x1"), ECFG)
    loop = EngineLoop(engine, Scheduler(num_slots=2, max_queue=8, chunk_size=CHUNK))
    request = make(PROMPT_A, repetition_penalty=1.5, frequency_penalty=0.5)
    ids: list[int] = []
    request.emit = lambda chunk: ids.extend(chunk.token_ids)
    loop.scheduler.add(request)
    for _ in range(8):  # two prefill chunks, then 6 decode steps
        loop.step(loop.scheduler.schedule())
    new = engine.relayout(Layout("1x2", model=2), jax.devices()[:2])
    loop._switch = (new, threading.Event())
    loop._apply_switch()
    assert loop.engine is new
    np.testing.assert_array_equal(np.asarray(new.history.counts), np.asarray(engine.history.counts))
    np.testing.assert_array_equal(np.asarray(new.history.in_prompt), np.asarray(engine.history.in_prompt))
    assert np.asarray(new.history.counts)[0].sum() == 6  # the ids fed to the 6 decode steps
    while request.finish_reason is None:
        loop.step(loop.scheduler.schedule())
    assert (ids, request.finish_reason) == reference(PROMPT_A, N, repetition=1.5, frequency=0.5)
