"""OpenAI's request bodies (pydantic models), their mapping onto the validated request, and the
response bodies built from the engine's chunks, for ``service/server/http_api.py``.

What is served and what is refused (docs/api.md has the table):

* Parameters with OpenAI's names and defaults: ``max_tokens`` (completions: 16, OpenAI's default;
  chat: the server's ``--default-max-tokens``), ``max_completion_tokens`` (chat), ``temperature``
  (1), ``top_p`` (1), ``n`` (1), ``stop`` (a string or a list), ``seed``, ``logprobs`` and
  ``top_logprobs`` (chat) or ``logprobs`` as a count (completions), ``presence_penalty`` and
  ``frequency_penalty`` (0), ``user`` (accepted, not used), ``stream``,
  ``stream_options.include_usage``; vLLM's extras ``top_k`` (-1 or 0: off), ``min_p``,
  ``repetition_penalty``, ``min_tokens``, ``ignore_eos``; ours, ``prefix_cache`` and
  ``speculative`` (gRPC's fields: false opts out of the prefix cache, of speculative decoding);
  a completions ``prompt`` as token ids. ``usage.completion_tokens_details``
  ``accepted_prediction_tokens`` and ``rejected_prediction_tokens`` count the draft ids
  speculative decoding verified (OpenAI's names for its predicted outputs).
* Structured outputs (``constraint``): ``response_format`` ``{"type": "json_object"}`` and
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (``strict`` or not,
  the schema is enforced), and vLLM's ``structured_outputs`` with one of ``json`` (a schema),
  ``json_object`` (true), ``regex``, ``grammar`` (Lark or GBNF) and ``choice``; on both
  endpoints. vLLM's older ``guided_*`` fields are refused, naming their new place.
* Fields a body has that are not listed here are ignored, as OpenAI's servers do.
* Tool calls (chat; ``service.server.tool_calls``): ``tools``, ``tool_choice`` ("auto", "none",
  "required", a named function: the last two constrained by a grammar of the call),
  ``parallel_tool_calls``, ``tool`` messages and an assistant's ``tool_calls``, rendered by the
  model's chat template; the answer's calls parsed into ``message.tool_calls``.
* Fields that would change the answer and are not built are refused with a 400 naming the field:
  ``functions`` and ``function_call`` (other than "none"; the deprecated names), ``tools`` for a
  template that takes none, ``structured_outputs`` keys other than the five above,
  ``logit_bias``, ``audio``, ``modalities`` other than ``["text"]``, chat role ``function``,
  content parts other than text; for completions ``echo``, ``suffix``, ``best_of`` other than
  ``n``, and a list of several prompts.

Every ``InvalidRequest`` message starts with the field's name as the body spelled it
(``messages[2].content[0].type``); ``service/server/http_api.py``'s ``error_body`` puts that name
in the error's ``param``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from model.text.tokenizer import Tokenizer
from service.engine.request import Chunk, FinishReason, TokenLogprob
from service.server.tool_calls import (
    Tool,
    ToolCall,
    ToolCallStream,
    call_grammar,
    parse_tools,
    template_messages,
    tools_problem,
)
from service.server.validation import (
    CHAT_ROLES,
    GrammarSpec,
    InvalidRequest,
    Params,
    ValidatedRequest,
    chat_prompt_ids,
    checked_token_ids,
    refuse_text_beyond,
    validate_params,
)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
# OpenAI's "developer" role is its newer name for "system" (templates know only the older one).
ROLE_ALIASES = {"developer": "system"}
FINISH_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP_STRING: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",  # vLLM's name; a client that went away never sees it
    # Ours (docs/api.md): the constraint's grammar allows no next token, so the text is not a
    # whole sentence of it; "stop" would tell a client it is.
    FinishReason.GRAMMAR_DEAD_END: "grammar_dead_end",
}
STRUCTURED_OUTPUTS = {
    "json": "json_schema",
    "json_object": "json_object",
    "regex": "regex",
    "grammar": "grammar",
    "choice": "choice",
}
# vLLM's names before ``structured_outputs`` (refused: silently unconstrained output would parse as nothing)
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar", "guided_json_object": "json_object"}  # fmt: skip


# ---- request bodies ---------------------------------------------------------------------------------
class _Body(BaseModel):
    # Unknown fields are ignored, as OpenAI's servers do. Types are strict, as OpenAI's are:
    # pydantic's lax mode would take "n": "3", "stream": "yes", "max_tokens": true and the token
    # ids [true, 2] as 3, True, 1 and [1, 2] (an int is still a valid float).
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = None


class _Common(_Body):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    prefix_cache: bool | None = None  # ours: false opts out of the prefix cache
    speculative: bool | None = None  # ours: false opts out of speculative decoding
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's
    guided_json: Any = None  # vLLM's older names, refused (``GUIDED``)
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_json_object: Any = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.include_usage)


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Common):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None


class CompletionRequest(_Common):
    """The body of ``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


# ---- mapping onto the validated request ----------------------------------------------------------------
def _refuse(field: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{field}: {why}")


def _encode_within(tokenizer: Tokenizer, text: str, max_seq_len: int) -> list[int]:
    """``text``'s ids, refused untokenized where it is far beyond ``max_seq_len``."""
    refuse_text_beyond(len(text.encode("utf-8")), tokenizer, max_seq_len, "prompt")
    return tokenizer.encode(text)


def _text(field: str, text: str) -> str:
    """``text``, refused when it holds a lone surrogate: JSON's ``"\\ud800"`` escape decodes to
    one, and the tokenizer raises TypeError on it (a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _refuse(field, f"not valid Unicode: a lone surrogate at character {exc.start}") from None
    return text


def _check_common(body: _Common) -> None:
    if body.logit_bias:
        raise _refuse("logit_bias", "not supported (the engine has no logit bias); remove the field")
    if body.stream_options is not None and not body.stream:
        raise _refuse("stream_options", "only allowed with stream: true")


def constraint(body: _Common) -> GrammarSpec | None:
    """The body's structured-output constraint: ``response_format`` (OpenAI's) or
    ``structured_outputs`` (vLLM's), None when neither constrains the output.

    Raises:
        InvalidRequest: both given, an unknown type or key, a value of the wrong type, or one
            of vLLM's older ``guided_*`` fields.
    """
    for old, new in GUIDED.items():
        if getattr(body, old) is not None:
            raise _refuse(old, f"vLLM's older name: send structured_outputs.{new} instead")
    spec = None
    rf = body.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            spec = GrammarSpec("json_object", "", "response_format")
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise _refuse("response_format.json_schema", "an object with the schema is required")
            schema = js.get("schema", {"type": "object"})  # OpenAI's schema is optional
            if not isinstance(schema, dict):
                raise _refuse("response_format.json_schema.schema", f"must be an object, got {type(schema).__name__}")
            if not isinstance(js.get("strict", False), bool | None):
                raise _refuse("response_format.json_schema.strict", "must be a boolean")
            spec = GrammarSpec("json_schema", json.dumps(schema), "response_format.json_schema.schema")
        elif kind != "text":
            raise _refuse("response_format.type", f"must be one of text, json_object, json_schema, got {kind!r}")
    so = body.structured_outputs
    if so is not None:
        if spec is not None:
            raise _refuse("structured_outputs", "give one of response_format and structured_outputs")
        given = {k: v for k, v in so.items() if v is not None and v is not False}
        unknown = sorted(set(given) - set(STRUCTURED_OUTPUTS))
        if unknown:
            raise _refuse(
                f"structured_outputs.{unknown[0]}", f"not supported; give one of {', '.join(STRUCTURED_OUTPUTS)}"
            )
        if len(given) != 1:
            raise _refuse(
                "structured_outputs", f"give exactly one of {', '.join(STRUCTURED_OUTPUTS)}, got {len(given)}"
            )
        ((key, value),) = given.items()
        field = f"structured_outputs.{key}"
        if key == "json":
            if isinstance(value, str):  # vLLM takes the schema as JSON text too
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise _refuse(field, f"not valid JSON: {exc}") from None
            if not isinstance(value, dict):
                raise _refuse(field, f"must be a JSON schema (an object), got {type(value).__name__}")
            spec = GrammarSpec("json_schema", json.dumps(value), field)
        elif key == "json_object":
            if value is not True:
                raise _refuse(field, "must be true")
            spec = GrammarSpec("json_object", "", field)
        elif key == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise _refuse(field, "must be a non-empty list of non-empty strings")
            spec = GrammarSpec("choice", json.dumps(value), field)
        else:
            if not isinstance(value, str) or not value:
                raise _refuse(field, "must be a non-empty string")
            spec = GrammarSpec(STRUCTURED_OUTPUTS[key], value, field)
    return spec


def _params(body: _Common, max_tokens: int | None, logprobs: int | None, names: dict[str, str]) -> Params:
    stop: Sequence[str] = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    top_k = 0 if body.top_k == -1 else body.top_k  # vLLM's "off"
    return Params(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=top_k,
        seed=body.seed,
        stop=tuple(stop),
        logprobs=logprobs,
        n=body.n,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        min_p=body.min_p,
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
        prefix_cache=body.prefix_cache,
        speculative=body.speculative,
        constraint=constraint(body),
        names=names,
    )


def _message_text(i: int, m: ChatMessage) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return _text(f"messages[{i}].content", m.content)
    texts = []
    for j, part in enumerate(m.content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise _refuse(
                f"messages[{i}].content[{j}].type", f"only text parts are supported, got {part.get('type')!r}"
            )
        texts.append(_text(f"messages[{i}].content[{j}].text", part["text"]))
    return "\n".join(texts)  # as vLLM joins a message's text parts


def chat_request(
    body: ChatCompletionRequest, tokenizer: Tokenizer, max_seq_len: int, default_max_tokens: int, max_queue: int
) -> ValidatedRequest:
    """Check a chat body and map it onto the engine's parameters (its messages rendered with the
    model's chat template).

    Raises:
        InvalidRequest: a bad or refused field (the message starts with its name).
    """
    _check_common(body)
    if body.functions:
        raise _refuse("functions", "deprecated: send tools instead")
    if body.function_call is not None and body.function_call != "none":
        raise _refuse("function_call", "deprecated: send tool_choice instead")
    if body.audio is not None:
        raise _refuse("audio", "audio output is not supported")
    if body.modalities is not None and body.modalities != ["text"]:
        raise _refuse("modalities", f"only ['text'] is supported, got {body.modalities!r}")
    tools, choice = offered_tools(body, tokenizer)
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(body.messages):
        if m.role == "function":
            raise _refuse(f"messages[{i}].role", "'function' messages are deprecated: send 'tool' messages")
        message: dict[str, Any] = {"role": ROLE_ALIASES.get(m.role, m.role), "content": _message_text(i, m)}
        if (m.role == "tool" or m.tool_calls) and (problem := tools_problem(tokenizer)) is not None:
            raise _refuse(f"messages[{i}].{'role' if m.role == 'tool' else 'tool_calls'}", problem)
        if m.tool_calls:
            if m.role != "assistant":
                raise _refuse(f"messages[{i}].tool_calls", "only an assistant message has tool calls")
            message["tool_calls"] = _checked_calls(i, m.tool_calls)
        if m.role == "tool":
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    ids = chat_prompt_ids(
        template_messages(messages), tokenizer, "messages", max_seq_len,
        tools=body.tools if tools else None, roles=(*CHAT_ROLES, "tool"),
    )  # fmt: skip
    if not ids:
        raise InvalidRequest("messages: the prompt is empty (0 tokens)")
    names = {"prompt": "messages"}
    max_tokens = body.max_completion_tokens
    if max_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
        if body.max_tokens is not None and body.max_tokens != max_tokens:
            raise _refuse(
                "max_completion_tokens",
                f"{max_tokens} differs from max_tokens ({body.max_tokens}, its deprecated name); give one",
            )
    else:
        max_tokens = body.max_tokens
    logprobs = None
    if body.logprobs:
        logprobs = body.top_logprobs if body.top_logprobs is not None else 0
        names["logprobs"] = "top_logprobs"
    elif body.top_logprobs is not None:
        raise _refuse("top_logprobs", "requires logprobs: true")
    params = _params(body, max_tokens, logprobs, names)
    if choice is not None:  # "required" or a named function: the call is constrained
        if params.constraint is not None:
            raise _refuse(
                "tool_choice", f"a forced tool call and {params.constraint.field.split('.')[0]} exclude each other"
            )
        chosen = tools if choice == "required" else [t for t in tools if t.name == choice]
        params = dataclasses.replace(
            params, constraint=call_grammar(chosen, tokenizer, parallel=body.parallel_tool_calls is not False)
        )
    return validate_params(ids, params, max_seq_len, default_max_tokens, max_queue)


def offered_tools(body: ChatCompletionRequest, tokenizer: Tokenizer) -> tuple[list[Tool], str | None]:
    """The tools the model is offered (none when ``tool_choice`` is "none"), and the call that
    ``tool_choice`` forces: None ("auto", "none"), "required", or a function's name.

    Raises:
        InvalidRequest: a bad tool (``parse_tools``), a ``tool_choice`` that is none of OpenAI's
            forms, names no offered tool or comes without tools, or tools for a model whose
            template takes none (``tools_problem``).
    """
    choice = body.tool_choice
    tools = parse_tools(body.tools or [])
    if not tools and choice not in (None, "none"):
        raise _refuse("tool_choice", f"{choice!r} needs tools (as OpenAI's API)")
    forced: str | None = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise _refuse(
                "tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
            )
        if name not in {t.name for t in tools}:
            raise _refuse("tool_choice.function.name", f"{name!r} is not one of the tools given")
        forced = name
    elif choice == "required":
        forced = "required"
    elif choice not in (None, "none", "auto"):
        raise _refuse("tool_choice", f'must be "none", "auto", "required" or a function, got {choice!r}')
    if choice == "none" or not tools:
        return [], None
    problem = tools_problem(tokenizer)
    if problem is not None:
        raise _refuse("tools", problem)
    return tools, forced


def tool_names(body: ChatCompletionRequest) -> set[str] | None:
    """The names of the tools whose calls the answer is parsed for (None: no tools offered, or
    ``tool_choice`` "none", or tools ``chat_request`` refuses: such a body is answered with its
    400 before any answer is parsed)."""
    if not body.tools or body.tool_choice == "none":
        return None
    try:
        return {t.name for t in parse_tools(body.tools)}
    except InvalidRequest:
        return None


def _checked_calls(i: int, calls: list[Any]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, checked to be OpenAI's shape."""
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments", ""), str)
        ):
            raise _refuse(
                f"messages[{i}].tool_calls[{j}]",
                'must be {"id", "type": "function", "function": {"name", "arguments": <JSON text>}}',
            )
    return list(calls)


def completion_request(
    body: CompletionRequest, tokenizer: Tokenizer, max_seq_len: int, max_queue: int
) -> ValidatedRequest:
    """Check a completions body and map it onto the engine's parameters. ``prompt`` is text
    (tokenized as is), token ids, or a list holding one of either; ``max_tokens`` defaults to 16.

    Raises:
        InvalidRequest: a bad or refused field (the message starts with its name).
    """
    _check_common(body)
    if body.echo:
        raise _refuse("echo", "not supported (the answer would include the prompt); remove the field")
    if body.suffix:
        raise _refuse("suffix", "not supported (no insertion); remove the field")
    if body.best_of is not None and body.best_of != (body.n if body.n is not None else 1):
        raise _refuse("best_of", f"only best_of = n is supported, got {body.best_of}")
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise _refuse("prompt", f"a list of {len(prompt)} prompts is not supported; send one request per prompt")
        prompt = prompt[0]
    ids = (
        _encode_within(tokenizer, _text("prompt", prompt), max_seq_len)
        if isinstance(prompt, str)
        else checked_token_ids(prompt, tokenizer, "prompt")
    )
    if not ids:
        raise InvalidRequest("prompt: the prompt is empty (0 tokens)")
    return validate_params(
        ids, _params(body, body.max_tokens, body.logprobs, {}), max_seq_len, COMPLETIONS_DEFAULT_MAX_TOKENS, max_queue
    )


# ---- response bodies -------------------------------------------------------------------------------------
# Compact JSON as every body is sent (an encoder built once: json.dumps builds one per call when
# given options). Its output holds no raw CR or LF, so one SSE event is "data: <json>\n\n".
json_compact = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def sse_event(data: Any) -> bytes:
    """One server-sent event whose ``data`` is ``data`` as compact JSON (or a raw string)."""
    return f"data: {data if isinstance(data, str) else json_compact(data)}\n\n".encode()


def token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, bytes]:
    """A token's string and bytes for logprobs: its bytes decoded as UTF-8, with bytes that are
    part of a character split across tokens written as ``\\xNN`` escapes."""
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="backslashreplace"), raw


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, accepted: int = 0, rejected: int = 0
) -> dict[str, Any]:
    """OpenAI's usage: the prompt counted once, the completion summed over the n sequences;
    ``prompt_tokens_details.cached_tokens``: the prompt's tokens the prefix cache served (not
    prefilled) for the first sequence; ``completion_tokens_details``: the draft ids speculative
    decoding verified, kept (``accepted``) and not (``rejected``), summed over the sequences."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": rejected},
    }


class _Choice:
    """What one sequence has produced so far."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.drafts = (0, 0)  # draft ids verified for it: (accepted, rejected)
        self.started = False  # a streamed chat choice's first delta carries the role
        self.offsets: list[int] = []  # completions' text_offset of each token in logprobs (non-streamed)
        self.chars = 0  # characters of text so far (completions logprobs only): the next chunk's offset
        self.tools: ToolCallStream | None = None  # the parser of its tool calls, when tools are offered


class Responses:
    """Builds one request's OpenAI response bodies from its ``(index, Chunk)`` stream.

    ``add`` collects chunks for a non-streamed answer (``completion``); ``event`` turns one chunk
    into a streamed chunk body. Logprobs are in OpenAI's shapes: chat
    ``logprobs.content[].{token, logprob, bytes, top_logprobs}``, completions
    ``logprobs.{tokens, token_logprobs, top_logprobs, text_offset}`` (``top_logprobs`` holds the
    sampled token too, as OpenAI's do: up to logprobs + 1 entries; a token's offset is the
    characters of the completion's text before its chunk, so it indexes the returned text; a
    token that ends inside a character has the offset where that character starts).

    Args:
        chat: chat completions (else text completions).
        request_id: the response ids are ``chatcmpl-<id>`` / ``cmpl-<id>``.
        model: the model id answered in every body.
        n: sequences.
        prompt_tokens: the prompt's length in tokens.
        logprobs: whether the request asked for log-probabilities.
        tokenizer: for the token strings of logprobs.
        tools: the names of the tools offered (chat; None: none): each choice's text is split
            into content and ``tool_calls`` (``ToolCallStream``), streamed or whole alike, and a
            choice that called a tool ends with ``finish_reason`` "tool_calls".
    """

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        n: int,
        prompt_tokens: int,
        logprobs: bool,
        tokenizer: Tokenizer,
        tools: set[str] | None = None,
    ):
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0  # sequence 0's, from its last chunk
        self.want_logprobs = logprobs
        self.tokenizer = tokenizer
        self.choices = [_Choice() for _ in range(n)]
        self.with_tools = tools is not None
        if tools is not None:
            for i, choice in enumerate(self.choices):
                choice.tools = ToolCallStream(tools, f"{request_id}_{i}")
        self._event_prefix: str | None = None  # event_bytes' text up to a choice's index

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _chat_logprobs(self, records: Sequence[TokenLogprob]) -> dict[str, Any]:
        content = []
        for lp in records:
            text, raw = token_text(self.tokenizer, lp.token_id)
            top = []
            for token_id, value in lp.top:
                t, b = token_text(self.tokenizer, token_id)
                top.append({"token": t, "logprob": value, "bytes": list(b)})
            content.append({"token": text, "logprob": lp.logprob, "bytes": list(raw), "top_logprobs": top})
        return {"content": content}

    def _completion_logprobs(self, records: Sequence[TokenLogprob], offsets: Sequence[int]) -> dict[str, Any]:
        tokens, values, tops = [], [], []
        for lp in records:
            text, _ = token_text(self.tokenizer, lp.token_id)
            tokens.append(text)
            values.append(lp.logprob)
            top = {token_text(self.tokenizer, t)[0]: v for t, v in lp.top}
            top.setdefault(text, lp.logprob)  # "always the logprob of the sampled token" (OpenAI)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": list(offsets)}

    def _split(self, choice: _Choice, chunk: Chunk) -> tuple[str, list[ToolCall]]:
        """The chunk's content text and the tool calls it completes (its text as is, no calls,
        without tools)."""
        if choice.tools is None:
            return chunk.text, []
        text, calls = choice.tools.push(chunk.text)
        if chunk.finish_reason is not None:
            rest, more = choice.tools.finish()
            text, calls = text + rest, calls + more
        return text, calls

    def _record(self, index: int, chunk: Chunk) -> _Choice:
        choice = self.choices[index]
        if chunk.finish_reason is not None:
            choice.finish_reason = FINISH_REASONS[chunk.finish_reason]
            ended = chunk.finish_reason in (FinishReason.EOS, FinishReason.STOP_STRING)
            if ended and choice.tools is not None and choice.tools.calls:
                choice.finish_reason = "tool_calls"
            choice.completion_tokens = chunk.completion_tokens
            choice.drafts = (chunk.accepted_draft_tokens, chunk.rejected_draft_tokens)
            if index == 0:
                self.cached_tokens = chunk.cached_tokens
        return choice

    @staticmethod
    def _offsets(choice: _Choice, chunk: Chunk) -> list[int]:
        """The completions ``text_offset`` of ``chunk``'s tokens (each at the characters of text
        before the chunk), counting the chunk's text in. Called for every chunk of a choice whose
        request asked for completions logprobs, and only then."""
        offsets = [choice.chars] * len(chunk.logprobs)
        choice.chars += len(chunk.text)
        return offsets

    def add(self, index: int, chunk: Chunk) -> None:
        """Collect one chunk of sequence ``index`` for :meth:`completion`."""
        text, _ = self._split(self.choices[index], chunk)
        choice = self._record(index, chunk)
        choice.text.append(text)
        choice.logprobs.extend(chunk.logprobs)
        if self.want_logprobs and not self.chat:
            choice.offsets.extend(self._offsets(choice, chunk))

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    def usage(self) -> dict[str, Any]:
        accepted = sum(c.drafts[0] for c in self.choices)
        rejected = sum(c.drafts[1] for c in self.choices)
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens, accepted, rejected)

    def completion(self) -> dict[str, Any]:
        """The non-streamed response body, once every sequence has finished."""
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            if self.chat:
                lps = self._chat_logprobs(c.logprobs) if self.want_logprobs else None
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if c.tools is not None and c.tools.calls:
                    message.update(content=text or None, tool_calls=[call.openai() for call in c.tools.calls])
                choices.append(
                    {
                        "index": i,
                        "message": message,
                        "logprobs": lps,
                        "finish_reason": c.finish_reason,
                    }
                )
            else:
                lps = self._completion_logprobs(c.logprobs, c.offsets) if self.want_logprobs else None
                choices.append({"index": i, "text": text, "logprobs": lps, "finish_reason": c.finish_reason})
        return {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": choices,
            "usage": self.usage(),
        }

    def event(self, index: int, chunk: Chunk, include_usage: bool) -> dict[str, Any]:
        """The streamed chunk body for one chunk of sequence ``index``: one choice, its text delta
        (possibly empty: one event per generated token), its logprobs, and on its last chunk its
        finish_reason. With ``include_usage`` every chunk has ``"usage": null``, as OpenAI sends
        them before the final usage chunk (:meth:`usage_event`)."""
        choice = self.choices[index]
        done = len(choice.tools.calls) if choice.tools is not None else 0
        text, calls = self._split(choice, chunk)
        self._record(index, chunk)
        body: dict[str, Any]
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if calls:  # each call whole in one delta: its arguments are those of the whole answer
                delta["tool_calls"] = [call.openai(done + k) for k, call in enumerate(calls)]
            if not choice.started:
                delta = {"role": "assistant", **delta}
                choice.started = True
            lps = self._chat_logprobs(chunk.logprobs) if self.want_logprobs else None
            body = {
                **self._head("chat.completion.chunk"),
                "choices": [{"index": index, "delta": delta, "logprobs": lps, "finish_reason": choice.finish_reason}],
            }
        else:
            lps = (
                self._completion_logprobs(chunk.logprobs, self._offsets(choice, chunk)) if self.want_logprobs else None
            )
            body = {
                **self._head("text_completion"),
                "choices": [
                    {"index": index, "text": chunk.text, "logprobs": lps, "finish_reason": choice.finish_reason}
                ],
            }
        if include_usage:
            body["usage"] = None
        return body

    def event_bytes(self, index: int, chunk: Chunk, include_usage: bool) -> bytes:
        """:meth:`event` framed as one server-sent event, ``sse_event(self.event(...))`` byte for
        byte. Without logprobs (a streamed chunk's usual shape) it is written from a prefix built
        once per request and the JSON of the text alone, not a dict encoded whole for every
        token."""
        if self.want_logprobs or self.with_tools:
            return sse_event(self.event(index, chunk, include_usage))
        if self._event_prefix is None:
            obj = "chat.completion.chunk" if self.chat else "text_completion"
            self._event_prefix = "data: " + json_compact(self._head(obj))[:-1] + ',"choices":[{"index":'
        choice = self._record(index, chunk)
        finish = "null" if choice.finish_reason is None else f'"{choice.finish_reason}"'
        text = json_compact(chunk.text)
        if self.chat:
            role = ""
            if not choice.started:
                role = '"role":"assistant",'
                choice.started = True
            body = f'{index},"delta":{{{role}"content":{text}}},"logprobs":null,"finish_reason":{finish}}}]'
        else:
            body = f'{index},"text":{text},"logprobs":null,"finish_reason":{finish}}}]'
        usage = ',"usage":null}\n\n' if include_usage else "}\n\n"
        return (self._event_prefix + body + usage).encode()

    def usage_event(self) -> dict[str, Any]:
        """The last streamed chunk with ``stream_options.include_usage``: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage()}
