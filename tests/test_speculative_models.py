"""Speculative decoding on real models, their blocks as stored (SmolLM2-135M Q4_1, Qwen2.5-Coder-0.5B
Q4_K_M): greedy ids identical with and without n-gram speculation on input-grounded prompts
(rewrite a given code snippet) and a free one, alone and in a batch, with drafts kept; and with
a draft model: Qwen2.5-Coder-0.5B drafting for the 1.5B (the pair of issue 42, one tokenizer),
and SmolLM2 dequantized to float32 drafting for its stored blocks. Each run steps a fresh
scheduler over one runner as the engine loop does (``test_golden.served``'s order)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from service.engine.batch import build
from service.engine.config import EngineConfig
from service.engine.draft_model import DraftModelProposer, draft_engine_config
from service.engine.loop import make_loop
from service.engine.request import RequestState
from service.engine.runner import Runner
from service.engine.scheduler import Scheduler
from sharding.layouts import Layout

pytestmark = pytest.mark.slow

SNIPPET = """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
"""
ASKS = (
    "Add type hints to this Python function and return the whole function:\n\n" + SNIPPET,
    "Rename the variable `total` to `running_sum` in this code and show the result:\n\n" + SNIPPET,
    "Write a haiku about the sea.",
)


def greedy(
    scheduler: Scheduler, runner: Runner, prompts: list[list[int]], n: int, speculative: bool = True
) -> tuple[list[list[int]], Any]:
    from test_golden import greedy_request

    requests = [greedy_request(f"spec-{i}", p, n) for i, p in enumerate(prompts)]
    for r in requests:
        r.speculative = speculative
        scheduler.add(r)
    while any(r.state is not RequestState.FINISHED for r in requests):
        plan = scheduler.schedule()
        assert not plan.empty, "the scheduler stalled"
        scheduler.postprocess(plan, runner.step(build(plan, runner.geometry, scheduler.page_tables)).host())
    return [r.output_ids for r in requests], requests


def test_greedy_ids_are_identical_with_ngram_speculation(smollm2_model, tokenizer) -> None:  # type: ignore[no-untyped-def]
    cfg, graphdef, params = smollm2_model
    same_ids_with_and_without(Runner(cfg, graphdef, params, Layout("single"), ECFG), tokenizer)


def test_qwen_greedy_ids_are_identical_with_ngram_speculation() -> None:
    from model.weights.fetch import fetch_model
    from model.weights.loader import load_model

    loaded = load_model(fetch_model("qwen2.5-coder-0.5b-instruct"), tokenizer=True, stored=True)
    runner = Runner(loaded.cfg, loaded.graphdef, loaded.state, Layout("single"), ECFG)
    same_ids_with_and_without(runner, loaded.tokenizer)


ECFG = EngineConfig(num_slots=4, max_seq_len=1024, chunk_size=512, speculative="ngram", speculative_tokens=4)
DRAFT_ECFG = dataclasses.replace(ECFG, speculative="draft:test", speculative_tokens=3)


def test_qwen_greedy_ids_are_identical_with_the_0_5b_drafting_for_the_1_5b() -> None:
    from model.weights.fetch import fetch_model
    from model.weights.loader import load_model

    target = load_model(fetch_model("qwen2.5-coder-1.5b-instruct"), tokenizer=True, stored=True)
    draft = load_model(fetch_model("qwen2.5-coder-0.5b-instruct"), tokenizer=True, stored=True)
    assert target.tokenizer is not None and draft.tokenizer is not None
    assert target.tokenizer.vocabulary_difference(draft.tokenizer) is None
    runner = Runner(target.cfg, target.graphdef, target.state, Layout("single"), DRAFT_ECFG)
    del target
    draft_runner = Runner(draft.cfg, draft.graphdef, draft.state, Layout("single"), draft_engine_config(runner.ecfg))
    same_ids_with_and_without(runner, draft.tokenizer, draft_runner)


def test_smollm2_greedy_ids_are_identical_with_its_float32_self_drafting(smollm2_gguf, tokenizer) -> None:  # type: ignore[no-untyped-def]
    from model.weights.loader import load_model

    stored = load_model(smollm2_gguf, stored=True)
    runner = Runner(stored.cfg, stored.graphdef, stored.state, Layout("single"), DRAFT_ECFG)
    dense = load_model(smollm2_gguf)  # every block dequantized to float32: other rounding, a few other ids
    draft_runner = Runner(dense.cfg, dense.graphdef, dense.state, Layout("single"), draft_engine_config(runner.ecfg))
    same_ids_with_and_without(runner, tokenizer, draft_runner)


def same_ids_with_and_without(runner: Runner, tokenizer: Any, draft: Runner | None = None) -> None:
    """Greedy ids of ``ASKS`` (the first alone, then all three at once) with n-gram speculation,
    or with ``draft`` proposing, equal those without; the rewrite keeps a third of its ids from
    drafts."""
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": a}])) for a in ASKS]
    n = 96
    proposer = DraftModelProposer(draft, runner.ecfg.speculative_tokens) if draft is not None else None
    for batch in ([prompts[0]], prompts):
        plain, _ = greedy(make_loop(runner, 4, proposer=proposer).scheduler, runner, batch, n, speculative=False)
        speculating = make_loop(runner, 4, proposer=proposer).scheduler
        assert speculating.proposer is not None
        spec, requests = greedy(speculating, runner, batch, n)
        assert spec == plain
        # The rewrite copies the snippet: most of its ids come from kept drafts.
        assert requests[0].draft_accepted > n // 3, (requests[0].draft_accepted, requests[0].draft_proposed)
        assert speculating.draft_steps > 0
