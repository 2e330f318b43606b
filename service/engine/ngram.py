"""N-gram prompt lookup: draft tokens for speculative decoding without a draft model.

The proposal for a sequence (its prompt followed by its output) is what followed the latest
earlier occurrence of its last n ids, for the longest n in [n_min, n_max] that occurs earlier
(Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram_proposer``, llama.cpp's ``ngram``
speculative types). It is deterministic, so the verifier's rule is the simple one
(``service.engine.scheduler``'s ``accepted_run``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

if TYPE_CHECKING:
    from service.engine.request import Request


class Proposer(Protocol):
    """What the scheduler asks of a speculative decoding proposer (``NgramProposer``,
    ``service.engine.draft_model.DraftModelProposer``)."""

    name: str  # its label in the metrics
    k: int  # most ids it proposes per sequence and step
    # True: proposes for all of a step's sequences in one call, each charged its k up front;
    # False: one sequence at a time, each charged what it proposed (cheap proposals).
    batched: bool

    def propose_batch(self, wants: list[tuple[Request, int]]) -> list[list[int] | None]:
        """Up to k draft ids for each (running request, k) of ``wants``, whose ids are all on
        the host; [] where it has none (a miss), None where it is not ready yet (no miss)."""
        ...

    def forget(self, request: Request) -> None:
        """``request`` left its row: drop what is kept for it."""
        ...

    def warmup(self, full: bool = False) -> float:
        """Compile what proposing runs, before serving. Returns the seconds spent."""
        ...

    def close(self) -> None:
        """The engine stops: start no more work."""
        ...


class NgramProposer:
    """Proposes up to ``k`` ids by matching the sequence's last n ids earlier in it.

    Args:
        k: most ids proposed, >= 1.
        n_max: the longest suffix matched, >= n_min.
        n_min: the shortest suffix matched, >= 1.

    Raises:
        ValueError: sizes out of range.
    """

    name = "ngram"  # the proposer's label in the metrics
    batched = False  # a proposal costs microseconds: one sequence at a time

    def __init__(self, k: int, n_max: int = 3, n_min: int = 2):
        if k < 1 or n_min < 1 or n_max < n_min:
            raise ValueError(f"bad n-gram sizes: k {k}, n_max {n_max}, n_min {n_min}")
        self.k, self.n_max, self.n_min = k, n_max, n_min

    def propose_batch(self, wants: list[tuple[Request, int]]) -> list[list[int] | None]:
        """``propose`` for each (request, k) of ``wants``, over its prompt and output ids."""
        return [self.propose(r.prompt_ids + r.output_ids, k) for r, k in wants]

    def forget(self, request: Request) -> None:
        """Nothing is kept per request."""

    def warmup(self, full: bool = False) -> float:
        """Nothing to compile."""
        return 0.0

    def close(self) -> None:
        """Nothing runs in the background."""

    def propose(self, ids: Sequence[int], k: int | None = None) -> list[int]:
        """``k`` (default ``self.k``) ids to follow ``ids``: those after the latest earlier
        occurrence of its last n ids, longest n first, continued periodically where they run
        into the end; [] when no suffix recurs.

        Cost: O(len(ids) x n) in numpy per n tried."""
        k = self.k if k is None else k
        if k < 1 or len(ids) <= self.n_min:
            return []
        a = np.asarray(ids, np.int64)
        L = len(a)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            # Windows starting at 0 .. L - n - 1: every earlier occurrence (the suffix's own excluded).
            windows = sliding_window_view(a[: L - 1], n)
            hits = np.flatnonzero((windows == a[L - n :]).all(axis=1))
            if len(hits):
                # The match says the sequence repeats itself with period ``shift``: continue it so
                # (past the end, over the ids proposed), so a loop proposes k ids, not the one id
                # between its latest occurrence and the end.
                shift = L - n - int(hits[-1])
                out = np.concatenate([a, np.zeros(k, np.int64)])
                for i in range(L, L + k):
                    out[i] = out[i - shift]
                return out[L:].tolist()
        return []
