"""Our float32 model against Hugging Face transformers on the same GGUF weights, through the
served engine (a ``Runner`` stepped by its scheduler).

Fixtures: ``tests/fixtures/golden_logits.npz``, written by ``scripts/make_golden.py`` (see its
header to regenerate). The long prompt (644 tokens) is prefilled in two chunks of at most
512 tokens, so it also checks chunked prefill and RoPE at far positions.

``served`` (ids and logits of a ``Runner`` driven step by step as the engine loop drives it) is
shared with test_kv_dtype.py, test_layouts.py, test_checkpoint.py and test_stored_weights.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from service.engine.batch import build
from service.engine.config import EngineConfig
from service.engine.loop import EngineLoop, make_loop
from service.engine.request import Chunk, FinishReason, Request, RequestState, SamplingOptions
from service.engine.runner import Runner
from service.engine.text_stream import TextStream
from sharding.layouts import Layout

FIXTURE = Path(__file__).parent / "fixtures" / "golden_logits.npz"
GREEDY = SamplingOptions(temperature=0.0)


class PiecesOf:
    """A detokenizer stand-in that writes no text (the ids are what is compared)."""

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def greedy_request(name: str, prompt: list[int], n: int) -> Request:
    """A greedy request for exactly ``n`` ids (no EOS ids)."""
    return Request(name, list(prompt), n, GREEDY, TextStream(PiecesOf()), lambda chunk: None, frozenset())  # type: ignore[arg-type]


def served(runner: Runner, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """``prompts`` submitted together to ``runner`` (greedy, ``n`` ids each, no EOS), stepped as the
    engine loop steps it (``Scheduler.schedule`` -> ``batch.build`` -> ``Runner.step`` ->
    ``Scheduler.postprocess``), one step at a time on this thread: each prompt's ids, and the
    logits [V] its last prompt token gave (the step of its last prefill chunk). A fresh scheduler
    over the runner's pool, so no prefix is cached from an earlier call."""
    scheduler = make_loop(runner, max_queue=len(prompts)).scheduler
    requests = [greedy_request(f"served-{i}", p, n) for i, p in enumerate(prompts)]
    for r in requests:
        scheduler.add(r)
    logits: dict[int, np.ndarray] = {}
    while any(r.state is not RequestState.FINISHED for r in requests):
        plan = scheduler.schedule()
        assert not plan.empty, "the scheduler stalled"
        out = runner.step(build(plan, runner.geometry, scheduler.page_tables))
        for c in plan.prefills:
            if c.is_last:
                logits[id(c.request)] = out.row_logits(c.slot)
        scheduler.postprocess(plan, out.host())
    # No request was preempted (its recomputation's last chunk would have replaced the logits).
    assert all(r.finish_reason is FinishReason.LENGTH and r.preemptions == 0 for r in requests)
    return [list(r.output_ids) for r in requests], [logits[id(r)] for r in requests]


# The served float32 engine's kernel choices, each held to the same bounds: the default on one CPU
# device (native attention, float32 panels, scanned layers), XLA's attention and dots, and the
# unrolled layer loop (per-layer weights; XLA's dots, as panels are read at a scan's index).
ENGINES = {
    "auto": {},
    "xla": dict(attention="xla", matmul="xla"),
    "unrolled": dict(layer_loop="unrolled"),
}


@pytest.fixture(scope="module", params=list(ENGINES))
def runner(smollm2_model, request: pytest.FixtureRequest) -> Runner:  # type: ignore[no-untyped-def]
    cfg, graphdef, params = smollm2_model
    ecfg = EngineConfig(num_slots=2, max_seq_len=1024, chunk_size=512, **ENGINES[request.param])
    return Runner(cfg, graphdef, params, Layout("single"), ecfg)


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(FIXTURE) as z:
        return {k: z[k] for k in z.files}


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


@pytest.mark.slow
@pytest.mark.parametrize("i", [0, 1, 2])
def test_logits_and_greedy_tokens_match_transformers(runner: Runner, golden: dict[str, np.ndarray], i: int) -> None:
    prompt = golden[f"prompt_ids_{i}"].tolist()
    ref_greedy = golden[f"greedy_{i}"].tolist()
    (ids,), (logits,) = served(runner, [prompt], len(ref_greedy))
    err = np.abs(logits - golden[f"last_logits_{i}"]).max()
    assert err < 1e-3, f"prompt {i} ({len(prompt)} tokens): max |logit diff| {err:.2e}"
    assert ids == ref_greedy, f"prompt {i}: first difference at step {first_difference(ids, ref_greedy)}"


@pytest.mark.slow
def test_the_engines_run_the_kernels_they_are_named_for(runner: Runner) -> None:
    """The parametrization is not three runs of one engine."""
    from model import native

    k = runner.kernels
    if runner.ecfg.attention == "xla":
        assert not k.attention.native and not k.panels
    elif runner.ecfg.layer_loop == "unrolled":
        assert not k.panels and isinstance(runner.params["layers"]["wqkv"].get_value(), tuple)
    elif native.available():
        assert k.attention.native and k.panels and k.layer_loop == "scan"


def test_long_prompt_really_is_long(golden: dict[str, np.ndarray]) -> None:
    assert len(golden["prompt_ids_2"]) >= 500


# ---- the engine loop ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loop(smollm2_model) -> Iterator[EngineLoop]:  # type: ignore[no-untyped-def]
    """The served engine (pages of 16, three prompts per step) behind its loop thread."""
    cfg, graphdef, params = smollm2_model
    ecfg = EngineConfig(num_slots=4, max_seq_len=1024, chunk_size=512)
    loop = make_loop(Runner(cfg, graphdef, params, Layout("single"), ecfg), max_queue=8)
    loop.start()
    assert loop.ready.wait(900)
    yield loop
    loop.stop()


def loop_greedy(loop: EngineLoop, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Submit ``prompts`` together (greedy, ``n`` ids each, no EOS) and wait for their ids."""
    done = [threading.Event() for _ in prompts]
    ids: list[list[int]] = [[] for _ in prompts]
    for i, p in enumerate(prompts):

        def emit(chunk: Chunk, i: int = i) -> None:
            ids[i].extend(chunk.token_ids)
            if chunk.finish_reason is not None or chunk.error is not None:
                done[i].set()

        r = greedy_request(f"golden-{i}", p, n)
        r.emit = emit
        loop.submit(r)
    for d in done:
        assert d.wait(600)
    return ids


@pytest.mark.slow
def test_the_loop_gives_transformers_greedy_tokens_batched_and_solo(
    loop: EngineLoop, golden: dict[str, np.ndarray]
) -> None:
    prompts = [golden[f"prompt_ids_{i}"].tolist() for i in range(3)]
    refs = [golden[f"greedy_{i}"].tolist() for i in range(3)]
    n = min(len(r) for r in refs)
    # All three in the same steps (the long one in two chunks beside the others' decode tokens) ...
    assert loop_greedy(loop, prompts, n) == [r[:n] for r in refs]
    # ... then each alone, now hitting the prefix cache the batch filled.
    hits = loop.scheduler.prefix_tokens()[1]
    for p, r in zip(prompts, refs, strict=True):
        assert loop_greedy(loop, [p], len(r)) == [r]
    assert loop.scheduler.prefix_tokens()[1] > hits
