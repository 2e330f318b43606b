"""Streaming detokenization: turn generated token ids into text as they arrive.

A byte-level BPE token can hold part of a UTF-8 character (``"🙂"`` is several tokens), so the
text of one token alone is not safe to emit. :class:`IncrementalDetokenizer` uses the
prefix-offset/read-offset technique of TGI and vLLM: it keeps a short window of ids, decodes the
window with the tokenizer's own ``decode``, and emits only the text past what was already emitted,
and only once it does not end in an incomplete character (a trailing U+FFFD). Only the window is
decoded, so the cost per token does not grow with the sequence length.

While text is held, the detokenizer also looks for the latest token boundary that is a character
boundary (one where decoding the two sides separately gives the same text as decoding them
together) and emits everything up to it. That releases truly invalid bytes (emitted as U+FFFD, as
``decode`` does) instead of holding them to the end of the stream, and keeps the window short.

Invariant: ``"".join(push(i) for i in ids) + flush() == tokenizer.decode(ids)`` (with
``skip_special_tokens=True``): special (control) tokens produce no text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from model.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# How many of the latest token boundaries are tried as a split point while text is held. A valid
# incomplete character is at most 3 bytes, so at most 3 trailing tokens; each boundary gets tried
# on some push once the window grows past it.
_SPLIT_SEARCH = 4


class IncrementalDetokenizer:
    """Incremental decoder for one generated sequence; not thread-safe.

    Args:
        tokenizer: a :class:`model.text.tokenizer.Tokenizer` (needs ``decode`` and ``special_ids``).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._special = tokenizer.special_ids
        self._ids: list[int] = []  # window: ids[:read] were emitted (context), ids[read:] are pending
        self._read = 0
        self._prefix_text = ""  # decode(ids[:read])

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, read: int) -> None:
        """Make ``ids[old_read:read]`` the new context window and ``ids[read:]`` pending."""
        self._ids = self._ids[self._read :]
        self._read = read - self._read
        self._prefix_text = self._decode(self._ids[: self._read])

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (often ``""`` while a character is split).

        Special (control) ids are ignored and return ``""``.
        """
        if token_id in self._special:
            return ""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        prefix_len = len(self._prefix_text)
        if not text.endswith(_REPLACEMENT):
            if len(text) <= prefix_len:
                return ""
            self._advance(len(self._ids))
            return text[prefix_len:]
        # Held: emit up to the latest token boundary that is also a character boundary, if any.
        end = len(self._ids)
        for split in range(end - 1, max(self._read, end - 1 - _SPLIT_SEARCH), -1):
            head = self._decode(self._ids[:split])
            if len(head) > prefix_len and head + self._decode(self._ids[split:]) == text:
                self._advance(split)
                return head[prefix_len:]
        return ""

    def flush(self) -> str:
        """Return any held text (an incomplete character becomes U+FFFD, as ``decode`` gives) and reset."""
        text = self._decode(self._ids)[len(self._prefix_text) :]
        self._ids, self._read, self._prefix_text = [], 0, ""
        return text
