"""Speculative decoding with a draft model (``service.engine.draft_model``) on the tiny random
model: greedy ids are the dense reference's whether the draft model is the target itself (its
drafts kept) or another random model (most rejected), alone and in mixed batches, at every
``max_tokens``, across page sizes, preemption, a prefix hit, data replicas and a live switch;
seeded sampling draws the ids it draws without speculation; the draft pool holds exactly the
draft model's keys and values of the ids it keeps; a draft model whose tokenizer differs is
refused at start-up, and a server speculates with one (usage, metrics)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from helpers import free_port, openai_client, scrape, value
from reference import (
    CFG,
    GRAPHDEF,
    PARAMS,
    PROMPT_A,
    PROMPT_B,
    PROMPT_C,
    dense_kv,
    dense_logits,
    make,
    reference,
    run,
    run_across_switch,
    tiny_loop,
)
from test_speculative import TURNING, started

from model.weights.build import random_llama
from service.engine.batch import build
from service.engine.config import EngineConfig
from service.engine.draft_model import DraftModelProposer, common_prefix, draft_engine_config
from service.engine.loop import EngineLoop, make_loop
from sharding.layouts import Layout

K = 3
OTHER = random_llama(CFG, seed=11)  # a draft model that mostly disagrees with the target
SELF = (GRAPHDEF, PARAMS)  # the target as its own draft: every greedy draft is kept


@pytest.fixture(scope="module")
def other() -> Iterator[EngineLoop]:
    # Always k drafts, chained on the device (no confidence cut): most are rejected.
    loop = started(tiny_loop(draft=OTHER, speculative_tokens=K, draft_p_min=0.0))
    yield loop
    loop.stop()


@pytest.fixture(scope="module")
def itself() -> Iterator[EngineLoop]:
    # The confidence cut: each step's drafts on the host, a sequence stops below p_min.
    # Its greedy ids' probabilities are about 0.006 to 0.012: some proposals stop early.
    loop = started(tiny_loop(draft=SELF, speculative_tokens=K, draft_p_min=0.009))
    yield loop
    loop.stop()


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2 and common_prefix([], [1]) == 0 and common_prefix([7], [8]) == 0


def test_the_target_as_its_own_draft_has_its_drafts_kept(itself: EngineLoop) -> None:
    refs = [reference(p, 24) for p in (PROMPT_A, PROMPT_B, PROMPT_C, TURNING)]
    proposed, accepted = itself.scheduler.drafts_proposed, itself.scheduler.drafts_accepted
    assert run(itself, [make(PROMPT_C, 24)]) == [refs[2]]
    assert run(itself, [make(p, 24) for p in (PROMPT_A, PROMPT_B, PROMPT_C, TURNING)]) == refs
    proposed, accepted = itself.scheduler.drafts_proposed - proposed, itself.scheduler.drafts_accepted - accepted
    # Greedy drafts of the same weights: kept unless two logits tie to float rounding.
    assert proposed > 20 and accepted >= 0.9 * proposed


def test_another_draft_model_changes_no_id(other: EngineLoop) -> None:
    refs = [reference(p, 24) for p in (PROMPT_A, PROMPT_B, PROMPT_C, TURNING)]
    proposed, accepted = other.scheduler.drafts_proposed, other.scheduler.drafts_accepted
    assert run(other, [make(p, 24) for p in (PROMPT_A, PROMPT_B, PROMPT_C, TURNING)]) == refs
    assert run(other, [make(TURNING, 24)]) == [refs[3]]
    proposed, accepted = other.scheduler.drafts_proposed - proposed, other.scheduler.drafts_accepted - accepted
    assert proposed > 0 and accepted < proposed  # drafts were rejected, and rolled back


def test_drafting_stops_after_a_draft_below_p_min() -> None:
    """The tiny model gives its greedy ids probabilities of about 0.006 to 0.012: with p_min 0.5 every
    proposal is one draft (its first is below), with p_min 0.001 every one is k; ids stay the
    reference's either way."""
    want = reference(TURNING, 16)
    for p_min, length in ((0.5, 1), (0.001, K)):
        loop = tiny_loop(draft=SELF, speculative_tokens=K, draft_p_min=p_min)
        sched = loop.scheduler
        lengths: list[int] = []
        propose = sched.proposer.propose_batch  # type: ignore[union-attr]

        def recorded(wants, propose=propose, lengths=lengths):  # type: ignore[no-untyped-def]
            out = propose(wants)
            lengths.extend(len(d) for d, (_, k) in zip(out, wants, strict=True) if k == K and d is not None)
            return out

        sched.proposer.propose_batch = recorded  # type: ignore[union-attr]
        started(loop)
        try:
            assert run(loop, [make(TURNING, 16)]) == [want]
        finally:
            loop.stop()
        assert lengths and set(lengths) == {length}, (p_min, lengths)


def test_every_id_count_up_to_max_tokens_is_exact(itself: EngineLoop, other: EngineLoop) -> None:
    for n in (1, 2, 3, 4, 5, 7, 11):
        want = reference(TURNING, n)
        assert run(itself, [make(TURNING, n)]) == [want] == run(other, [make(TURNING, n)])


def test_seeded_sampling_draws_the_ids_it_draws_without_speculation(itself: EngineLoop, other: EngineLoop) -> None:
    plain = started(tiny_loop())
    try:
        for seed in (1, 2, 3):
            kw: dict[str, Any] = dict(temperature=0.15, top_k=40, seed=seed)
            want = run(plain, [make(PROMPT_A, 16, **kw)])
            assert run(itself, [make(PROMPT_A, 16, **kw)]) == want == run(other, [make(PROMPT_A, 16, **kw)])
    finally:
        plain.stop()


def test_the_draft_pool_holds_the_draft_models_keys_and_values_of_its_ids() -> None:
    """Stepped by hand with a draft model that disagrees: after each step the draft pool holds,
    at every position of the ids it keeps for the row (the sequence's, then the drafts not yet
    verified), the dense forward's keys and values of the draft model over those ids; the
    rejected drafts' positions were rolled back and written again."""
    loop = tiny_loop(draft=OTHER, speculative_tokens=K, page_size=4, draft_p_min=0.0)
    sched, runner = loop.scheduler, loop.runner
    proposer = sched.proposer
    assert isinstance(proposer, DraftModelProposer)
    sched.max_draft_wait = 0  # propose at every step, however often rejected
    r = make(TURNING, 24)
    sched.add(r)
    rolled_back = 0
    while len(r.output_ids) < 16:
        plan = sched.schedule()
        sched.postprocess(plan, runner.step(build(plan, runner.geometry, sched.page_tables)).host())
        written = proposer._written.get(r)
        if written is None:
            continue
        ids = r.prompt_ids + r.output_ids
        rolled_back += common_prefix(written.ids, ids) < len(written.ids)
        pool, ps = proposer.pools[0], proposer.runner.ecfg.page_size
        pages = pool.page_table(r)
        assert pool.num_tokens(r) >= len(written.ids)
        for a, want in zip(
            (proposer.runner.cache.k, proposer.runner.cache.v), dense_kv(*OTHER, written.ids), strict=True
        ):
            held = np.asarray(a)[:, pages].transpose(0, 1, 3, 2, 4)  # [L, pages, page_size, K, H]
            held = held.reshape(CFG.num_layers, len(pages) * ps, CFG.num_kv_heads, CFG.head_dim)
            np.testing.assert_allclose(held[:, : len(written.ids)], want, rtol=1e-4, atol=1e-5)
    assert r.output_ids == reference(TURNING, 24)[0][: len(r.output_ids)]
    assert rolled_back > 0  # some drafts were rejected, so the next round rolled them back
    sched.release_finished()
    r.cancel()
    sched.schedule()  # reaps it: its row and both pools' pages go back
    assert proposer.pools[0].num_used == 0 and not proposer._written


def test_a_long_catch_up_takes_a_step_a_round_and_proposes_once_caught_up() -> None:
    """A 33-token prompt, chunks of 16: its first round writes 16 ids and proposes nothing (None:
    not a miss), its second writes 16 more and drafts from the last one; the pool then holds the
    draft model's keys and values of the prompt and the drafts."""
    loop = tiny_loop(draft=OTHER, speculative_tokens=K, draft_p_min=0.0)
    proposer = loop.scheduler.proposer
    assert isinstance(proposer, DraftModelProposer)
    r = make(PROMPT_C, 8)
    r.slot = 0
    assert proposer.propose_batch([(r, K)]) == [None] and proposer._written[r].ids == PROMPT_C[:16]
    (draft,) = proposer.propose_batch([(r, K)])
    assert draft is not None and len(draft) == K and proposer._written[r].ids == PROMPT_C + draft[:-1]
    want = dense_logits(*OTHER, PROMPT_C + draft[:-1])
    assert draft == [int(i) for i in np.argmax(want[len(PROMPT_C) - 1 :], axis=-1)]  # greedy, step by step
    proposer.forget(r)
    assert proposer.pools[0].num_used == 0


def test_page_sizes_preemption_and_a_prefix_hit_keep_the_reference() -> None:
    # 3 sequences of up to 33 + 16 tokens in 72 positions: they cannot all hold their pages.
    loop = started(
        tiny_loop(draft=OTHER, num_slots=3, kv_cache_tokens=72, page_size=16, speculative_tokens=K, draft_p_min=0.0)
    )
    try:
        refs = [reference(p, 16) for p in (PROMPT_A, PROMPT_C, TURNING)]
        assert run(loop, [make(p, 16) for p in (PROMPT_A, PROMPT_C, TURNING)]) == refs
        assert loop.scheduler.preemptions >= 1 and loop.scheduler.drafts_proposed > 0
        again = make(PROMPT_C, 16)
        assert run(loop, [again]) == [refs[1]] and again.cached_tokens > 0
        proposer = loop.scheduler.proposer
        assert isinstance(proposer, DraftModelProposer)
        assert loop.scheduler.page_counts()["used"] == 0 and sum(p.num_used for p in proposer.pools) == 0
    finally:
        loop.stop()


def test_data_replicas_and_a_live_switch_keep_the_reference() -> None:
    loop = tiny_loop("2x1", jax.devices()[:2], draft=SELF, speculative_tokens=K, draft_p_min=0.009)
    new = loop.runner.relayout(Layout("1x1"), jax.devices()[:1])
    new.warmup_to_replace(loop.runner)
    started(loop)
    try:
        prompts = (PROMPT_A, TURNING, PROMPT_B, PROMPT_C)
        ids = run_across_switch(loop, new, [make(p, 24) for p in prompts])
        assert ids == [reference(p, 24)[0] for p in prompts]
        assert loop.scheduler.drafts_accepted > 0
    finally:
        loop.stop()


def test_the_draft_pool_has_room_whenever_the_targets_does() -> None:
    loop = tiny_loop(draft=OTHER, speculative_tokens=K, kv_cache_tokens=40, page_size=4)
    target = loop.runner.ecfg
    ecfg = draft_engine_config(target)
    assert ecfg.kv_cache_tokens >= target.kv_cache_tokens + target.num_slots * K
    unsized = EngineConfig(num_slots=4, max_seq_len=64, page_size=4, speculative="draft:x", speculative_tokens=K)
    assert draft_engine_config(unsized).kv_cache_tokens == 4 * 68  # every row's 64 positions and 3 drafts


# ---- the server ----------------------------------------------------------------------------------
def test_a_draft_model_with_another_tokenizer_is_refused(tiny_gguf: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    from model.text.tokenizer import Tokenizer
    from model.weights.loader import load_model
    from service.engine.runner import Runner
    from service.server.startup import draft_runners

    loaded = load_model(tiny_gguf, tokenizer=True)
    tok = loaded.tokenizer
    assert tok is not None and tok.vocabulary_difference(tok) is None
    backend = HFTokenizer.from_str(tok.backend.to_str())
    backend.add_tokens(["<not-in-the-draft>"])
    other = Tokenizer(backend, tok.vocab_size, tok.special_ids, tok.bos_id, tok.eos_ids, False, None, {})
    assert "<not-in-the-draft>" in str(other.vocabulary_difference(tok))
    runner = Runner(loaded.cfg, loaded.graphdef, loaded.state, Layout("1x1"),
                    EngineConfig(num_slots=2, max_seq_len=64, speculative="draft:x"), jax.devices()[:1])  # fmt: skip
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        draft_runners(str(tiny_gguf), tmp_path, other, [runner])
    (draft,) = draft_runners(str(tiny_gguf), tmp_path, tok, [runner])
    assert draft.ecfg.num_slots == 2 and draft.layout == runner.layout


def test_a_draft_model_on_an_accelerator_needs_a_pool_size_and_make_loop_checks_its_proposer() -> None:
    from service.server.config import ConfigError
    from service.server.startup import check_draft_pool

    asked = EngineConfig(speculative="draft:x")
    with pytest.raises(ConfigError, match="--kv-cache-tokens or --kv-cache-memory"):
        check_draft_pool(asked, "gpu")
    check_draft_pool(asked, "cpu")  # the default pool there: rows x max_seq_len, not the device's memory
    check_draft_pool(dataclasses.replace(asked, kv_cache_tokens=4096), "tpu")
    loop = tiny_loop(draft=SELF, speculative_tokens=K)
    proposer = loop.scheduler.proposer
    assert proposer is not None
    with pytest.raises(ValueError, match="a proposer of 3 ids"):
        make_loop(tiny_loop().runner, 4, proposer=proposer)  # a runner that does not speculate
    with pytest.raises(ValueError, match="at most 2"):
        make_loop(tiny_loop(speculative="ngram", speculative_tokens=2).runner, 4, proposer=proposer)


@pytest.fixture(scope="module")
def server(tiny_gguf: Path) -> Iterator[Any]:
    from service.server.app import ServerThread
    from service.server.config import ServerConfig

    cfg = ServerConfig(
        model=str(tiny_gguf), port=0, metrics_port=free_port(), http_port=free_port(),
        engine=EngineConfig(
            num_slots=2, max_seq_len=128, chunk_size=32, speculative=f"draft:{tiny_gguf}", speculative_tokens=3
        ),
    )  # fmt: skip
    srv = ServerThread(cfg).start()
    yield srv
    srv.stop()


def test_a_server_speculates_with_a_draft_model(server: Any) -> None:
    c = openai_client(server)
    try:
        kw: dict[str, Any] = dict(model="default", prompt="hello there", max_tokens=40, temperature=0)
        spec = c.completions.create(**kw)
        off = c.completions.create(**kw, extra_body={"speculative": False})
    finally:
        c.close()
    assert spec.choices[0].text == off.choices[0].text and spec.choices[0].finish_reason == "length"
    details = spec.usage.completion_tokens_details  # type: ignore[union-attr]
    assert details is not None and details.accepted_prediction_tokens > 10  # the target drafts for itself
    samples = scrape(server.cfg.metrics_port)
    assert value(samples, "meshserve_spec_decode_accepted_tokens_total", pool="default", proposer="draft") > 10
