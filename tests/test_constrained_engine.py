"""Constrained decoding in the engine (``service.engine.constraint``, the step's token mask) on the
tiny random model, against the dense reference with llguidance's own mask applied on the host
(``llguidance.numpy.apply_token_bitmask_inplace``): greedy ids identical, alone and inside a
batch of mixed constrained and unconstrained requests, through preemption and with penalties;
a grammar's end, a dead end, ``max_tokens`` mid-grammar and ``min_tokens`` end as documented;
with speculative decoding, every verifying position samples under its own mask."""

from __future__ import annotations

from collections.abc import Iterator

import llguidance
import llguidance.numpy
import numpy as np
import pytest
from helpers import penalized
from reference import (
    CFG,
    GRAPHDEF,
    PARAMS,
    PROMPT_A,
    PROMPT_B,
    PROMPT_C,
    T,
    dense_logits,
    make,
    run,
    run_across_switch,
    tiny_loop,
)
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from model.text.tokenizer import bytes_to_unicode
from service.engine.constraint import Constraint
from service.engine.loop import EngineLoop
from service.engine.ngram import NgramProposer
from service.engine.request import FinishReason

EOS = CFG.vocab_size - 1  # the byte vocabulary's last id is its EOS token


def byte_vocabulary() -> llguidance.LLTokenizer:
    """llguidance's view of a byte-level vocabulary as wide as the tiny model's logits: ids 0..254
    the bytes 0..254 (byte-level BPE's characters, no merges), id 255 the EOS token."""
    chars = bytes_to_unicode()
    vocab = {chars[b]: b for b in range(CFG.vocab_size - 1)}
    vocab["<eos>"] = EOS
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return llguidance.LLTokenizer(tok.to_str(), n_vocab=CFG.vocab_size, eos_token=EOS)


VOCAB = byte_vocabulary()
DIGITS = llguidance.LLMatcher.grammar_from_regex(r"[0-9]{2,6}(-[0-9]+)?")
WORDS = llguidance.grammar_from("choice", '["alpha", "beta", "gamma delta"]')
JSON = llguidance.LLMatcher.grammar_from_json_schema(
    {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["n", "ok"],
     "additionalProperties": False},
    defaults={"whitespace_flexible": False},
)  # fmt: skip
DEAD_END = llguidance.LLMatcher.grammar_from_lark('start: "ab" B\nB: /c/ & /d/')


def constraint(grammar: str) -> Constraint:
    return Constraint(llguidance.LLMatcher(VOCAB, grammar, log_level=0))


def constrained_reference(
    prompt: list[int], n: int, grammar: str, repetition: float = 1.0
) -> tuple[list[int], FinishReason]:
    """Greedy ids of the tiny model under ``grammar``: each step's dense logits, penalized, with
    the ids llguidance's mask forbids set to -inf on the host; the grammar's end or an EOS id
    ends it (EOS, not in the ids), a dead end ends it as GRAMMAR_DEAD_END."""
    matcher = llguidance.LLMatcher(VOCAB, grammar, log_level=0)
    mask = llguidance.numpy.allocate_token_bitmask(1, CFG.vocab_size)
    out: list[int] = []
    for _ in range(n):
        seq = prompt + out
        padded = np.zeros(-(-len(seq) // T) * T, np.int32)
        padded[: len(seq)] = seq
        logits = dense_logits(GRAPHDEF, PARAMS, padded)[len(seq) - 1].copy()
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        dead = matcher.is_error()
        row = penalized(logits, prompt, out, repetition, 0.0, 0.0)[None].astype(np.float32)
        llguidance.numpy.apply_token_bitmask_inplace(row, mask)
        token = int(np.argmax(row[0]))
        if dead:
            return out, FinishReason.GRAMMAR_DEAD_END
        if token == EOS:
            return out, FinishReason.EOS
        out.append(token)
        assert matcher.consume_token(token)
        if matcher.is_stopped():
            return out, FinishReason.EOS
    return out, FinishReason.LENGTH


@pytest.fixture(scope="module")
def loop() -> Iterator[EngineLoop]:
    loop = tiny_loop(num_slots=8)
    loop.start()
    assert loop.ready.wait(600)
    yield loop
    loop.stop()


def test_constrained_greedy_ids_are_the_reference_alone_and_in_a_mixed_batch(loop: EngineLoop) -> None:
    cases = [(PROMPT_A, DIGITS), (PROMPT_B, WORDS), (PROMPT_C, JSON)]
    refs = [constrained_reference(p, 24, g) for p, g in cases]
    assert {r[1] for r in refs} <= {FinishReason.EOS, FinishReason.LENGTH}
    assert any(r[1] is FinishReason.EOS for r in refs)  # some grammar ends inside 24 ids
    for (prompt, grammar), ref in zip(cases, refs, strict=True):
        assert run(loop, [make(prompt, 24, eos=frozenset({EOS}), constraint=constraint(grammar))]) == [ref]
    # Eight at once: the three constrained ones beside unconstrained, sampled and penalized rows.
    batch = [make(p, 24, eos=frozenset({EOS}), constraint=constraint(g)) for p, g in cases]
    batch += [
        make(PROMPT_A, 24),
        make(PROMPT_B, 24, temperature=0.8, seed=5),
        make(PROMPT_C, 24, repetition_penalty=1.3),
    ]
    batch += [make(PROMPT_B, 24, eos=frozenset({EOS}), constraint=constraint(DIGITS)), make(PROMPT_C[:9], 24)]
    got = run(loop, batch)
    assert got[:3] == refs
    assert got[6] == constrained_reference(PROMPT_B, 24, DIGITS)


def test_a_constrained_row_with_penalties_is_the_reference(loop: EngineLoop) -> None:
    ref = constrained_reference(PROMPT_C, 20, JSON, repetition=1.5)
    got = run(loop, [make(PROMPT_C, 20, eos=frozenset({EOS}), constraint=constraint(JSON), repetition_penalty=1.5)])
    assert got == [ref]


def test_the_output_is_in_the_grammar_when_sampled(loop: EngineLoop) -> None:
    requests = [
        make(PROMPT_B, 40, eos=frozenset({EOS}), constraint=constraint(JSON), temperature=1.0, seed=s) for s in range(4)
    ]
    for ids, reason in run(loop, requests):
        text = bytes(ids).decode()
        if reason is FinishReason.EOS:
            value = __import__("json").loads(text)
            assert set(value) == {"n", "ok"} and isinstance(value["n"], int) and isinstance(value["ok"], bool)
        else:
            assert reason is FinishReason.LENGTH and len(ids) == 40
        m = llguidance.LLMatcher(VOCAB, JSON, log_level=0)
        assert m.try_consume_tokens(ids) == len(ids)  # every id inside the grammar


def test_a_dead_end_ends_the_sequence_with_its_reason_and_others_go_on(loop: EngineLoop) -> None:
    ref = constrained_reference(PROMPT_A, 10, DEAD_END)
    assert ref == ([ord("a"), ord("b")], FinishReason.GRAMMAR_DEAD_END)
    got = run(loop, [make(PROMPT_A, 10, eos=frozenset({EOS}), constraint=constraint(DEAD_END)), make(PROMPT_B, 10)])
    assert got[0] == ref
    assert got[1][1] is FinishReason.LENGTH and len(got[1][0]) == 10


def test_max_tokens_inside_the_grammar_is_length(loop: EngineLoop) -> None:
    ids, reason = run(loop, [make(PROMPT_C, 3, eos=frozenset({EOS}), constraint=constraint(JSON))])[0]
    assert reason is FinishReason.LENGTH and bytes(ids).decode() == '{"n'


def test_min_tokens_cannot_hold_a_grammar_open_past_its_end(loop: EngineLoop) -> None:
    """A choice's words are shorter than min_tokens: the grammar ends the sequence (the EOS ban
    is lifted where the grammar allows nothing else) instead of sampling from an empty mask."""
    ids, reason = run(loop, [make(PROMPT_B, 20, eos=frozenset({EOS}), constraint=constraint(WORDS), min_tokens=15)])[0]
    assert reason is FinishReason.EOS and bytes(ids).decode() in ("alpha", "beta", "gamma delta")


def test_constrained_ids_survive_preemption() -> None:
    """A pool too small for three sequences preempts: the recomputed constrained sequence keeps its
    grammar state and its ids stay the reference's."""
    ref = constrained_reference(PROMPT_C, 24, JSON)
    loop = tiny_loop(kv_cache_tokens=96)
    loop.start()
    try:
        assert loop.ready.wait(600)
        got = run(
            loop,
            [
                make(PROMPT_A, 24),
                make(PROMPT_B, 24),
                make(PROMPT_C, 24, eos=frozenset({EOS}), constraint=constraint(JSON)),
            ],
        )
        assert got[2] == ref
        assert loop.scheduler.preemptions > 0
    finally:
        loop.stop()


def test_constrained_streams_keep_their_ids_across_a_live_switch() -> None:
    """2x1 -> 1x1 with constrained streams in flight: every sequence is recomputed over the new
    pools with its grammar state kept, and each stream's ids stay the constrained reference's."""
    import jax

    from sharding.layouts import Layout

    loop = tiny_loop("2x1", jax.devices()[:2])
    new = loop.runner.relayout(Layout("1x1"), jax.devices()[:1])
    new.warmup_to_replace(loop.runner)
    loop.start()
    try:
        assert loop.ready.wait(600)
        cases = [(PROMPT_A, DIGITS), (PROMPT_C, JSON), (PROMPT_B, DIGITS)]
        requests = [make(p, 24, eos=frozenset({EOS}), constraint=constraint(g)) for p, g in cases]
        ids = run_across_switch(loop, new, requests)
        assert sum(r.preemptions for r in requests) >= 1  # recomputed at the switch
        assert ids == [constrained_reference(p, 24, g)[0] for p, g in cases]
    finally:
        loop.stop()


# ---- with speculative decoding ----------------------------------------------------------------
class AllowedProposer(NgramProposer):
    """Proposes, for a constrained request, k ids its grammar allows in turn (random among the
    allowed ones, EOS aside): most are not the model's, so every verifying position samples, and
    only its own mask (the grammar advanced over the drafts before it) keeps it in the grammar."""

    name = "allowed"

    def __init__(self, k: int):
        super().__init__(k)
        self._rng = np.random.default_rng(4)

    def propose_batch(self, wants):  # type: ignore[no-untyped-def]
        out = []
        for r, k in wants:
            assert r.constraint is not None, "only constrained requests here"
            matcher, ids = r.constraint.matcher.deep_copy(), []
            mask = llguidance.numpy.allocate_token_bitmask(1, CFG.vocab_size)
            for _ in range(k):
                llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
                bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[: CFG.vocab_size]
                allowed = [i for i in np.flatnonzero(bits) if i != EOS]
                if not allowed or matcher.is_error():
                    break
                ids.append(int(self._rng.choice(allowed)))
                assert matcher.consume_token(ids[-1])
            out.append(ids)
        return out


def test_constrained_rows_speculate_under_a_mask_at_every_position() -> None:
    """Drafts the grammar allows but the model mostly does not pick: each verifying position
    samples under the grammar's mask after the drafts before it, so the ids stay the constrained
    reference's, alone and together; n-gram drafts of a constrained row are kept where right."""
    cases = [(PROMPT_A, DIGITS), (PROMPT_B, WORDS), (PROMPT_C, JSON)]
    refs = [constrained_reference(p, 24, g) for p, g in cases]
    loop = tiny_loop(num_slots=4, speculative="ngram", speculative_tokens=3)
    ngram = loop.scheduler.proposer
    loop.scheduler.proposer = AllowedProposer(3)
    loop.scheduler.max_draft_wait = 0
    loop.start()
    try:
        assert loop.ready.wait(600)
        for (prompt, grammar), ref in zip(cases, refs, strict=True):
            assert run(loop, [make(prompt, 24, eos=frozenset({EOS}), constraint=constraint(grammar))]) == [ref]
        got = run(loop, [make(p, 24, eos=frozenset({EOS}), constraint=constraint(g)) for p, g in cases])
        assert got == refs
        s = loop.scheduler
        assert s.drafts_proposed > 30 and 0 < s.drafts_accepted < s.drafts_proposed
        s.proposer = ngram  # the digits repeat: prompt lookup drafts them, and they are kept
        accepted = s.drafts_accepted
        assert run(loop, [make(PROMPT_A, 24, eos=frozenset({EOS}), constraint=constraint(DIGITS))]) == [refs[0]]
        assert s.drafts_accepted > accepted
    finally:
        loop.stop()


def test_a_grammar_taken_ahead_over_a_verified_draft_takes_the_kept_ids_only() -> None:
    """``Scheduler.advance_grammars`` over a step that verified drafts (the engine loop lands such a
    step before it schedules the next, so this runs only when a caller drives steps itself): the
    grammar takes the drafts the target kept and its id after them, not the rejected draft, and
    recording them later takes nothing twice."""
    from service.engine.block_manager import BlockManager
    from service.engine.output import HostStep
    from service.engine.scheduler import DecodeToken, Scheduler, StepPlan

    sched = Scheduler(4, 8, 16, 64, BlockManager(64, 4), 64, proposer=NgramProposer(3))
    r = make(PROMPT_B, 10, eos=frozenset({EOS}), constraint=constraint(DIGITS))
    draft = (ord("1"), ord("2"), ord("3"))
    plan = StepPlan(step=0, decode=(DecodeToken(request=r, slot=0, position=7, fed_by=None, draft=draft),))
    sampled = [ord("1"), ord("2"), ord("9"), ord("4")]  # the third draft rejected: "9" is the target's
    n = 4 + len(sampled)
    host = HostStep(
        ids=np.array([sampled[-1], 0, 0, 0, *sampled], np.int32),
        logprob=np.zeros(n, np.float32),
        top_logprobs=np.zeros((n, 20), np.float32),
        top_ids=np.zeros((n, 20), np.int32),
        slot_rows=np.zeros(len(sampled), np.int32),
    )
    assert r.constraint is not None
    sched.advance_grammars(plan, host)
    assert r.constraint.taken == 3
    for token in b"129":
        r.accept_token(token)
    assert r.output_ids == list(b"129") and r.constraint.taken == 3 and not r.constraint.at_dead_end
