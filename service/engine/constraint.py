"""Constrained decoding on the engine's side: each constrained sequence's grammar state
(``Constraint``, an llguidance ``LLMatcher``) and the packed token masks a step applies
(``TokenMasks``).

A mask is llguidance's and vLLM's packed bitmask: W = ceil(V / 32) int32 words, bit j of word i
allowing id 32 i + j (``model.sampling.apply_token_mask`` applies it in the step), one per
sampling slot of the step. The mask for the id a constrained row samples needs every id the row
generated before it, its matcher advanced over them on the host: the engine loop lands the step
in flight first (``EngineLoop.step``), then fills the masks (``TokenMasks.fill``). A
speculating row's slots verify its draft ids: the slot after draft j gets the mask of the
grammar advanced over drafts 1..j (llguidance advances a copy of the state and rolls it back;
the scheduler proposes only drafts the grammar allows). A step with no constrained row carries no
mask and applies none.

Grammars are compiled by the server (``service.server.grammars``) off the event loop; the engine
only advances and reads the matchers, on the loop thread (``Request.accept_token``).
"""

from __future__ import annotations

import dataclasses
import time

import llguidance
import llguidance.numpy
import numpy as np


class Constraint:
    """One sequence's grammar state: which ids may come next, given the ids it generated.

    Args:
        matcher: an llguidance ``LLMatcher``, advanced in place (``fresh`` gives a copy).
    """

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher
        self._taken = 0  # output ids taken so far
        self._last = True  # whether the last one was allowed

    def fresh(self) -> Constraint:
        """A copy in this one's state (a compiled grammar's start state, for a new sequence)."""
        return Constraint(self.matcher.deep_copy())

    def accept(self, token_id: int, index: int) -> bool:
        """Advance over output id number ``index`` (0-based); False when the grammar does not
        allow it (the matcher is then in its error state for good). Taking the same index again
        does nothing and answers as the first time: the engine loop advances a grammar ahead of
        the request's bookkeeping (``Request.take_ahead``), which takes the id again.

        Raises:
            ValueError: ``index`` skips an id.
        """
        if index < self._taken:
            return self._last
        if index > self._taken:
            raise ValueError(f"output id {index} given to a grammar that has taken {self._taken}")
        self._last = bool(self.matcher.consume_token(token_id))
        self._taken += 1
        return self._last

    @property
    def taken(self) -> int:
        """The output ids taken so far."""
        return self._taken

    @property
    def complete(self) -> bool:
        """The grammar has taken a whole text and allows no more: only an EOS id may follow."""
        return bool(self.matcher.is_stopped()) and not self.matcher.is_error()

    @property
    def at_dead_end(self) -> bool:
        """The grammar cannot continue (llguidance's error state: no id leads on); its mask then
        allows the EOS ids alone."""
        return bool(self.matcher.is_error())


@dataclasses.dataclass(frozen=True)
class ConstrainedRow:
    """A row that samples under ``constraint`` in a step: its first sampling ``slot``, its EOS
    ids, and the draft ids its next slots verify (speculative decoding), which the grammar
    allows."""

    row: int
    slot: int
    constraint: Constraint
    eos_ids: frozenset[int]
    draft: tuple[int, ...] = ()


class TokenMasks:
    """The token masks of one engine's steps, and the threads that fill them.

    Args:
        vocab_size: V, the model's logits' width (ids the tokenizer lacks are never allowed).
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._executor = llguidance.LLExecutor()
        self.fills = 0  # steps that filled masks, and the seconds they took (benchmarks/structured.py)
        self.fill_seconds = 0.0

    def fill(self, rows: list[ConstrainedRow], slots: int, ban_eos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The masks of a step's sampling slots (``RaggedBatch.token_mask``), and its EOS bans.

        Args:
            rows: each row that samples under a constraint whose matcher has taken every id its
                sequence generated.
            slots: the step's sampling slots (``Geometry.samplers``).
            ban_eos: [S] bool, the step's EOS bans (``RaggedBatch.ban_eos``; not changed).

        Returns:
            (mask [slots, W] int32: these rows' slots' masks, every other slot's allowing every
            id; the bans, with the ban (``min_tokens``) lifted for a row whose mask allows its EOS
            ids alone, its grammar complete or at a dead end: the grammar, not ``min_tokens``,
            decides where a constrained output ends, and with both no id would be allowed).
        """
        t0 = time.perf_counter()
        mask = np.full(llguidance.numpy.get_bitmask_shape(slots, self.vocab_size), -1, np.int32)
        # llguidance refuses an empty batch, and an empty draft where it takes drafts.
        with_drafts = [(r.constraint.matcher, r.slot, list(r.draft)) for r in rows if r.draft]
        if with_drafts:  # the slots after each draft id too
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(self._executor, with_drafts, mask)
        if plain := [(r.constraint.matcher, r.slot) for r in rows if not r.draft]:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, plain, mask)
        lifted = [r.row for r in rows if ban_eos[r.row] and not allows_beyond(mask[r.slot], r.eos_ids)]
        if lifted:
            ban_eos = ban_eos.copy()
            ban_eos[lifted] = False
        self.fills += 1
        self.fill_seconds += time.perf_counter() - t0
        return mask, ban_eos


def allows_beyond(words: np.ndarray, ids: frozenset[int]) -> bool:
    """Whether the packed mask ``words`` [W] int32 allows an id outside ``ids``."""
    rest = words.view(np.uint32).copy()
    for i in ids:
        if i // 32 < len(rest):
            rest[i // 32] &= ~np.uint32(1 << (i % 32))
    return bool(rest.any())
