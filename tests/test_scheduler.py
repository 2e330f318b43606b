"""The scheduler without a model: fake requests, its own ``schedule`` (which advances what a
step computes) and ``postprocess`` (which hands out ids, registers prefix pages and frees) over
a stand-in step's ids, so the engine loop's whole bookkeeping runs here."""

from __future__ import annotations

import numpy as np
import pytest
from test_request import EOS, make_request

from service.engine.block_manager import BlockManager
from service.engine.output import TOP_LOGPROBS, HostStep
from service.engine.request import FinishReason, Request, RequestState
from service.engine.scheduler import QueueFull, Scheduler, StepPlan


def scheduler(
    num_pages: int = 64, page_size: int = 4, slots: int = 4, budget: int = 32, chunk: int = 16, max_seq_len: int = 64
) -> Scheduler:
    return Scheduler(slots, 16, chunk, budget, BlockManager(num_pages, page_size), max_seq_len)


def ids(sched: Scheduler, token: int = 5) -> HostStep:
    """A step's results on the host: every row sampled ``token``."""
    S = sched.num_slots
    return HostStep(
        ids=np.full(S, token, np.int32),
        logprob=np.zeros(S, np.float32),
        top_logprobs=np.zeros((S, TOP_LOGPROBS), np.float32),
        top_ids=np.zeros((S, TOP_LOGPROBS), np.int32),
    )


def land(sched: Scheduler, plan: StepPlan, token: int = 5) -> None:
    """The step of ``plan`` lands: its ids, all ``token``, go to ``postprocess``."""
    sched.postprocess(plan, ids(sched, token))


def step(sched: Scheduler, token: int = 5) -> StepPlan:
    plan = sched.schedule()
    land(sched, plan, token)
    return plan


def check_pages(sched: Scheduler, plan: StepPlan) -> None:
    """After ``schedule``: every running request holds pages for exactly its cached tokens
    (which count what the plan will write; a whole prompt is reserved at admission), and its
    table row matches the block manager's."""
    bm = sched.pools[0]
    for r in sched.running:
        assert r.slot is not None
        table = bm.page_table(r)
        reserved = r.prefill_len if r.state is RequestState.PREFILLING else r.num_cached
        assert bm.num_tokens(r) == reserved
        assert list(sched.page_tables[r.slot, : len(table)]) == table
    assert bm.num_used + bm.num_cached + bm.num_free == bm.num_pages


def test_several_prompts_share_one_step_under_the_budget() -> None:
    sched = scheduler(budget=32, chunk=16)
    reqs = [make_request(f"r{i}", prompt_len=10)[0] for i in range(4)]
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    # 10 + 10 + 10 fit in 32; the fourth gets the 2 tokens left.
    assert [(c.request.request_id, c.start, c.length) for c in plan.prefills] == [
        ("r0", 0, 10),
        ("r1", 0, 10),
        ("r2", 0, 10),
        ("r3", 0, 2),
    ]
    assert plan.admitted == frozenset(reqs) and plan.num_tokens == 32
    check_pages(sched, plan)
    land(sched, plan)
    plan = sched.schedule()
    # Decode tokens for the three finished prompts, and the rest of r3.
    assert [t.request.request_id for t in plan.decode] == ["r0", "r1", "r2"]
    assert [(c.request.request_id, c.start, c.length) for c in plan.prefills] == [("r3", 2, 8)]
    assert not plan.admitted


def test_chunks_are_charged_in_aligned_units() -> None:
    sched = Scheduler(4, 16, 16, 32, BlockManager(64, 4), 64, chunk_align=8)
    reqs = [make_request(f"r{i}", prompt_len=n)[0] for i, n in enumerate((3, 9, 20))]
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    # 3 -> 8, 9 -> 16: 24 of 32; r2 gets the last unit, 8 tokens.
    assert [(c.request.request_id, c.length) for c in plan.prefills] == [("r0", 3), ("r1", 9), ("r2", 8)]


def test_a_long_prompt_goes_in_chunks_of_chunk_size() -> None:
    sched = scheduler(budget=64, chunk=16)
    r, _ = make_request("long", prompt_len=40)
    sched.add(r)
    starts = []
    for _ in range(3):
        plan = step(sched)
        starts += [(c.start, c.length) for c in plan.prefills]
    assert starts == [(0, 16), (16, 16), (32, 8)]
    assert r.state is RequestState.DECODING and len(r.output_ids) == 1


def test_rows_bound_the_running_sequences() -> None:
    sched = scheduler(slots=2)
    reqs = [make_request(f"r{i}", prompt_len=3, max_tokens=2)[0] for i in range(3)]
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    assert {c.request.request_id for c in plan.prefills} == {"r0", "r1"} and sched.queue_depth == 1
    land(sched, plan)
    step(sched)  # r0 and r1 reach max_tokens = 2
    assert reqs[0].finish_reason is FinishReason.LENGTH
    plan = sched.schedule()
    assert [c.request.request_id for c in plan.prefills] == ["r2"]


def test_finished_and_cancelled_requests_return_their_pages_at_once() -> None:
    sched = scheduler(num_pages=16, page_size=4)
    a, _ = make_request("a", prompt_len=9, max_tokens=1)
    b, chunks = make_request("b", prompt_len=9, max_tokens=50)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefilled; a finishes (max_tokens 1)
    assert a.state is RequestState.FINISHED
    assert sched.pools[0].num_used == 3  # b's 9 tokens: 3 pages; a's went back
    b.cancel()
    sched.schedule()
    assert b.finish_reason is FinishReason.CANCELLED and chunks[-1].finish_reason is FinishReason.CANCELLED
    assert sched.pools[0].num_used == 0 and sched.active_slots == 0


def test_a_shared_prefix_is_not_prefilled_again() -> None:
    sched = scheduler(page_size=4, budget=64, chunk=64)
    first, _ = make_request("first", prompt_len=13)
    sched.add(first)
    step(sched)
    second, _ = make_request("second", prompt_len=13)  # the same ids (make_request's prompt is 100..)
    sched.add(second)
    plan = sched.schedule()
    chunk = next(c for c in plan.prefills if c.request is second)
    # 13 tokens: pages [0,4) [4,8) [8,12) full; the last token's page is never matched.
    assert (chunk.start, chunk.length) == (12, 1)
    assert sched.pools[0].hit_tokens == 12 and sched.pools[0].queried_tokens == 26
    assert sched.pools[0].page_table(second)[:3] == sched.pools[0].page_table(first)[:3]


def test_the_prefix_cache_opt_out() -> None:
    sched = scheduler(page_size=4, budget=64, chunk=64)
    first, _ = make_request("first", prompt_len=13)
    sched.add(first)
    step(sched)
    second, _ = make_request("second", prompt_len=13)
    second.prefix_cache = False
    sched.add(second)
    plan = sched.schedule()
    chunk = next(c for c in plan.prefills if c.request is second)
    assert (chunk.start, chunk.length) == (0, 13) and sched.pools[0].hit_tokens == 0


def test_out_of_pages_preempts_the_newest_and_recomputes_it() -> None:
    # 6 pages of 4: two sequences of 8 prompt tokens hold 4 pages; each decode page costs one more.
    sched = scheduler(num_pages=6, page_size=4, slots=4, budget=32)
    old, old_chunks = make_request("old", prompt_len=8, max_tokens=12)
    new, new_chunks = make_request("new", prompt_len=8, max_tokens=12)
    sched.add(old)
    sched.add(new)
    tokens = iter(range(5, 15))
    plan = step(sched, next(tokens))
    assert len(plan.prefills) == 2
    preempted_at = None
    for i in range(12):
        plan = sched.schedule()
        check_pages(sched, plan)
        if sched.preemptions and preempted_at is None:
            preempted_at = i
            assert new.state is RequestState.WAITING and new.num_cached == 0 and list(sched.resuming) == [new]
            assert [t.request.request_id for t in plan.decode] == ["old"]
        land(sched, plan, 5)
        if old.state is RequestState.FINISHED and new.state is RequestState.FINISHED:
            break
    assert preempted_at is not None
    # Drain: the preempted request is prefilled again over its prompt and its ids, then decodes.
    for _ in range(40):
        if new.state is RequestState.FINISHED:
            break
        plan = step(sched)
    assert old.finish_reason is FinishReason.LENGTH and new.finish_reason is FinishReason.LENGTH
    assert len(new.output_ids) == 12 and new.preemptions >= 1
    assert all(c.error is None for c in new_chunks + old_chunks)
    assert sum(len(c.token_ids) for c in new_chunks) == 12  # nothing streamed twice
    assert sched.pools[0].num_used == 0


def test_a_recomputation_prefills_the_prompt_and_the_streamed_ids() -> None:
    sched = scheduler(num_pages=64, page_size=4)
    r, _ = make_request("r", prompt_len=5, max_tokens=20)
    r.prefix_cache = False  # no hits: the whole recomputation is prefilled
    sched.add(r)
    for _ in range(4):
        step(sched)
    assert len(r.output_ids) == 4 and r.num_cached == 8
    sched._preempt(r)
    plan = sched.schedule()
    (chunk,) = plan.prefills
    assert (chunk.start, chunk.length) == (0, 9) and chunk.is_last and r in plan.admitted
    assert r.prefill_ids(0, 9) == r.prompt_ids + r.output_ids


def test_a_preempted_request_waits_for_its_last_id_to_land() -> None:
    sched = scheduler()
    r, _ = make_request("r", prompt_len=5, max_tokens=20)
    sched.add(r)
    step(sched)
    in_flight = sched.schedule()  # r's second id is in flight
    sched._preempt(r)
    assert sched.schedule().empty  # not re-admitted: its ids are not all known
    land(sched, in_flight)
    plan = sched.schedule()
    (chunk,) = plan.prefills
    # Prompt (5) + 2 ids; its own first full page was registered, so the recomputation hits it.
    assert chunk.request is r and (chunk.start, chunk.start + chunk.length) == (4, 7)


def test_an_id_that_lands_after_preemption_can_finish_the_request() -> None:
    sched = scheduler()
    r, _ = make_request("r", prompt_len=5, max_tokens=20)
    sched.add(r)
    step(sched)
    in_flight = sched.schedule()
    sched._preempt(r)
    land(sched, in_flight, EOS)
    assert r.finish_reason is FinishReason.EOS and not sched.resuming
    assert sched.schedule().empty and sched.pools[0].num_used == 0


def test_cancel_while_waiting_to_resume() -> None:
    sched = scheduler()
    r, _ = make_request("r", prompt_len=5, max_tokens=20)
    sched.add(r)
    step(sched)
    sched._preempt(r)
    r.cancel()
    assert sched.schedule().empty
    assert r.finish_reason is FinishReason.CANCELLED and not sched.all_requests()


def test_the_queue_bound_counts_new_requests_only() -> None:
    sched = Scheduler(1, 1, 16, 16, BlockManager(64, 4), 64)
    a, _ = make_request("a")
    sched.add(a)
    with pytest.raises(QueueFull):
        sched.add(make_request("b")[0])


def test_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(8, 4, 16, 0, BlockManager(8, 4), 32)


def test_the_n_sequences_of_one_request_share_the_prompt_pages() -> None:
    sched = scheduler(page_size=4, budget=64, chunk=16)
    siblings = [make_request(f"n.{i}", prompt_len=21)[0] for i in range(3)]
    other, _ = make_request("other", prompt_len=5)
    other.prompt_ids = [7] * 5
    for r in siblings:
        r.group = "n"
        sched.add(r)
    sched.add(other)
    plan = sched.schedule()
    # The first sibling alone (its 21 tokens in chunks of 16); the other request goes past the rest.
    assert [(c.request.request_id, c.length) for c in plan.prefills] == [("n.0", 16), ("other", 5)]
    land(sched, plan)
    plan = sched.schedule()
    assert [(c.request.request_id, c.length) for c in plan.prefills] == [("n.0", 5)]
    land(sched, plan)
    plan = sched.schedule()
    # Now both others, each prefilling only the page of its last token (pages [0, 20) shared).
    assert [(c.request.request_id, c.start, c.length) for c in plan.prefills] == [("n.1", 20, 1), ("n.2", 20, 1)]
    table = sched.pools[0].page_table(siblings[0])[:5]
    assert sched.pools[0].page_table(siblings[1])[:5] == table == sched.pools[0].page_table(siblings[2])[:5]


def replicated(pages_each: int = 16, replicas: int = 2, slots: int = 4, budget: int = 32) -> Scheduler:
    return Scheduler(slots, 16, 16, budget, [BlockManager(pages_each, 4) for _ in range(replicas)], 64)


def ids_request(ids: list[int], max_tokens: int) -> Request:
    r, _ = make_request(f"r{ids[0]}-{len(ids)}", prompt_len=len(ids), max_tokens=max_tokens)
    r.prompt_ids = list(ids)
    return r


def test_data_replicas_own_their_rows_pools_and_budgets() -> None:
    """Two replicas of 2 rows: new requests go to the replica running fewer (then the lower),
    each replica's chunks have the whole budget, and pages come from the row's replica's pool."""
    sched = replicated(budget=16)
    reqs = [ids_request(list(range(1 + i, 17 + i)), max_tokens=4) for i in range(3)]
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    # 16 tokens each: one chunk per replica fills its budget; the third waits.
    assert [c.request for c in plan.prefills] == reqs[:2]
    assert [sched.replica_of(r) for r in reqs[:2]] == [0, 1] and reqs[2].slot is None
    assert [b.num_used for b in sched.pools] == [4, 4]
    for r in reqs[:2]:
        assert list(sched.page_tables[r.slot, :4]) == sched.pools[sched.replica_of(r)].page_table(r)
    land(sched, plan)
    step(sched)
    assert sched.replica_of(reqs[2]) == 0  # a tie: the lower replica
    # 17 positions each for the first two (5 pages), 16 for the third (4).
    assert sched.page_counts() == {"used": 14, "cached": 0, "free": 18} and sched.num_pages == 32


def test_a_request_goes_to_the_replica_holding_its_prefix() -> None:
    sched = replicated()
    first = ids_request(list(range(100, 121)), max_tokens=1)  # 21 tokens: 5 full pages
    busy = ids_request(list(range(1, 9)), max_tokens=30)
    sched.add(busy)
    step(sched)  # busy in replica 0
    sched.add(first)
    while first.state is not RequestState.FINISHED:
        step(sched)
    assert first.slot is None and busy.slot == 0  # first ran in replica 1 (rows 2, 3) and finished
    again = ids_request([*range(100, 121), 7], max_tokens=1)
    sched.add(again)
    (chunk,) = sched.schedule().prefills
    # replica 1 holds the prefix; replica 0 runs one sequence, replica 1 none: the prefix decides
    assert sched.replica_of(again) == 1 and chunk.start == 20
    assert sched.prefix_tokens()[1] == 20


def test_out_of_pages_preempts_the_newest_of_the_same_replica() -> None:
    # 2 rows per replica, 6 pages (24 positions) each. a and c (replica 0: 12 + 20 tokens each)
    # outgrow it; b and d (replica 1: 4 + 4 each) fit in theirs, and are never preempted.
    sched = replicated(pages_each=6)
    a, c = (ids_request(list(range(10 * i, 10 * i + 12)), max_tokens=20) for i in (1, 2))
    b, d = (ids_request(list(range(10 * i, 10 * i + 4)), max_tokens=4) for i in (3, 4))
    for r in (a, b, c, d):
        sched.add(r)
    for _ in range(40):
        step(sched)
        if sched.preemptions:
            break
    assert [sched.replica_of(r) for r in (a, b)] == [0, 1]
    assert sched.preemptions == 1 and c.preemptions == 1 and c.slot is None
    assert not (a.preemptions or b.preemptions or d.preemptions)


def test_repartition_recomputes_every_sequence_over_the_new_pools() -> None:
    sched = replicated()
    reqs = [ids_request(list(range(1 + i, 9 + i)), max_tokens=8) for i in range(3)]
    for r in reqs:
        sched.add(r)
    step(sched)
    step(sched)
    streamed = [list(r.output_ids) for r in reqs]
    sched.repartition([BlockManager(40, 4)])
    assert sched.running == [] and list(sched.resuming) == reqs  # the oldest resumes first
    assert sched.pools[0].num_pages == 40 and sched.rows_per_replica == 4
    plan = sched.schedule()
    assert [c.request for c in plan.prefills] == reqs
    assert all(c.start == 0 and c.length == 8 + len(s) for c, s in zip(plan.prefills, streamed, strict=True))


def test_a_preemption_in_one_replica_does_not_hold_back_admission_to_another() -> None:
    # Replica 0 (6 pages of 4) holds a and c, 12 prompt tokens each: their first decode tokens
    # need a seventh page, so the next step preempts c. b (replica 1) is done by then.
    sched = replicated(pages_each=6)
    a, c = (ids_request(list(range(10 * i, 10 * i + 12)), max_tokens=20) for i in (1, 2))
    b = ids_request([90, 91, 92, 93], max_tokens=1)
    for r in (a, b, c):
        sched.add(r)
    plan = sched.schedule()
    assert [sched.replica_of(r) for r in (a, b, c)] == [0, 1, 0]
    land(sched, plan)
    assert b.state is RequestState.FINISHED
    late = ids_request([80, 81, 82, 83], max_tokens=2)
    sched.add(late)
    plan = sched.schedule()
    assert c.preemptions == 1 and sched.preemptions == 1
    # Replica 0 admits nothing in the step it preempted in; replica 1 takes c back (resumed
    # requests first) and late.
    assert plan.admitted == {c, late} and [sched.replica_of(r) for r in (c, late)] == [1, 1]
    assert [ch.request for ch in plan.prefills] == [c, late] and [t.request for t in plan.decode] == [a]


def test_repartition_keeps_the_prefix_totals_and_fails_what_no_new_replica_holds() -> None:
    sched = replicated()
    done = ids_request(list(range(1, 22)), max_tokens=1)
    sched.add(done)
    while done.state is not RequestState.FINISHED:
        step(sched)
    hit = ids_request([*range(1, 22), 3], max_tokens=3)
    sched.add(hit)
    step(sched)
    big, big_chunks = make_request("big", prompt_len=30, max_tokens=20)  # 50 tokens: more than 8 pages of 4
    sched.add(big)
    step(sched)
    totals = sched.prefix_tokens()
    assert totals[1] == 20
    sched.repartition([BlockManager(8, 4), BlockManager(8, 4)])
    assert sched.prefix_tokens() == totals  # monotonic: the metrics add the differences
    assert big.state is RequestState.FINISHED and big not in sched.resuming
    assert big_chunks[-1].error and "pool of 32 tokens" in big_chunks[-1].error
    while hit.state is not RequestState.FINISHED:
        step(sched)
    assert sched.prefix_tokens()[0] > totals[0]


def test_the_queue_bound_counts_new_requests_not_ones_resuming() -> None:
    from service.engine.loop import EngineLoop

    sched = Scheduler(4, 2, 16, 32, BlockManager(64, 4), 64)  # max_queue 2
    loop = EngineLoop(object(), sched)  # type: ignore[arg-type]
    reqs = [ids_request([i, i + 1, i + 2], max_tokens=4) for i in range(4)]
    for r in reqs[:2]:
        sched.add(r)
    step(sched)
    for r in reqs[2:]:
        sched.add(r)
    step(sched)
    sched.repartition([BlockManager(32, 4), BlockManager(32, 4)])
    assert len(sched.resuming) == 4 and not sched.waiting
    assert loop.queue_full() is None


def test_requests_the_free_slots_will_take_do_not_count_as_waiting() -> None:
    """A burst into an idle server: the first num_slots requests take the free slots at the
    next step, so only the rest count against max_queue (a burst of 10 into 4 idle slots with a
    queue of 8 had one refused; a queue of 0 refused everything)."""
    from service.engine.loop import EngineLoop

    sched = Scheduler(4, 2, 16, 32, BlockManager(64, 4), 64)  # 4 slots, max_queue 2
    loop = EngineLoop(object(), sched)  # type: ignore[arg-type]
    loop._pending = 5  # in the inbox: 4 take the free slots, 1 waits
    assert loop.queue_full() is None
    loop._pending = 6
    assert loop.queue_full() == "queue full: 2 requests waiting (max 2)"
    loop._pending = 0
    reqs = [ids_request([i, i + 1, i + 2], max_tokens=4) for i in range(6)]
    for r in reqs:  # what the loop moves from its inbox, counted in submit already
        sched.add(r, reserved=True)
    with pytest.raises(QueueFull):
        sched.add(ids_request([1, 2, 3], max_tokens=4))  # unreserved: the scheduler's own bound
    step(sched)
    assert sched.active_slots == 4 and len(sched.waiting) == 2
    assert loop.queue_full() == "queue full: 2 requests waiting (max 2)"  # the slots are taken now


def test_cancelled_requests_do_not_hold_queue_room() -> None:
    """Clients that gave up (a deadline, a hang-up) leave the queue only at the next step, which
    can be seconds away: they held its room meanwhile, and a fresh request was refused with
    nobody waiting (stop 36's breaker: 70 clients with 0.3 s deadlines behind long prefills)."""
    from service.engine.loop import EngineLoop

    sched = Scheduler(4, 2, 16, 32, BlockManager(64, 4), 64)  # 4 slots, max_queue 2
    loop = EngineLoop(object(), sched)  # type: ignore[arg-type]
    reqs = [ids_request([i, i + 1, i + 2], max_tokens=4) for i in range(6)]
    for r in reqs:
        sched.add(r, reserved=True)
    step(sched)
    assert sched.active_slots == 4 and len(sched.waiting) == 2
    assert loop.queue_full() == "queue full: 2 requests waiting (max 2)"
    reqs[4].cancel()
    assert loop.queue_full() is None  # one waits: room for one more
    gone = ids_request([7, 8, 9], max_tokens=4)  # submitted, then cancelled, still in the inbox
    loop._inbox.append(gone)
    loop._pending += 1
    assert loop.queue_full() == "queue full: 2 requests waiting (max 2)"
    gone.cancel()
    assert loop.queue_full() is None


def test_the_step_observer_counts_across_a_repartition() -> None:
    """The server's per-step metrics add the scheduler's totals' differences: after a switch
    to new pools they keep counting (they once went negative and stopped)."""
    import types

    from service.server.gateway import Gateway
    from service.server.metrics import Metrics

    def total(m: Metrics, name: str) -> float:
        return next(s.value for metric in m.registry.collect() for s in metric.samples if s.name == name)

    sched = replicated()
    m = Metrics()
    on_step = Gateway._step_observer(types.SimpleNamespace(metrics=m), "p", sched)  # type: ignore[arg-type]
    first = ids_request(list(range(1, 22)), max_tokens=2)
    sched.add(first)
    while first.state is not RequestState.FINISHED:
        on_step(step(sched), 0.01)
    sched.add(ids_request([*range(1, 22), 3], max_tokens=3))
    on_step(step(sched), 0.01)
    sched.repartition([BlockManager(32, 4)])
    sched.add(ids_request(list(range(50, 60)), max_tokens=1))
    for _ in range(4):
        on_step(step(sched), 0.01)
    queried, hits = sched.prefix_tokens()
    assert total(m, "meshserve_preemptions_total") == sched.preemptions == 1
    assert total(m, "meshserve_prefix_cache_queried_tokens_total") == queried > 21 + 22
    assert total(m, "meshserve_prefix_cache_hit_tokens_total") == hits >= 20
