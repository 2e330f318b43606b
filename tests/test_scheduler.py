"""Scheduler and Request without a model: fake requests over a fake detokenizer, and a fake
engine step that mirrors ``EngineLoop.step``'s postprocessing."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from service.engine.request import Chunk, FinishReason, Request, RequestState, SamplingOptions
from service.scheduler import PrefillChunk, QueueFull, Scheduler, StepPlan
from service.engine.text_stream import TextStream

EOS = 2
# id -> text; the EOS id maps to its special-token spelling so a leak would show.
PIECES = {EOS: "<|im_end|>", 5: "a", 6: "b", 7: "c", 10: "Hello", 11: " wor", 12: "ld", 13: "X", 14: "Y"}


class FakeDetokenizer:
    def push(self, token_id: int) -> str:
        return PIECES[token_id]

    def flush(self) -> str:
        return ""


def make_request(
    rid: str,
    prompt_len: int = 3,
    max_tokens: int = 8,
    stop: Sequence[str] = (),
    min_tokens: int = 0,
    ignore_eos: bool = False,
) -> tuple[Request, list[Chunk]]:
    chunks: list[Chunk] = []
    req = Request(
        request_id=rid,
        prompt_ids=[100 + i for i in range(prompt_len)],
        max_tokens=max_tokens,
        sampling=SamplingOptions(),
        text=TextStream(FakeDetokenizer(), stop),
        emit=chunks.append,
        eos_ids=frozenset({EOS}),
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
    )
    return req, chunks


def execute(sched: Scheduler, plan: StepPlan, token: int = 5) -> None:
    """What the engine loop does after running a plan: advance the caches, accept one token per
    decoding request (and the prefill's first token on a prompt's last chunk), free finished slots."""
    chunk = plan.prefill
    if chunk is not None:
        chunk.request.num_cached += chunk.length
        if chunk.is_last:
            chunk.request.state = RequestState.DECODING
            chunk.request.accept_token(token)
    for r in plan.decode:
        if r.state is RequestState.DECODING:
            r.num_cached += 1
            r.accept_token(token)
    sched.release_finished()


def step(sched: Scheduler, token: int = 5) -> StepPlan:
    plan = sched.schedule()
    execute(sched, plan, token)
    return plan


# ---- admission and the plan -----------------------------------------------------------------------


def test_fcfs_admission_into_free_slots() -> None:
    sched = Scheduler(num_slots=2, max_queue=8, chunk_size=16)
    reqs = [make_request(f"r{i}", max_tokens=3)[0] for i in range(4)]
    for r in reqs:
        sched.add(r)
    assert sched.queue_depth == 4 and sched.active_slots == 0

    p1 = step(sched)
    assert p1.prefill is not None and p1.prefill.request is reqs[0] and p1.prefill.slot == 0
    assert p1.decode == ()
    p2 = step(sched)
    assert p2.prefill is not None and p2.prefill.request is reqs[1] and p2.prefill.slot == 1
    assert p2.decode == (reqs[0],)
    assert sched.active_slots == 2 and list(sched.waiting) == reqs[2:]

    # No free slot: nothing is admitted, both running requests decode.
    p3 = step(sched)
    assert p3.prefill is None and p3.decode == (reqs[0], reqs[1])
    assert reqs[0].state is RequestState.FINISHED  # max_tokens 3: prefill token + 2 decodes
    assert reqs[0].finish_reason is FinishReason.LENGTH
    assert sched.slots == [None, reqs[1]]

    # The freed slot goes to the oldest waiting request.
    p4 = step(sched)
    assert p4.prefill is not None and p4.prefill.request is reqs[2] and p4.prefill.slot == 0
    assert p4.decode == (reqs[1],)
    assert list(sched.waiting) == [reqs[3]]
    assert sched.prefills_started == 3


def test_queue_bound_raises_queue_full() -> None:
    sched = Scheduler(num_slots=1, max_queue=2, chunk_size=16)
    sched.add(make_request("a")[0])
    sched.add(make_request("b")[0])
    with pytest.raises(QueueFull):
        sched.add(make_request("c")[0])
    assert sched.queue_depth == 2


def test_long_prompt_is_prefilled_one_chunk_per_step() -> None:
    sched = Scheduler(num_slots=3, max_queue=8, chunk_size=4)
    short, _ = make_request("short", prompt_len=2, max_tokens=50)
    long, _ = make_request("long", prompt_len=10, max_tokens=50)
    other, _ = make_request("other", prompt_len=3, max_tokens=50)
    for r in (short, long, other):
        sched.add(r)

    plan = step(sched)
    assert plan.prefill == PrefillChunk(short, 0, 0, 2) and plan.prefill.is_last
    assert short.state is RequestState.DECODING and short.num_cached == 2

    chunks = []
    for _ in range(3):
        plan = step(sched)
        assert plan.prefill is not None and plan.prefill.request is long and plan.prefill.slot == 1
        assert plan.prefill.length <= sched.chunk_size
        chunks.append((plan.prefill.start, plan.prefill.length, plan.prefill.is_last))
        # Only DECODING requests decode: the long prompt's slot is excluded while it prefills,
        # and the third request is not admitted until the long prompt is fully cached.
        assert plan.decode == (short,)
        assert other.state is RequestState.WAITING and other.slot is None
    assert chunks == [(0, 4, False), (4, 4, False), (8, 2, True)]
    assert long.state is RequestState.DECODING and long.num_cached == 10
    assert long.output_ids == [5]  # the first token comes with the last chunk

    plan = step(sched)
    assert plan.prefill == PrefillChunk(other, 2, 0, 3)
    assert plan.decode == (short, long)
    assert all(r.state is RequestState.DECODING for r in plan.decode)
    assert sched.prefills_started == 3


def test_decode_set_contains_only_decoding_requests() -> None:
    sched = Scheduler(num_slots=4, max_queue=8, chunk_size=4)
    a, _ = make_request("a", prompt_len=1)
    b, _ = make_request("b", prompt_len=9)
    sched.add(a)
    sched.add(b)
    step(sched)  # a: prefilled, DECODING
    plan = sched.schedule()  # b: first of three chunks
    assert plan.prefill is not None and plan.prefill.request is b
    assert b.state is RequestState.PREFILLING
    assert plan.decode == (a,)
    assert {r.state for r in plan.decode} == {RequestState.DECODING}


def test_empty_plan_when_idle() -> None:
    sched = Scheduler(num_slots=2, max_queue=4, chunk_size=8)
    plan = sched.schedule()
    assert plan.empty and plan.prefill is None and plan.decode == ()


# ---- cancellation ---------------------------------------------------------------------------------


def test_cancelled_waiting_request_never_gets_a_slot() -> None:
    sched = Scheduler(num_slots=1, max_queue=8, chunk_size=8)
    running, _ = make_request("running", max_tokens=100)
    waiting, chunks = make_request("waiting")
    sched.add(running)
    sched.add(waiting)
    step(sched)
    assert sched.prefills_started == 1

    waiting.cancel()
    plan = step(sched)
    assert waiting.state is RequestState.FINISHED and waiting.finish_reason is FinishReason.CANCELLED
    assert waiting.slot is None and waiting.num_cached == 0
    assert sched.queue_depth == 0 and sched.prefills_started == 1
    assert plan.prefill is None and plan.decode == (running,)
    assert len(chunks) == 1
    assert chunks[0].finish_reason is FinishReason.CANCELLED
    assert chunks[0].token_ids == [] and chunks[0].completion_tokens == 0 and chunks[0].prompt_tokens == 3

    # Even with a free slot, a request cancelled before its first step is never prefilled.
    sched2 = Scheduler(num_slots=2, max_queue=8, chunk_size=8)
    r, chunks2 = make_request("early")
    sched2.add(r)
    r.cancel()
    plan = sched2.schedule()
    assert plan.empty and sched2.prefills_started == 0 and r.slot is None
    assert r.finish_reason is FinishReason.CANCELLED and [c.finish_reason for c in chunks2] == [FinishReason.CANCELLED]


def test_cancelled_running_request_frees_its_slot_at_next_schedule() -> None:
    sched = Scheduler(num_slots=1, max_queue=8, chunk_size=8)
    a, a_chunks = make_request("a", max_tokens=100)
    b, _ = make_request("b", max_tokens=100)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    assert a.state is RequestState.DECODING and a.output_ids == [5, 5]
    assert sched.slots == [a] and list(sched.waiting) == [b]

    a.cancel()
    assert sched.slots == [a]  # nothing happens until the loop schedules again
    plan = sched.schedule()
    assert a.state is RequestState.FINISHED and a.finish_reason is FinishReason.CANCELLED
    assert a not in plan.decode
    # The slot was freed before admission, so the waiting request takes it in the same step.
    assert plan.prefill is not None and plan.prefill.request is b and plan.prefill.slot == 0
    assert sched.slots == [b]
    last = a_chunks[-1]
    assert last.finish_reason is FinishReason.CANCELLED and last.completion_tokens == 2 and last.token_ids == []
    assert sum(c.finish_reason is not None for c in a_chunks) == 1


# ---- Request.accept_token ---------------------------------------------------------------------------


def test_eos_ends_without_adding_id_or_text() -> None:
    r, chunks = make_request("r", max_tokens=10)
    r.state = RequestState.DECODING
    r.accept_token(5)
    r.accept_token(6)
    r.accept_token(EOS)
    assert r.state is RequestState.FINISHED and r.finish_reason is FinishReason.EOS
    assert r.output_ids == [5, 6]
    assert [c.text for c in chunks] == ["a", "b", ""]
    assert [c.token_ids for c in chunks] == [[5], [6], []]
    assert chunks[-1].finish_reason is FinishReason.EOS
    assert (chunks[-1].prompt_tokens, chunks[-1].completion_tokens) == (3, 2)
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_eos_flushes_text_held_for_a_stop_string() -> None:
    r, chunks = make_request("r", max_tokens=10, stop=["XYZ"])
    r.accept_token(5)
    r.accept_token(13)  # "X" is held: it could start "XYZ"
    r.accept_token(EOS)
    assert [c.text for c in chunks] == ["a", "", "X"]
    assert chunks[-1].token_ids == [] and chunks[-1].finish_reason is FinishReason.EOS
    assert "<|im_end|>" not in "".join(c.text for c in chunks)


def test_max_tokens_is_exact() -> None:
    for max_tokens in (1, 2, 5):
        r, chunks = make_request("r", max_tokens=max_tokens)
        r.accept_token(5)
        for _ in range(max_tokens - 1):
            assert r.state is not RequestState.FINISHED
            r.accept_token(6)
        assert r.state is RequestState.FINISHED and r.finish_reason is FinishReason.LENGTH
        assert len(r.output_ids) == max_tokens
        assert len(chunks) == max_tokens
        assert [len(c.token_ids) for c in chunks] == [1] * max_tokens
        assert chunks[-1].finish_reason is FinishReason.LENGTH
        assert chunks[-1].completion_tokens == max_tokens
        assert "".join(c.text for c in chunks) == "a" + "b" * (max_tokens - 1)


def test_stop_string_ends_with_stop_string() -> None:
    r, chunks = make_request("r", max_tokens=10, stop=["o wo"])
    r.accept_token(10)  # "Hello": the trailing "o" is held
    r.accept_token(11)  # " wor": "o wo" completes
    assert r.state is RequestState.FINISHED and r.finish_reason is FinishReason.STOP_STRING
    assert r.output_ids == [10, 11]
    assert [c.text for c in chunks] == ["Hell", ""]
    assert [c.token_ids for c in chunks] == [[10], [11]]
    assert chunks[-1].finish_reason is FinishReason.STOP_STRING and chunks[-1].completion_tokens == 2


def test_stop_string_on_the_last_allowed_token_reports_stop_string() -> None:
    r, chunks = make_request("r", max_tokens=2, stop=["lo"])
    r.accept_token(13)
    r.accept_token(10)  # "Hello" contains "lo" and is also the max_tokens-th token
    assert r.finish_reason is FinishReason.STOP_STRING
    assert "".join(c.text for c in chunks) == "XHel"


def test_ignore_eos_makes_eos_an_ordinary_output_id() -> None:
    r, chunks = make_request("r", max_tokens=3, ignore_eos=True)
    for token in (5, EOS, 6):
        r.accept_token(token)
    assert r.finish_reason is FinishReason.LENGTH and r.output_ids == [5, EOS, 6]
    assert [c.token_ids for c in chunks] == [[5], [EOS], [6]] and chunks[-1].completion_tokens == 3
    assert "".join(c.text for c in chunks) == "a<|im_end|>b"  # the fake detokenizer spells every id


def test_stop_strings_end_a_request_from_its_min_tokens_th_id_on() -> None:
    """vLLM's rule: the text of the first min_tokens - 1 ids is not searched for stop strings
    (it is sent as it comes); from the min_tokens-th id on, a stop string ends the request."""
    r, chunks = make_request("r", max_tokens=10, stop=["b"], min_tokens=3)
    r.accept_token(6)  # "b", the 1st id: not searched
    r.accept_token(6)  # the 2nd: not searched
    assert r.state is not RequestState.FINISHED and [c.text for c in chunks] == ["b", "b"]
    r.accept_token(6)  # the 3rd: "b" ends it, and is not sent
    assert r.finish_reason is FinishReason.STOP_STRING and r.output_ids == [6, 6, 6]
    assert "".join(c.text for c in chunks) == "bb"
    # A stop string that starts in unsearched text is not matched when it completes later.
    r, chunks = make_request("r", max_tokens=4, stop=["o wo"], min_tokens=2)
    for token in (10, 11, 5, 6):  # "Hello", " wor": "o wo" spans the 1st and 2nd ids
        r.accept_token(token)
    assert r.finish_reason is FinishReason.LENGTH
    assert "".join(c.text for c in chunks) == "Hello worab"
    # min_tokens 0 and 1 search from the first id, as without min_tokens.
    for min_tokens in (0, 1):
        r, chunks = make_request("r", max_tokens=10, stop=["b"], min_tokens=min_tokens)
        r.accept_token(6)
        assert r.finish_reason is FinishReason.STOP_STRING and r.output_ids == [6]


def test_finish_is_idempotent_and_cancel_after_finish_emits_nothing() -> None:
    r, chunks = make_request("r", max_tokens=1)
    r.accept_token(5)
    assert r.finish_reason is FinishReason.LENGTH and len(chunks) == 1
    r.cancel()
    r.finish(FinishReason.CANCELLED)
    r.fail("engine died")
    assert r.finish_reason is FinishReason.LENGTH and len(chunks) == 1
