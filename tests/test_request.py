"""Request without a model: ``accept_token`` over a fake detokenizer (EOS, stop strings,
``max_tokens``, ``min_tokens``, ``ignore_eos``) and the end of a request; ``make_request`` and
``EOS`` serve tests/test_scheduler.py too."""

from __future__ import annotations

from collections.abc import Sequence

from service.engine.request import Chunk, FinishReason, Request, RequestState, SamplingOptions
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
