"""StopStringMatcher and TextStream over a fake detokenizer that maps ids to fixed strings.

Properties checked: text that might begin a stop string is held back, so no part of a stop
string is ever sent (every running concatenation of the deltas is a prefix of the final text);
the earliest match among several stop strings wins; held text is flushed by ``finish()`` when
no stop string completed; nothing after a stop is ever sent.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from service.engine.text_stream import StopStringMatcher, TextStream


class FakeDetokenizer:
    """Maps each id to a fixed string; ``flush`` returns ``tail`` once (an incomplete-character stand-in)."""

    def __init__(self, pieces: dict[int, str], tail: str = ""):
        self.pieces = pieces
        self.tail = tail
        self.pushed: list[int] = []

    def push(self, token_id: int) -> str:
        self.pushed.append(token_id)
        return self.pieces[token_id]

    def flush(self) -> str:
        tail, self.tail = self.tail, ""
        return tail


def stream_of(pieces: Sequence[str], stop: Sequence[str], tail: str = "") -> tuple[TextStream, list[int]]:
    """A TextStream whose ids 0..n-1 produce ``pieces`` in order."""
    detok = FakeDetokenizer(dict(enumerate(pieces)), tail=tail)
    return TextStream(detok, stop), list(range(len(pieces)))


def run(pieces: Sequence[str], stop: Sequence[str], tail: str = "") -> tuple[list[str], bool, int]:
    """Push every piece until a stop matches, then finish. Returns (deltas, stopped, pushes made)."""
    ts, ids = stream_of(pieces, stop, tail)
    deltas: list[str] = []
    for n, i in enumerate(ids, start=1):
        delta, stopped = ts.push(i)
        deltas.append(delta)
        if stopped:
            deltas.append(ts.finish())
            return deltas, True, n
    deltas.append(ts.finish())
    return deltas, False, len(ids)


def reference(pieces: Sequence[str], stop: Sequence[str], tail: str = "") -> tuple[str, bool, int]:
    """What the stream must produce, as (final text, stopped on a push, pushes made): the text up
    to the earliest stop string at the first push after which any stop string occurs in the
    accumulated text; else everything plus the tail (cut at a stop the tail completes)."""
    acc = ""
    for n, piece in enumerate(pieces, start=1):
        acc += piece
        hits = [acc.find(s) for s in stop if s in acc]
        if hits:
            return acc[: min(hits)], True, n
    acc += tail  # the detokenizer's tail goes through the matcher in finish()
    hits = [acc.find(s) for s in stop if s in acc]
    return (acc[: min(hits)] if hits else acc), False, len(pieces)


def assert_prefix_closed(deltas: Sequence[str], final: str) -> None:
    running = ""
    for d in deltas:
        running += d
        assert final.startswith(running), f"sent {running!r}, which is not a prefix of the final {final!r}"
    assert running == final


# ---- StopStringMatcher ----------------------------------------------------------------------------


def test_matcher_holds_possible_stop_prefix_and_releases_it_when_it_diverges() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("abcS") == ("abc", False)
    assert m.feed("T") == ("", False)  # "ST" still a prefix of "STOP"
    assert m.feed("x") == ("STx", False)  # diverged: the held text goes out
    assert m.flush() == ""
    assert not m.stopped


def test_matcher_stop_spanning_three_feeds_is_never_partially_sent() -> None:
    m = StopStringMatcher(["<END>"])
    out = []
    for piece in ["Hi <", "E", "N", "D>tail"]:
        text, stopped = m.feed(piece)
        out.append(text)
    assert out == ["Hi ", "", "", ""]
    assert stopped and m.stopped
    assert m.flush() == ""


def test_matcher_feed_after_stop_sends_nothing() -> None:
    m = StopStringMatcher(["xy"])
    assert m.feed("axyb") == ("a", True)
    assert m.feed("more text") == ("", True)
    assert m.flush() == ""


def test_matcher_longest_candidate_across_several_stops_is_held() -> None:
    # "ab" is a prefix of "abc"; "b" alone would be a prefix of "bz". The longest suffix wins.
    m = StopStringMatcher(["bz", "abc"])
    assert m.feed("xab") == ("x", False)
    assert m.feed("z") == ("a", True)  # "bz" completed at index 2 of "xabz" -> "a" after the sent "x"


# ---- TextStream -----------------------------------------------------------------------------------


def test_stop_string_spanning_several_pushes() -> None:
    pieces = ["Hel", "lo ", "wo", "rld", "! more"]
    deltas, stopped, pushes = run(pieces, ["lo world"])
    assert stopped
    assert pushes == 4  # the stop completes with "rld"; nothing is pushed after it
    assert deltas[:4] == ["He", "l", "", ""]  # each "l" is held while it could start the stop
    assert "".join(deltas) == "Hel"
    assert_prefix_closed(deltas, "Hel")


def test_earliest_match_among_several_stop_strings_wins() -> None:
    # Both complete in the same push; the later-listed one starts earlier in the text.
    deltas, stopped, _ = run(["xx", "abcdyy"], ["cd", "ab"])
    assert stopped and "".join(deltas) == "xx"
    # One completes on an earlier push than the other could.
    deltas, stopped, pushes = run(["ab", "cd", "ef"], ["abcdef", "cd"])
    assert stopped and pushes == 2 and "".join(deltas) == "ab"
    assert_prefix_closed(deltas, "ab")
    # Same text, the order of the stop list does not matter.
    for stop in (["world", "o w"], ["o w", "world"]):
        deltas, stopped, _ = run(["Hello", " world"], stop)
        assert stopped and "".join(deltas) == "Hell"


def test_held_text_is_flushed_by_finish_when_no_stop_completes() -> None:
    ts, ids = stream_of(["abc", "ST", "O"], ["STOP"])
    assert ts.push(ids[0]) == ("abc", False)
    assert ts.push(ids[1]) == ("", False)
    assert ts.push(ids[2]) == ("", False)
    assert ts.finish() == "STO"  # generation ended (EOS/length): the held candidate is released


def test_finish_flushes_detokenizer_tail_through_the_matcher() -> None:
    # The tail does not complete the stop: held text and tail are both released.
    ts, ids = stream_of(["abc", "ST"], ["STOP"], tail="UV")
    assert ts.push(ids[0]) == ("abc", False)
    assert ts.push(ids[1]) == ("", False)
    assert ts.finish() == "STUV"
    # The tail completes the stop: nothing of it, nor after it, is sent.
    ts, ids = stream_of(["abc", "ST"], ["STOP"], tail="OP!")
    ts.push(ids[0])
    ts.push(ids[1])
    assert ts.finish() == ""


def test_text_after_a_stop_is_never_sent() -> None:
    ts, ids = stream_of(["one ", "two", " three", " four"], ["two"])
    assert ts.push(ids[0]) == ("one ", False)
    assert ts.push(ids[1]) == ("", True)
    assert ts.push(ids[2]) == ("", True)
    assert ts.push(ids[3]) == ("", True)
    assert ts.finish() == ""


def test_no_stop_strings_passes_text_through() -> None:
    ts, ids = stream_of(["a", "b", "c"], [], tail="!")
    assert [ts.push(i) for i in ids] == [("a", False), ("b", False), ("c", False)]
    assert ts.finish() == "!"


def test_stop_string_equal_to_one_piece_and_at_the_very_start() -> None:
    deltas, stopped, pushes = run(["<|im_end|>", "x"], ["<|im_end|>"])
    assert stopped and pushes == 1 and "".join(deltas) == ""


@pytest.mark.parametrize("seed", range(40))
def test_random_pieces_match_the_reference(seed: int) -> None:
    """Random texts over a tiny alphabet (so stop prefixes recur) cut into random pieces."""
    rng = random.Random(seed)
    alphabet = "abc "
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)] if text else []
    stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
    tail = rng.choice(["", "a", "cb"])
    want, want_stopped, want_pushes = reference(pieces, stop, tail)
    deltas, stopped, pushes = run(pieces, stop, tail)
    assert (stopped, pushes) == (want_stopped, want_pushes), (pieces, stop, tail)
    assert_prefix_closed(deltas, want)
    for s in stop:  # no stop string is ever sent whole
        assert s not in "".join(deltas)
