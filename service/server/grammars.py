"""Grammars for constrained decoding: compiled by llguidance off the event loop (the gateway calls
``Grammars.compile`` on a worker thread) and cached by their text.

A request's constraint (``validation.GrammarSpec``: OpenAI's ``response_format``, vLLM's
``structured_outputs``, gRPC's ``GenerateRequest.constraint``) is compiled once per distinct
text into an llguidance ``LLMatcher`` in its start state; each sequence gets its own copy
(``Constraint.fresh``), which the engine advances (``service.engine.constraint``). A constraint
that does not compile, or whose language is empty from its start, is refused with the
compiler's message (INVALID_ARGUMENT / 400).

JSON is generated on one line, with ``", "`` between items and ``": "`` after keys (the
separators of Python's ``json.dumps``): with llguidance's default, flexible whitespace, a small
model can fill a JSON value with newlines until ``max_tokens`` instead of closing it.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from typing import TYPE_CHECKING

import llguidance
import llguidance.numpy

from model.text.tokenizer import Tokenizer
from service.engine.constraint import Constraint
from service.server.validation import CONSTRAINT_KINDS, GrammarSpec, InvalidRequest

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # the stubs' TypedDict; the module has no such name

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CONSTRAINT_CHARS = 256 * 1024  # of a grammar, a regex, a schema's JSON text or a choice list
CACHE_SIZE = 256  # compiled grammars kept, the least recently used dropped first


class Grammars:
    """One model's grammar compiler and its cache. Thread-safe (``compile`` runs on worker threads).

    Args:
        tokenizer: the model's tokenizer (its vocabulary and EOS ids).
        vocab_size: the model's logits' width (ids past the tokenizer's are never allowed).

    Attributes:
        compile_seconds: the seconds of the last 1,024 compiles (cache misses), for the
            benchmark (benchmarks/structured.py).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._vocabulary: llguidance.LLTokenizer | None = None
        self._vocabulary_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str], Constraint] = collections.OrderedDict()
        self.compile_seconds: collections.deque[float] = collections.deque(maxlen=1024)

    def vocabulary(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built on first use (about half a second for
        SmolLM2's 49,152 ids)."""
        with self._vocabulary_lock:
            if self._vocabulary is None:
                self._vocabulary = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(),
                    n_vocab=self._vocab_size,
                    eos_token=sorted(self._tokenizer.eos_ids),
                )
            return self._vocabulary

    def compile(self, spec: GrammarSpec) -> Constraint:
        """The compiled constraint of ``spec`` in its start state: cached, or compiled now. It is
        shared: each sequence takes a ``fresh()`` copy, and nothing advances this one.

        Raises:
            InvalidRequest: the constraint is too long or does not compile (llguidance's
                message), or allows no output at all; the message starts with ``spec.field``.
        """
        key = (spec.kind, spec.text)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        t0 = time.perf_counter()
        compiled = self._compile(spec)
        with self._lock:
            self.compile_seconds.append(time.perf_counter() - t0)
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> Constraint:
        if len(spec.text) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequest(f"{spec.field}: at most {MAX_CONSTRAINT_CHARS} characters, got {len(spec.text)}")
        try:
            grammar = llguidance_grammar(spec)
        except ValueError as exc:
            raise InvalidRequest(f"{spec.field}: {exc}") from None
        vocabulary = self.vocabulary()
        error = llguidance.LLMatcher.validate_grammar(grammar, vocabulary)
        if error and not error.startswith("WARNING"):
            raise InvalidRequest(f"{spec.field}: does not compile: {first_line(error)}")
        matcher = llguidance.LLMatcher(vocabulary, grammar, log_level=0)
        if not matcher.is_error():  # computing the first mask finds a language with no text at all
            llguidance.numpy.fill_next_token_bitmask(
                matcher, llguidance.numpy.allocate_token_bitmask(1, self._vocab_size)
            )
        if matcher.is_error():
            raise InvalidRequest(f"{spec.field}: allows no output at all: {first_line(matcher.get_error())}")
        return Constraint(matcher)


def llguidance_grammar(spec: GrammarSpec) -> str:
    """llguidance's grammar for ``spec``.

    Raises:
        ValueError: the text is not what its kind needs (a schema that is not JSON or not an
            object, a choice list that is not a non-empty list of non-empty strings, a GBNF
            grammar that does not convert), or the kind is unknown.
    """
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "grammar":
        return llguidance.grammar_from("grammar", spec.text)  # Lark as is; GBNF converted to Lark
    if spec.kind == "choice":
        choices = json.loads(spec.text)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("must be a non-empty list of non-empty strings")
        return llguidance.grammar_from("choice", choices)  # type: ignore[arg-type]  # it takes the list
    raise ValueError(f"unknown kind {spec.kind!r}; valid: {', '.join(CONSTRAINT_KINDS)}")


def first_line(message: str) -> str:
    """llguidance's message without the parser state it appends."""
    return message.split("\n<state>")[0].strip()
