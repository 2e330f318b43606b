"""Validate a request and turn it into prompt ids plus engine parameters.

Both APIs come through here: gRPC's ``GenerateRequest`` (``validate``) and the OpenAI-compatible
HTTP API (``service.server.openai_api``, which builds a ``Params`` and calls ``validate_params``), so the
ranges, defaults and messages are the same for both. Every rejection is an ``InvalidRequest``
whose message starts with the field's name (as the request spelled it); the server maps it to
INVALID_ARGUMENT (gRPC) or 400 (HTTP). Defaults for unset fields (explicit proto3 presence) are
documented here and in docs/api.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import numpy as np

from model.text.tokenizer import NoChatTemplateError, Tokenizer
from protos.meshserve.v1 import meshserve_pb2 as pb
from service.engine.output import TOP_LOGPROBS
from service.engine.request import SamplingOptions
from service.server.arg_types import SEED_RANGE

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0
CHAT_ROLES = ("system", "user", "assistant")
# Bounds of ``stop`` (protos/meshserve/v1/meshserve.proto): every stop string is matched against
# the text of every generated token, so their number and length are kept small.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# Most sequences one request may ask for (``n``). Each is a request of its own to the engine
# (its own slot, its own prefill of the prompt), all queued at once, so ``n`` is also bounded by
# the server's queue (``--max-queue``): a larger one could never be admitted.
MAX_N = 16
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty and frequency_penalty, as OpenAI's API bounds them
INT32_MAX = 2**31 - 1
# The engine holds temperature and repetition_penalty as float32 and divides the logits by them:
# a value above float32's largest becomes inf (a banned id's -inf / inf is NaN), and a tiny one
# sends every positive logit to inf (the draw then takes the first id: a 1.2e-38 temperature
# answered " " and seven <|endoftext|>).
FLOAT32_MAX = float(np.finfo(np.float32).max)
# Temperatures below this are greedy, as in vLLM (``_SAMPLING_EPS``): the limit T -> 0 of the
# draw, where logits / T would overflow float32.
GREEDY_BELOW = 1e-5
# The smallest repetition_penalty: a logit x / 1e-30 stays finite for any |x| < 3.4e8.
MIN_REPETITION_PENALTY = 1e-30


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """A request's constraint on its output (constrained decoding), as the request gave it;
    ``service.server.grammars`` compiles it.

    Attributes:
        kind: one of ``CONSTRAINT_KINDS``: ``json_schema`` (``text`` a JSON schema, as JSON),
            ``json_object`` (any JSON object; ``text`` empty), ``regex`` (the whole output
            matches it; Rust ``regex`` syntax), ``grammar`` (a Lark grammar in llguidance's
            dialect, or GBNF), ``choice`` (``text`` a JSON list of strings: the output is one).
        text: as above.
        field: the request field it came in, for messages (``response_format.json_schema``).
    """

    kind: str
    text: str
    field: str


CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


class InvalidRequest(ValueError):
    """A request field is malformed or out of range (gRPC INVALID_ARGUMENT, HTTP 400); the message
    starts with the field's name."""


@dataclasses.dataclass(frozen=True)
class ValidatedRequest:
    """A checked request with its defaults applied.

    Attributes:
        prompt_ids: the prompt's token ids (non-empty, each < vocab size).
        max_tokens: most ids to generate per sequence (>= 1; prompt + max_tokens <= max_seq_len).
        sampling: sampling parameters of sequence 0 (sequence i seeds with
            ``model.sampling.sequence_seed(sampling.seed, i)``).
        stop: stop strings.
        logprobs: None, or how many alternatives to return with each id's log-probability.
        n: independent sequences to generate (1..MAX_N).
        min_tokens: EOS and stop strings do not end a sequence before this many ids (<= max_tokens).
        ignore_eos: generate past EOS ids.
        prefix_cache: a paged KV cache may reuse cached pages of the prompt's prefix and keep
            this prompt's full pages for later requests (``Request.prefix_cache``).
        speculative: its sequences may propose draft ids where the server speculates
            (``Request.speculative``).
        constraint: the grammar every sequence's output follows, or None.
    """

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingOptions
    stop: tuple[str, ...]
    logprobs: int | None = None
    n: int = 1
    min_tokens: int = 0
    ignore_eos: bool = False
    prefix_cache: bool = True
    speculative: bool = True
    constraint: GrammarSpec | None = None


@dataclasses.dataclass(frozen=True)
class Params:
    """A request's sampling and stopping parameters as it gave them; None = unset (the default).

    ``names`` maps a field to the name the request used for it, for the messages (OpenAI's chat
    API says ``max_completion_tokens`` and ``top_logprobs`` where gRPC says ``max_tokens`` and
    ``logprobs``; "prompt" is the input's field: ``messages``, ``chat.messages``, ``token_ids``).
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    logprobs: int | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    prefix_cache: bool | None = None
    speculative: bool | None = None
    constraint: GrammarSpec | None = None
    names: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def name(self, field: str) -> str:
        return self.names.get(field, field)


def checked_token_ids(ids: Sequence[int], tokenizer: Tokenizer, field: str) -> list[int]:
    """``ids`` as a list, each checked to be in [0, vocab_size).

    Raises:
        InvalidRequest: an id is out of range (the message names ``field``).
    """
    ids = list(ids)
    bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise InvalidRequest(f"{field}: {len(bad)} id(s) outside [0, {tokenizer.vocab_size}), first {bad[0]}")
    return ids


def refuse_text_beyond(text_bytes: int, tokenizer: Tokenizer, max_seq_len: int, field: str) -> None:
    """Refuse, before tokenizing, a text of ``text_bytes`` UTF-8 bytes that cannot fit
    ``max_seq_len`` (``Tokenizer.tokens_at_least``): tokenizing megabytes blocks the server's
    event loop for seconds, only to refuse the prompt afterwards.

    Raises:
        InvalidRequest: the text is at least ``max_seq_len`` tokens whatever it says.
    """
    at_least = tokenizer.tokens_at_least(text_bytes)
    if at_least >= max_seq_len:
        raise InvalidRequest(
            f"{field}: {text_bytes} bytes of text are at least {at_least} tokens, which leaves no room to "
            f"generate within the max sequence length of {max_seq_len} tokens"
        )


def chat_prompt_ids(
    messages: Sequence[tuple[str, str] | dict[str, Any]],
    tokenizer: Tokenizer,
    field: str,
    max_seq_len: int | None = None,
    tools: list[dict[str, Any]] | None = None,
    roles: tuple[str, ...] = CHAT_ROLES,
) -> list[int]:
    """The ids of chat ``messages`` ((role, content) pairs, or message objects as chat templates
    take them: ``role``, ``content``, an assistant's ``tool_calls``, a tool's ``tool_call_id``)
    rendered with the model's chat template, with ``tools`` (OpenAI's tool objects; None: the
    template gets none) and an assistant turn opened for the answer.

    Raises:
        InvalidRequest: no message, a role that is not one of ``roles`` (the message names
            ``field``, e.g. ``chat.messages[1].role``), the chat template raised on the
            messages (or the model has none), or the contents alone are too long for
            ``max_seq_len`` (``refuse_text_beyond``; None: not checked here).
    """
    dicts = [m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages]
    if max_seq_len is not None:
        refuse_text_beyond(
            sum(len((m.get("content") or "").encode("utf-8", "surrogatepass")) for m in dicts),
            tokenizer, max_seq_len, field,
        )  # fmt: skip
    if not messages:
        raise InvalidRequest(f"{field}: at least one message is required")
    for i, m in enumerate(dicts):
        if m["role"] not in roles:
            raise InvalidRequest(f"{field}[{i}].role: {m['role']!r} is not one of {', '.join(roles)}")
    # A template that raises on the messages (``raise_exception``: roles that do not alternate,
    # a system message it does not take) and a model without one refuse the request: the client
    # can change it, and the error would otherwise escape as an internal error (gRPC UNKNOWN,
    # HTTP 500). A template that does not parse is the server's fault and stays one.
    try:
        rendered = tokenizer.apply_chat_template(
            dicts, add_generation_prompt=True, **({"tools": tools} if tools else {})
        )
    except NoChatTemplateError:
        raise InvalidRequest(
            f"{field}: this model has no chat template (a base model); send a plain prompt instead "
            "(OpenAI /v1/completions, or GenerateRequest.prompt)"
        ) from None
    except jinja2.TemplateSyntaxError:
        raise
    except (jinja2.TemplateError, ValueError) as exc:
        raise InvalidRequest(f"{field}: the model's chat template refused the messages: {exc}") from None
    return tokenizer.encode_chat(rendered)


def input_field(req: pb.GenerateRequest) -> str:
    """The field a ``GenerateRequest``'s prompt came in, as messages name it: ``prompt``,
    ``chat.messages`` or ``token_ids`` (``prompt`` when none is set)."""
    which = req.WhichOneof("input")
    return "chat.messages" if which == "chat" else which or "prompt"


def prompt_ids(req: pb.GenerateRequest, tokenizer: Tokenizer, max_seq_len: int | None = None) -> list[int]:
    """The prompt's token ids: raw text tokenized as is, chat rendered with the model's template,
    or token ids checked against the vocabulary. Text far beyond ``max_seq_len`` is refused
    before it is tokenized (``refuse_text_beyond``)."""
    which = req.WhichOneof("input")
    if which is None:
        raise InvalidRequest("input: one of prompt, chat or token_ids is required")
    if which == "prompt":
        if max_seq_len is not None:
            refuse_text_beyond(len(req.prompt.encode("utf-8")), tokenizer, max_seq_len, "prompt")
        ids = tokenizer.encode(req.prompt)
    elif which == "chat":
        messages = [(m.role, m.content) for m in req.chat.messages]
        ids = chat_prompt_ids(messages, tokenizer, input_field(req), max_seq_len)
    else:
        ids = checked_token_ids(req.token_ids.ids, tokenizer, "token_ids")
    if not ids:
        raise InvalidRequest(f"{which}: the prompt is empty (0 tokens)")
    return ids


def params_of(req: pb.GenerateRequest) -> Params:
    """The parameters a ``GenerateRequest`` sets (its unset optional fields are None)."""

    def get(field: str):  # type: ignore[no-untyped-def]
        return getattr(req, field) if req.HasField(field) else None

    return Params(
        max_tokens=get("max_tokens"),
        temperature=get("temperature"),
        top_p=get("top_p"),
        top_k=get("top_k"),
        seed=get("seed"),
        stop=tuple(req.stop),
        logprobs=get("logprobs"),
        n=get("n"),
        presence_penalty=get("presence_penalty"),
        frequency_penalty=get("frequency_penalty"),
        repetition_penalty=get("repetition_penalty"),
        min_p=get("min_p"),
        min_tokens=get("min_tokens"),
        ignore_eos=get("ignore_eos"),
        prefix_cache=get("prefix_cache"),
        speculative=get("speculative"),
        constraint=constraint_of(req),
        names={"prompt": input_field(req)},
    )


def constraint_of(req: pb.GenerateRequest) -> GrammarSpec | None:
    """The ``GenerateRequest.constraint`` as a ``GrammarSpec`` (None when unset).

    Raises:
        InvalidRequest: the message is set with no kind, or ``json_object`` is false.
    """
    if not req.HasField("constraint"):
        return None
    c = req.constraint
    kind = c.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest(f"constraint: set one of {', '.join(CONSTRAINT_KINDS)}")
    field = f"constraint.{kind}"
    if kind == "json_object":
        if not c.json_object:
            raise InvalidRequest(f"{field}: must be true (leave constraint unset for none)")
        return GrammarSpec("json_object", "", field)
    if kind == "choice":
        return GrammarSpec("choice", json.dumps(list(c.choice.values)), field)
    return GrammarSpec(kind, getattr(c, kind), field)


def validate(
    req: pb.GenerateRequest,
    tokenizer: Tokenizer,
    max_seq_len: int,
    default_max_tokens: int,
    max_queue: int | None = None,
) -> ValidatedRequest:
    """Check every field of a ``GenerateRequest`` and apply defaults (see ``validate_params``).

    Raises:
        InvalidRequest: naming the field, with the numbers involved.
    """
    ids = prompt_ids(req, tokenizer, max_seq_len)
    return validate_params(ids, params_of(req), max_seq_len, default_max_tokens, max_queue)


def _in_range(p: Params, field: str, value: float, lo: float, hi: float, what: str) -> float:
    if not (math.isfinite(value) and lo <= value <= hi):
        raise InvalidRequest(f"{p.name(field)}: must be {what}, got {value}")
    return float(value)


def validate_params(
    ids: list[int], p: Params, max_seq_len: int, default_max_tokens: int, max_queue: int | None = None
) -> ValidatedRequest:
    """Check the parameters of a request whose prompt is ``ids`` and apply defaults.

    Limits policy: the prompt must leave room for at least one token (prompt < max_seq_len);
    an explicit ``max_tokens`` with prompt + max_tokens > max_seq_len is rejected (never
    silently truncated); an unset ``max_tokens`` means min(default_max_tokens,
    max_seq_len - prompt). ``n`` is at most ``MAX_N`` and at most ``max_queue`` (the server's
    queue bound; None = no such bound).

    Raises:
        InvalidRequest: naming the field, with the numbers involved.
    """
    n = len(ids)
    if n >= max_seq_len:
        raise InvalidRequest(
            f"{p.name('prompt')}: {n} tokens leaves no room to generate within the max sequence length of {max_seq_len} tokens"
        )
    room = max_seq_len - n
    if p.max_tokens is not None:
        max_tokens = p.max_tokens
        if max_tokens <= 0:
            raise InvalidRequest(f"{p.name('max_tokens')}: must be >= 1 (leave it unset for the default)")
        if max_tokens > room:
            raise InvalidRequest(
                f"{p.name('max_tokens')}: prompt ({n} tokens) + {p.name('max_tokens')} ({max_tokens}) = "
                f"{n + max_tokens} exceeds the max sequence length of {max_seq_len} tokens"
            )
    else:
        max_tokens = min(default_max_tokens, room)

    temperature = p.temperature if p.temperature is not None else DEFAULT_TEMPERATURE
    if not math.isfinite(temperature) or not 0 <= temperature <= FLOAT32_MAX:
        raise InvalidRequest(
            f"{p.name('temperature')}: must be a finite number >= 0 and <= {FLOAT32_MAX:.4g} (float32), got {temperature}"
        )
    if temperature < GREEDY_BELOW:
        temperature = 0.0
    top_p = p.top_p if p.top_p is not None else DEFAULT_TOP_P
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise InvalidRequest(f"{p.name('top_p')}: must be in (0, 1], got {top_p}")
    top_k = p.top_k if p.top_k is not None else DEFAULT_TOP_K
    if top_k < 0:
        raise InvalidRequest(f"{p.name('top_k')}: must be >= 0 (0 disables it), got {top_k}")
    # The engine keeps top_k in an int32 slot array: a larger k (HTTP allows any integer) would
    # raise in the engine loop and kill the pool. Any k >= the vocabulary disables the filter, so
    # clamping changes no answer.
    top_k = min(top_k, INT32_MAX)
    if p.seed is None:
        seed = secrets.randbits(63)
    elif SEED_RANGE[0] <= p.seed < SEED_RANGE[1]:
        seed = p.seed & (2**64 - 1)
    else:
        raise InvalidRequest(f"{p.name('seed')}: must fit in 64 bits, got {p.seed}")
    if len(p.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"{p.name('stop')}: at most {MAX_STOP_STRINGS} stop strings, got {len(p.stop)}")
    for i, s in enumerate(p.stop):
        if not s:
            raise InvalidRequest(f"{p.name('stop')}[{i}]: stop strings must be non-empty")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"{p.name('stop')}[{i}]: at most {MAX_STOP_CHARS} characters per stop string, got {len(s)}"
            )
    logprobs = p.logprobs
    if logprobs is not None and not 0 <= logprobs <= TOP_LOGPROBS:
        raise InvalidRequest(
            f"{p.name('logprobs')}: alternatives per token must be in [0, {TOP_LOGPROBS}], got {logprobs}"
        )
    most = MAX_N if max_queue is None else min(MAX_N, max_queue)
    count = p.n if p.n is not None else 1
    if not 1 <= count <= most:
        bound = f"at most {MAX_N}" + (
            f" and at most the server's queue of {max_queue}" if max_queue is not None else ""
        )
        raise InvalidRequest(f"{p.name('n')}: must be in [1, {most}] ({bound}), got {count}")
    lo, hi = PENALTY_RANGE
    presence = 0.0
    if p.presence_penalty is not None:
        presence = _in_range(p, "presence_penalty", p.presence_penalty, lo, hi, f"in [{lo:g}, {hi:g}]")
    frequency = 0.0
    if p.frequency_penalty is not None:
        frequency = _in_range(p, "frequency_penalty", p.frequency_penalty, lo, hi, f"in [{lo:g}, {hi:g}]")
    repetition = 1.0
    if p.repetition_penalty is not None:
        repetition = p.repetition_penalty
        if not (math.isfinite(repetition) and MIN_REPETITION_PENALTY <= repetition <= FLOAT32_MAX):
            raise InvalidRequest(
                f"{p.name('repetition_penalty')}: must be a finite number in "
                f"[{MIN_REPETITION_PENALTY:g}, {FLOAT32_MAX:.4g}] (1 disables it), got {repetition}"
            )
        repetition = float(repetition)
    min_p = 0.0 if p.min_p is None else _in_range(p, "min_p", p.min_p, 0.0, 1.0, "in [0, 1]")
    min_tokens = p.min_tokens if p.min_tokens is not None else 0
    if min_tokens < 0:
        raise InvalidRequest(f"{p.name('min_tokens')}: must be >= 0, got {min_tokens}")
    if min_tokens > max_tokens:
        raise InvalidRequest(
            f"{p.name('min_tokens')}: must be <= {p.name('max_tokens')} ({max_tokens}), got {min_tokens}"
        )
    return ValidatedRequest(
        prompt_ids=ids,
        max_tokens=max_tokens,
        sampling=SamplingOptions(
            temperature=float(temperature),
            top_k=int(top_k),
            top_p=float(top_p),
            seed=seed,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            min_p=min_p,
        ),
        stop=tuple(p.stop),
        logprobs=logprobs,
        n=count,
        min_tokens=min_tokens,
        ignore_eos=bool(p.ignore_eos),
        prefix_cache=p.prefix_cache is not False,
        speculative=p.speculative is not False,
        constraint=p.constraint,
    )
