"""Turn generated ids into streamed text: UTF-8-safe detokenization plus stop strings.

Stop strings may span tokens. Text that could still be the start of a stop string is held
back; when a stop string completes, everything from its first character on is dropped, so no
part of it is ever sent. When generation ends another way, the held text is flushed
(the two failure modes of vLLM #3574 and llama.cpp PR #15007).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class StopStringMatcher:
    """Holds back text that might begin a stop string.

    Args:
        stop: non-empty stop strings.
    """

    def __init__(self, stop: Sequence[str]):
        self.stop = tuple(stop)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        """Add new text; return (text safe to send now, whether a stop string matched)."""
        if self.stopped:
            return "", True
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stop) if i >= 0]
        if hits:
            self._held = ""
            self.stopped = True
            return buf[: min(hits)], True
        keep = 0
        for s in self.stop:  # longest suffix of buf that is a proper prefix of some stop string
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Release held text (generation ended without completing a stop string)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


class TextStream:
    """Detokenizer followed by the stop-string matcher, for one request."""

    def __init__(self, detokenizer: Detokenizer, stop: Sequence[str] = ()):
        self._detok = detokenizer
        self._matcher = StopStringMatcher(stop) if stop else None

    def push(self, token_id: int, check_stop: bool = True) -> tuple[str, bool]:
        """Text delta for one more id, and whether a stop string has now matched.

        ``check_stop`` False: the text is not searched for stop strings (a request's ids before
        its ``min_tokens``-th): it is sent at once, with any text still held, and a stop string
        that begins in it and ends later is not matched either."""
        text = self._detok.push(token_id)
        if self._matcher is None:
            return text, False
        if not check_stop:
            return self._matcher.flush() + text, False
        return self._matcher.feed(text)

    def finish(self) -> str:
        """Everything still held (incomplete UTF-8 tail and stop-string candidates)."""
        tail = self._detok.flush()
        if self._matcher is None:
            return tail
        text, stopped = self._matcher.feed(tail)
        return text if stopped else text + self._matcher.flush()
