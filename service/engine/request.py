"""Request state: plain Python, no JAX, so the scheduler is testable without a model."""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from service.engine.text_stream import TextStream

if TYPE_CHECKING:
    from service.engine.constraint import Constraint


class FinishReason(enum.Enum):
    """Why a request stopped; values match ``meshserve.v1.FinishReason``."""

    LENGTH = 1
    EOS = 2  # an EOS id, or a constraint's grammar complete (EOS the only id it allows next)
    STOP_STRING = 3
    CANCELLED = 4
    GRAMMAR_DEAD_END = 5  # the constraint's grammar allows no next id (``Constraint.at_dead_end``)


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, no row yet
    PREFILLING = "prefilling"  # holds a row; prompt chunks still being written to the KV cache
    DECODING = "decoding"  # prompt cached; one token per engine step
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """Validated sampling parameters of one request (see ``model.sampling``).

    The penalties follow their sources: ``presence_penalty`` and ``frequency_penalty`` are
    OpenAI's (subtracted from the logit of every id already generated: once, and once per
    occurrence), ``repetition_penalty`` is CTRL's (Keskar et al. 2019, §4.1, as Hugging Face's
    ``RepetitionPenaltyLogitsProcessor``: the logit of every id in the prompt or the output is
    divided by it when positive, multiplied when negative; 1 disables it). ``min_p`` keeps the
    ids whose probability is at least ``min_p`` times the most likely one's (0 disables it).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0

    @property
    def penalized(self) -> bool:
        """Whether sampling reads the token history (any penalty set)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one generated id under the model's raw distribution (log-softmax of
    the logits, before temperature and filtering), with the ``top`` most likely alternatives as
    (id, log-probability) pairs, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass
class Chunk:
    """One streamed event: the text delta and the ids generated since the last chunk.

    ``finish_reason`` and the usage counts (``cached_tokens``: the prompt's tokens the prefix
    cache served at the request's first admission; ``accepted_draft_tokens`` and
    ``rejected_draft_tokens``: the draft ids speculative decoding verified for it, kept and not)
    are set on the last chunk only. ``error`` is set
    when the engine failed and the request cannot complete (the server maps it to UNAVAILABLE).
    """

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    accepted_draft_tokens: int = 0
    rejected_draft_tokens: int = 0
    error: str | None = None
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class Request:
    """A generation request as the engine loop sees it.

    Attributes:
        request_id: id used in logs and responses.
        prompt_ids: the prompt's token ids (non-empty, each < vocab size).
        max_tokens: most ids to generate (>= 1); prompt + max_tokens <= the engine's max length.
        sampling: sampling parameters.
        text: detokenizer and stop-string matcher for this request's output.
        emit: called from the engine thread with each Chunk (must not block).
        eos_ids: ids that end generation (excluded from the output), unless ``ignore_eos``.
        logprobs: None, or how many top alternatives (0..TOP_LOGPROBS) to return with each
            generated id's log-probability.
        min_tokens: EOS ids are not sampled (and stop strings do not end the request) before
            this many ids are generated: the engine loop bans the ``eos_ids`` on the device
            while ``sampled < min_tokens``, and the text of the first ``min_tokens - 1`` ids
            is not searched for stop strings (vLLM's rule: a stop string can end the request
            from its ``min_tokens``-th id on).
        ignore_eos: generation goes on past EOS ids (they are then ordinary output ids,
            counted and detokenized like any other: a special id's text is empty), to
            ``max_tokens`` or a stop string.
        prefix_cache: the request may reuse cached pages of an equal prefix and registers its
            own full pages for later requests; False opts out of both.
        group: the sequences of one request with n > 1 share it (None for n = 1): the
            scheduler admits one of them first and the others once its prompt is prefilled, so
            they reuse its prompt's pages instead of computing them n times.
        constraint: the grammar its output follows (its own state, advanced by each accepted
            id), or None. Each step samples it under its grammar's token mask; the grammar's end
            ends it as EOS, a dead end as GRAMMAR_DEAD_END.
        speculative: it may propose and verify draft ids where the engine speculates
            (``EngineConfig.speculative``); False opts out.
    """

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingOptions
    text: TextStream
    emit: Callable[[Chunk], None]
    eos_ids: frozenset[int]
    logprobs: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    prefix_cache: bool = True
    group: str | None = None
    constraint: Constraint | None = None
    speculative: bool = True
    output_ids: list[int] = dataclasses.field(default_factory=list)
    state: RequestState = RequestState.WAITING
    slot: int | None = None  # its row of the step's per-row arrays while it runs
    num_cached: int = 0  # tokens whose K/V are in the cache (prompt chunks, then fed-back ids)
    sampled: int = 0  # ids sampled by dispatched steps (EOS included), known before they land
    sampled_by: int | None = None  # the number of the step that sampled the newest id (None: none yet)
    preemptions: int = 0  # times the scheduler preempted it (it was recomputed as often)
    cached_tokens: int = 0  # prompt tokens the prefix cache served at its first admission
    draft_proposed: int = 0  # draft ids it proposed and a step verified
    draft_accepted: int = 0  # of those, the ids the verifier accepted
    draft_misses: int = 0  # proposals in a row that found no match or had none accepted
    draft_wait: int = 0  # decode steps left before it proposes again (after misses)
    finish_reason: FinishReason | None = None
    arrival_s: float = dataclasses.field(default_factory=time.monotonic)
    first_token_s: float | None = None
    finished_s: float | None = None
    _cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    _finish_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def cancel(self) -> None:
        """Ask the engine to stop this request (thread-safe); it frees its row within one step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefill_len(self) -> int:
        """Tokens a prefill writes before the next id is sampled: the prompt, plus the ids already
        generated when a preempted request is recomputed (they are fixed during its prefill)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def prefill_ids(self, start: int, length: int) -> list[int]:
        """Ids [start, start + length) of the prompt followed by the generated ids."""
        n = len(self.prompt_ids)
        if start + length <= n:
            return self.prompt_ids[start : start + length]
        return (self.prompt_ids + self.output_ids)[start : start + length]

    def accept_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        """Record one sampled id: check the constraint's dead end, EOS (unless ``ignore_eos``),
        stop strings (from the ``min_tokens``-th id on), the constraint's end and max_tokens,
        and emit a chunk (with ``logprob`` attached when the request asked for
        log-probabilities)."""
        if self.first_token_s is None:
            self.first_token_s = time.monotonic()
        c = self.constraint
        if c is not None and c.taken == len(self.output_ids) and c.at_dead_end:
            # Sampled after the grammar's dead end, under a mask of EOS ids alone: this is one.
            self.finish(FinishReason.GRAMMAR_DEAD_END)
            return
        if token_id in self.eos_ids and not self.ignore_eos:
            self.finish(FinishReason.EOS)
            return
        self.output_ids.append(token_id)
        delta, stopped = self.text.push(token_id, check_stop=len(self.output_ids) >= self.min_tokens)
        lps = [logprob] if logprob is not None and self.logprobs is not None else []
        # An id outside the grammar (never sampled under its mask) leaves it at a dead end.
        ended = self.constraint is not None and not stopped and (
            not self.constraint.accept(token_id, len(self.output_ids) - 1) or self.constraint.complete
        )  # fmt: skip
        if stopped:
            self.finish(FinishReason.STOP_STRING, last_text=delta, last_ids=[token_id], logprobs=lps)
        elif ended:
            assert self.constraint is not None
            reason = FinishReason.GRAMMAR_DEAD_END if self.constraint.at_dead_end else FinishReason.EOS
            self.finish(reason, last_text=delta, last_ids=[token_id], logprobs=lps)
        elif len(self.output_ids) >= self.max_tokens:
            self.finish(FinishReason.LENGTH, last_text=delta, last_ids=[token_id], logprobs=lps)
        else:
            self.emit(Chunk(text=delta, token_ids=[token_id], logprobs=lps))

    def take_ahead(self, token_id: int, ahead: int = 0) -> bool:
        """Advance the constraint's grammar over a sampled id before ``accept_token`` records it
        (which then finds it taken): the engine loop fills the next step's token masks before it
        does the rest of this step's bookkeeping. ``ahead``: the ids before it not recorded yet
        either (a verified draft run's). EOS ids (unless ``ignore_eos``) and a grammar at a dead
        end take nothing, as in ``accept_token``. Returns whether the grammar took it and goes on
        (False: the ids after it end nowhere, as the request ends at it)."""
        c = self.constraint
        if c is None or c.at_dead_end or (token_id in self.eos_ids and not self.ignore_eos):
            return False
        return c.accept(token_id, len(self.output_ids) + ahead) and not c.complete

    def finish(
        self,
        reason: FinishReason,
        last_text: str = "",
        last_ids: list[int] | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        """Mark finished and emit the final chunk (held-back text is flushed unless a stop
        string matched, in which case nothing of it is sent)."""
        with self._finish_lock:
            if self.state is RequestState.FINISHED:
                return
            self.state = RequestState.FINISHED
        if reason is not FinishReason.STOP_STRING:
            last_text += self.text.finish()
        self.finish_reason = reason
        self.finished_s = time.monotonic()
        self.emit(
            Chunk(
                text=last_text,
                token_ids=list(last_ids or []),
                finish_reason=reason,
                prompt_tokens=self.prompt_len,
                completion_tokens=len(self.output_ids),
                cached_tokens=self.cached_tokens,
                accepted_draft_tokens=self.draft_accepted,
                rejected_draft_tokens=self.draft_proposed - self.draft_accepted,
                logprobs=list(logprobs or []),
            )
        )

    def fail(self, message: str) -> None:
        """End the request because the engine failed (thread-safe; only the first end counts)."""
        with self._finish_lock:
            if self.state is RequestState.FINISHED:
                return
            self.state = RequestState.FINISHED
        self.finished_s = time.monotonic()
        self.emit(Chunk(text="", token_ids=[], error=message))
