"""Speculative decoding (n-gram prompt lookup, ``service.engine.ngram``; verification in the ragged
step, ``service.engine.scheduler``) on the tiny random model: greedy ids are the dense reference's
with and without speculation, alone and in mixed batches, across page sizes, preemption, a
prefix hit, data replicas and a live switch; drafts that are always wrong change nothing and
leave the pages holding exactly the accepted tokens' keys and values; seeded sampling draws the
ids it draws without speculation; ``max_tokens``, EOS and stop strings cut inside an accepted
run. The rule's distribution is checked by a chi-square test that a deliberately biased rule
fails."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
from reference import (
    CFG,
    GRAPHDEF,
    PARAMS,
    PROMPT_A,
    PROMPT_B,
    PROMPT_C,
    Pieces,
    dense_kv,
    make,
    reference,
    run,
    run_across_switch,
    tiny_loop,
)
from test_scheduler import ids

from service.engine.batch import build
from service.engine.block_manager import BlockManager
from service.engine.loop import EngineLoop
from service.engine.ngram import NgramProposer
from service.engine.output import HostStep
from service.engine.request import Chunk, FinishReason
from service.engine.scheduler import DecodeToken, Scheduler, accepted_run
from service.engine.text_stream import TextStream

K = 3
# Its greedy ids are five 248s, then 144 for ever: the drafts of 248s made from the first run
# are rejected where 144 begins.
TURNING = np.random.default_rng(32).integers(0, CFG.vocab_size, 12).tolist()


class WrongProposer(NgramProposer):
    """Proposes ids the tiny model never picks greedily (random, avoiding the reference's), so
    every verification rejects its first draft."""

    def __init__(self, k: int, avoid: set[int]):
        super().__init__(k)
        self._rng = np.random.default_rng(1)
        self._avoid = avoid

    def propose(self, ids, k=None):  # type: ignore[no-untyped-def]
        allowed = [i for i in range(CFG.vocab_size) if i not in self._avoid]
        return [int(i) for i in self._rng.choice(allowed, self.k if k is None else k)]


def started(loop: EngineLoop) -> EngineLoop:
    loop.start()
    assert loop.ready.wait(600)
    return loop


@pytest.fixture(scope="module")
def spec() -> Iterator[EngineLoop]:
    loop = started(tiny_loop(speculative="ngram", speculative_tokens=K))
    yield loop
    loop.stop()


@pytest.fixture(scope="module")
def plain() -> Iterator[EngineLoop]:
    loop = started(tiny_loop())
    yield loop
    loop.stop()


# ---- the proposer and the rule --------------------------------------------------------------
def test_the_ngram_proposer_matches_the_longest_recurring_suffix() -> None:
    p = NgramProposer(4, n_max=3, n_min=2)
    assert p.propose([1, 2, 3, 9, 8, 1, 2, 3]) == [9, 8, 1, 2]  # the 3-gram 1 2 3
    assert p.propose([1, 2, 7, 4, 2, 7, 5, 6, 1, 2, 7]) == [4, 2, 7, 5]  # 3-gram beats the later 2-gram
    assert p.propose([5, 6, 7, 5, 6, 8, 5, 6]) == [8, 5, 6, 8]  # the latest occurrence, continued
    assert p.propose([4, 4, 4]) == [4, 4, 4, 4]  # a loop proposes k ids, not the one left
    assert p.propose([1, 2, 3, 4]) == [] and p.propose([1, 2]) == []
    assert p.propose([1, 2, 3, 1, 2], k=1) == [3]
    with pytest.raises(ValueError):
        NgramProposer(0)
    with pytest.raises(ValueError):
        NgramProposer(2, n_max=1, n_min=2)


def test_the_accepted_run_is_the_drafts_the_target_reproduced_then_its_own_id() -> None:
    assert accepted_run((5, 6, 7), [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accepted_run((5, 6, 7), [5, 9, 7, 8]) == [5, 9]
    assert accepted_run((5, 6, 7), [1, 6, 7, 8]) == [1]
    assert accepted_run((), [4]) == [4]


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    from scipy.stats import chisquare

    expected = probs * counts.sum()
    keep = expected > 0
    return float(chisquare(counts[keep], expected[keep]).pvalue)


def test_sample_and_compare_is_exact_and_a_biased_rule_is_caught() -> None:
    """Leviathan et al.'s rule with a deterministic draft d: keep d with probability p(d), else draw
    from p without d. Sampling the target and keeping d where they agree is that rule, so over
    20,000 draws the first kept id is distributed as p (chi-square p-value > 0.001); accepting the
    draft whenever the target gives it at least half the top id's probability is not, and the same
    test rejects it (p-value < 1e-6)."""
    rng = np.random.default_rng(0)
    probs = np.array([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])
    draft, n = 1, 20_000
    exact = np.zeros(len(probs))
    biased = np.zeros(len(probs))
    for _ in range(n):
        target = int(rng.choice(len(probs), p=probs))
        exact[accepted_run((draft,), [target, 0])[0]] += 1
        biased[draft if probs[draft] >= probs.max() / 2 else target] += 1
    assert chi_square_p(exact, probs) > 1e-3
    assert chi_square_p(biased, probs) < 1e-6


# ---- scheduling ------------------------------------------------------------------------------
def test_drafts_fill_the_decode_region_oldest_first_and_respect_max_tokens() -> None:
    """k = 3: drafts fill a replica's step up to 8 sampled positions, so with four sequences
    decoding the oldest proposes k ids and the next the one left; ``max_tokens`` caps a draft so
    no id past it is sampled; a sequence whose EOS is banned (``min_tokens``) proposes nothing."""
    sched = Scheduler(4, 8, 16, 64, BlockManager(64, 4), 64, proposer=NgramProposer(K))
    loop_prompt = [7, 8, 7, 8, 7, 8]
    requests = [make(loop_prompt, 20), make(loop_prompt, 20), make(loop_prompt, 2), make(loop_prompt, 20)]
    requests[3].min_tokens = 5
    for r in requests:
        sched.add(r)
    plan = sched.schedule()  # the prompts
    assert len(plan.prefills) == 4

    sched.postprocess(plan, ids(sched, 7))
    plan = sched.schedule()
    drafts = {d.request: d.draft for d in plan.decode}
    assert drafts[requests[0]] == (8, 7, 8) and drafts[requests[1]] == (8,)
    assert not drafts[requests[2]] and not drafts[requests[3]]
    assert plan.num_tokens == 8 and plan.drafted == 4
    assert requests[0].num_cached == len(loop_prompt) + 1 + 3
    # Alone: max_tokens 2 leaves no id for a draft after this token's; a banned EOS proposes nothing.
    for kw in ({"max_tokens": 2}, {"min_tokens": 5}):
        alone = Scheduler(4, 8, 16, 64, BlockManager(64, 4), 64, proposer=NgramProposer(K))
        r = make(loop_prompt, kw.get("max_tokens", 20))
        r.min_tokens = kw.get("min_tokens", 0)
        alone.add(r)
        alone.postprocess(alone.schedule(), ids(alone, 7))
        (token,) = alone.schedule().decode
        assert isinstance(token, DecodeToken) and token.draft == () and r.draft_misses == 0


def test_a_step_that_verifies_drafts_is_landed_before_the_next_is_scheduled() -> None:
    """Seven sequences decoding with k = 3 leave room for one draft id in the 8 sampled positions;
    the next step may not run their tokens before that draft is verified (the token after a
    rejected draft sits one position earlier), though no sequence could propose in it."""
    sched = Scheduler(8, 8, 16, 64, BlockManager(64, 4), 64, proposer=NgramProposer(K))
    requests = [make([7, 8, 7, 8, 7, 8], 20) for _ in range(7)]
    for r in requests:
        sched.add(r)
    sched.postprocess(sched.schedule(), ids(sched, 7))
    plan = sched.schedule()
    assert plan.drafted == 1 and sched.wants_landed()
    (drafting,) = [t for t in plan.decode if t.draft]
    host = ids(sched, 7)  # every row's id, then the drafting row's two slots: the draft rejected
    host = HostStep(
        ids=np.concatenate([host.ids, [9, 9]]).astype(np.int32),
        logprob=np.zeros(10, np.float32),
        top_logprobs=np.zeros((10, host.top_logprobs.shape[1]), np.float32),
        top_ids=np.zeros((10, host.top_ids.shape[1]), np.int32),
        slot_rows=np.array([drafting.slot] * 2, np.int32),
    )
    sched.postprocess(plan, host)
    assert drafting.request.output_ids[-1] == 9 and drafting.request.num_cached == drafting.position + 1
    assert not sched.wants_landed()  # seven decoding: no room for a draft, none in flight


def test_seven_sequences_with_a_rejected_draft_in_flight_keep_the_reference() -> None:
    """The engine over the case above: seven sequences decoding, drafts always wrong, every id the
    reference's (a token run before its row's rejected draft was verified would be at the wrong
    position, with the wrong id)."""
    prompts = [np.random.default_rng(40 + i).integers(0, CFG.vocab_size, 9).tolist() for i in range(7)]
    refs = [reference(p, 10) for p in prompts]
    loop = tiny_loop(num_slots=8, speculative="ngram", speculative_tokens=K)
    loop.scheduler.proposer = WrongProposer(K, {i for ids, _ in refs for i in ids})
    loop.scheduler.max_draft_wait = 0
    started(loop)
    try:
        assert run(loop, [make(p, 10) for p in prompts]) == refs
        assert loop.scheduler.drafts_proposed > 0 and loop.scheduler.drafts_accepted == 0
    finally:
        loop.stop()


def test_shrink_returns_the_pages_past_the_kept_positions() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("s", list(range(6)))
    assert len(bm.grow("s", 7)) == 2  # 13 positions: 4 pages
    last = bm.page_table("s")[-1]
    assert bm.shrink("s", 9) == [last]
    assert bm.num_tokens("s") == 9 and len(bm.page_table("s")) == 3 and bm.num_free == 5
    bm.commit_full_pages("s", list(range(9)))  # two full pages registered
    with pytest.raises(ValueError):
        bm.shrink("s", 7)  # below the committed pages
    with pytest.raises(ValueError):
        bm.shrink("s", 10)  # past the reserved positions


# ---- the engine ------------------------------------------------------------------------------
def test_greedy_ids_are_the_reference_alone_and_in_a_mixed_batch(spec: EngineLoop) -> None:
    refs = [reference(p, 24) for p in (PROMPT_A, PROMPT_B, PROMPT_C, TURNING)]
    assert run(spec, [make(PROMPT_C, 24)]) == [refs[2]]
    turning = make(TURNING, 24)
    assert run(spec, [turning]) == [refs[3]]
    # Its run of 248s was drafted and kept, and the drafts of 248s rejected where 144 begins.
    assert turning.draft_accepted > 12 and turning.draft_proposed > turning.draft_accepted
    # Four sequences in 8 sampled positions: the oldest drafts k ids, the next one.
    batch = [make(p, 24) for p in (PROMPT_A, PROMPT_B, PROMPT_C, TURNING)]
    assert run(spec, batch) == refs
    assert batch[0].draft_accepted > 0
    s = spec.scheduler
    assert sum(s.accepted_lengths) > 0 and s.draft_steps > 0


def test_every_id_count_up_to_max_tokens_is_exact(spec: EngineLoop, plain: EngineLoop) -> None:
    for n in (1, 2, 3, 4, 5, 7, 11):
        want = reference(TURNING, n)
        assert run(spec, [make(TURNING, n)]) == [want] == run(plain, [make(TURNING, n)])
        assert len(want[0]) == n


def test_eos_and_stop_strings_cut_inside_an_accepted_run(spec: EngineLoop, plain: EngineLoop) -> None:
    # TURNING's ids: 248 x 5, then 144: EOS 144 ends it where a draft of 248s is rejected.
    want = reference(TURNING, 24, eos=frozenset({144}))
    assert want[1] is FinishReason.EOS and len(want[0]) == 5
    assert run(spec, [make(TURNING, 24, eos=frozenset({144}))]) == [want]
    # A stop string inside a run of kept drafts: the third 144 ends it.
    stop = [make(TURNING, 24), make(TURNING, 24)]
    for r in stop:
        r.text = TextStream(Pieces(), stop=["<144><144><144>"])
    got_spec, got_plain = run(spec, [stop[0]])[0], run(plain, [stop[1]])[0]
    assert got_spec == got_plain == (reference(TURNING, 8)[0], FinishReason.STOP_STRING)


def test_wrong_drafts_change_nothing_and_leave_only_accepted_keys_and_values() -> None:
    """Every draft rejected: the ids stay the reference's, each step still yields one id, and after
    10 ids the row's pages hold the dense forward's keys and values at every kept position (the
    rejected drafts' positions past them are given back or written over)."""
    loop = tiny_loop(speculative="ngram", speculative_tokens=K)
    want = reference(PROMPT_A, 24)[0]
    sched, runner = loop.scheduler, loop.runner
    sched.proposer = WrongProposer(K, set(want))
    sched.max_draft_wait = 0  # propose at every step, however often rejected
    r = make(PROMPT_A, 24)
    sched.add(r)
    while len(r.output_ids) < 10:
        plan = sched.schedule()
        sched.postprocess(plan, runner.step(build(plan, runner.geometry, sched.page_tables)).host())
    assert r.output_ids == want[:10]
    assert sched.drafts_proposed >= 9 * K and sched.drafts_accepted == 0
    kept = r.prompt_ids + r.output_ids[:-1]  # the newest id's key is written by the next step
    assert r.num_cached == len(kept)
    ps = runner.ecfg.page_size
    pages = sched.page_tables[r.slot, : -(-len(kept) // ps)]
    assert len(sched.pools[0].page_table(r)) == len(pages)  # no page past the kept positions
    for a, want_kv in zip((runner.cache.k, runner.cache.v), dense_kv(GRAPHDEF, PARAMS, kept), strict=True):
        pool = np.asarray(a)  # [L, P, K, page_size, H]
        held = pool[:, pages].transpose(0, 1, 3, 2, 4).reshape(CFG.num_layers, -1, CFG.num_kv_heads, CFG.head_dim)
        np.testing.assert_allclose(held[:, : len(kept)], want_kv, rtol=1e-4, atol=1e-5)


def test_seeded_sampling_draws_the_ids_it_draws_without_speculation(spec: EngineLoop, plain: EngineLoop) -> None:
    """A draw depends on the seed and the position only, and each kept id is the target's own
    draw at its position: a seeded request's ids are identical with and without speculation."""
    accepted = spec.scheduler.drafts_accepted
    for seed in range(6):
        c = dict(temperature=0.15, seed=seed, top_k=40)
        reqs = [make(p, 20, **c) for p in (PROMPT_A, TURNING)]
        assert run(spec, reqs) == run(plain, [make(p, 20, **c) for p in (PROMPT_A, TURNING)])
    assert spec.scheduler.drafts_accepted > accepted


def test_logprobs_of_kept_ids_are_the_plain_ones(spec: EngineLoop, plain: EngineLoop) -> None:
    records = []
    for loop in (spec, plain):
        r = make(TURNING, 12)
        r.logprobs = 3
        seen: list = []
        done = threading.Event()

        def emit(chunk: Chunk, seen: list = seen, done: threading.Event = done) -> None:
            seen.extend(chunk.logprobs)
            if chunk.finish_reason is not None:
                done.set()

        r.emit = emit
        loop.submit(r)
        assert done.wait(120)
        records.append(seen)
    a, b = records
    assert [x.token_id for x in a] == [x.token_id for x in b] == reference(TURNING, 12)[0]
    for x, y in zip(a, b, strict=True):
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert [i for i, _ in x.top] == [i for i, _ in y.top]


def test_an_opted_out_request_does_not_speculate(spec: EngineLoop) -> None:
    proposed = spec.scheduler.drafts_proposed
    off = make(TURNING, 16)
    off.speculative = False
    assert run(spec, [off]) == [reference(TURNING, 16)]
    assert off.draft_proposed == 0 and spec.scheduler.drafts_proposed == proposed


class HalfRightProposer(NgramProposer):
    """Proposes the reference's next ids with the second one wrong: each verification keeps one
    draft and rejects the rest."""

    def __init__(self, k: int, prompt: list[int], want: list[int]):
        super().__init__(k)
        self.prompt, self.want = prompt, want

    def propose(self, ids, k=None):  # type: ignore[no-untyped-def]
        done = len(ids) - len(self.prompt)
        out = list(self.want[done : done + (self.k if k is None else k)])
        if len(out) > 1:
            out[1] = (out[1] + 1) % CFG.vocab_size
        return out


def test_penalized_requests_speculate_and_keep_the_reference() -> None:
    """With penalties, each verifying position samples under the history up to its own position
    (``TokenHistory.at_slots``), and a row whose drafts were rejected has its history written
    whole again: the ids stay the penalized reference's, through kept and rejected drafts."""
    kw = dict(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3)
    want = reference(TURNING, 20, repetition=1.5, frequency=0.5, presence=0.3)
    loop = tiny_loop(speculative="ngram", speculative_tokens=K)
    loop.scheduler.proposer = HalfRightProposer(K, TURNING, want[0])
    loop.scheduler.max_draft_wait = 0
    started(loop)
    try:
        r = make(TURNING, 20, **kw)
        assert run(loop, [r]) == [want]
        assert r.draft_accepted >= 5 and r.draft_proposed > r.draft_accepted
    finally:
        loop.stop()


def test_a_prefix_hit_and_preemption_keep_the_reference() -> None:
    # 3 sequences of up to 33 + 16 tokens in 72 positions: they cannot all hold their pages.
    loop = started(tiny_loop(num_slots=3, kv_cache_tokens=72, page_size=16, speculative="ngram", speculative_tokens=K))
    try:
        refs = [reference(p, 16) for p in (PROMPT_A, PROMPT_C, TURNING)]
        assert run(loop, [make(p, 16) for p in (PROMPT_A, PROMPT_C, TURNING)]) == refs
        assert loop.scheduler.preemptions >= 1 and loop.scheduler.drafts_accepted > 0
        again = make(PROMPT_C, 16)
        assert run(loop, [again]) == [refs[1]] and again.cached_tokens > 0
        assert loop.scheduler.page_counts()["used"] == 0
    finally:
        loop.stop()


def test_data_replicas_and_a_live_switch_keep_the_reference() -> None:
    import jax

    from sharding.layouts import Layout

    loop = tiny_loop("2x1", jax.devices()[:2], speculative="ngram", speculative_tokens=K)
    new = loop.runner.relayout(Layout("1x1"), jax.devices()[:1])
    new.warmup_to_replace(loop.runner)
    started(loop)
    try:
        prompts = (PROMPT_A, TURNING, PROMPT_B, PROMPT_C)
        requests = [make(p, 24) for p in prompts]
        ids = run_across_switch(loop, new, requests)
        assert ids == [reference(p, 24)[0] for p in prompts]
        assert loop.scheduler.drafts_accepted > 0
    finally:
        loop.stop()


def test_the_sequences_of_one_request_speculate_each_on_its_own(spec: EngineLoop, plain: EngineLoop) -> None:
    """n = 2 (one ``group``: the second starts on the first's cached prompt pages), greedy and
    seeded: each sequence's ids are those it has without speculation."""
    for kw in ({}, {"temperature": 0.15, "top_k": 40}):
        got = []
        for loop in (spec, plain):
            pair = [make(TURNING, 16, **kw, seed=s) for s in (1, 2)]
            for r in pair:
                r.group = "n2"
            got.append(run(loop, pair))
        assert got[0] == got[1]
        if not kw:
            assert got[0] == [reference(TURNING, 16)] * 2


def sampled_prefixes(seed_base: int, n: int, **engine: object) -> np.ndarray:
    """[n, 6] the first 6 ids of ``TURNING`` sampled at temperature 0.05 (the tiny model's top two
    ids then carry about 0.56 and 0.27, so its ids repeat and n-gram drafts are proposed), seeds
    ``seed_base`` .. ``seed_base + n - 1``."""
    loop = started(tiny_loop(max_queue=n + 8, **engine))  # type: ignore[arg-type]
    try:
        out = run(loop, [make(TURNING, 6, temperature=0.05, seed=seed_base + s) for s in range(n)])
        if "speculative" in engine:
            assert loop.scheduler.drafts_accepted > n // 4
    finally:
        loop.stop()
    return np.array([ids for ids, _ in out])


def same_distribution_p(a: np.ndarray, b: np.ndarray) -> float:
    """The chi-square test of homogeneity's p-value for two samples of ids (ids seen fewer than 10
    times in both together left out)."""
    from scipy.stats import chi2_contingency

    ids = np.union1d(a, b)
    table = np.array([[np.sum(x == i) for i in ids] for x in (a, b)])
    return float(chi2_contingency(table[:, table.sum(0) >= 10])[1])


def test_speculative_and_plain_sampling_draw_ids_from_the_same_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """10,000 seeded draws of the first 6 ids with n-gram speculation and 10,000 without, on other
    seeds: at every position the ids' distributions agree (chi-square p > 1e-4). The same test
    rejects (p < 1e-12) a rule that keeps every draft without comparing it with the target's
    draw, from its 4th id on, where drafts begin."""
    plain = sampled_prefixes(1_000_000, 10_000, num_slots=32)
    spec = sampled_prefixes(0, 10_000, num_slots=4, speculative="ngram", speculative_tokens=K)
    for j in range(6):
        assert same_distribution_p(plain[:, j], spec[:, j]) > 1e-4, j
    import service.engine.scheduler

    monkeypatch.setattr(service.engine.scheduler, "accepted_run", lambda draft, sampled: [*draft, sampled[len(draft)]])
    biased = sampled_prefixes(2_000_000, 2_000, num_slots=4, speculative="ngram", speculative_tokens=K)
    assert min(same_distribution_p(plain[:, j], biased[:, j]) for j in (3, 4, 5)) < 1e-12
