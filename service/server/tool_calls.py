"""Tool calls in the OpenAI chat API: the tools a request offers, the grammar that makes a call
valid by construction (``tool_choice`` ``required`` or a named function), and the parser that
splits a generated text into content and calls (``ToolCallStream``), the same for streamed and
whole answers.

The format is the one Qwen2.5's and Hermes' chat templates teach the model (and vLLM's
``hermes`` parser reads): each call a JSON object ``{"name": ..., "arguments": {...}}`` between
``<tool_call>`` and ``</tool_call>``, one per line. A model whose chat template takes no tools,
or teaches another format, answers ``tools`` with a 400 saying so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.meta

from model.text.tokenizer import Tokenizer
from service.server.validation import GrammarSpec, InvalidRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
# A call's JSON is written as ``structured outputs`` write JSON (service/server/grammars.py).
X_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclasses.dataclass(frozen=True)
class Tool:
    """One function a request offers: its name, and the JSON schema of its arguments."""

    name: str
    parameters: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: an id for the client, the function's name, its arguments as JSON text."""

    id: str
    name: str
    arguments: str

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry (with ``index`` in a streamed delta)."""
        out: dict[str, Any] = {} if index is None else {"index": index}
        out.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        return out


def parse_tools(tools: Sequence[Any]) -> list[Tool]:
    """The request's ``tools``, checked.

    Raises:
        InvalidRequest: a tool that is not ``{"type": "function", "function": {"name", ...}}``,
            a name OpenAI would refuse, the same name twice, or ``parameters`` not an object.
    """
    out: list[Tool] = []
    for i, tool in enumerate(tools):
        field = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequest(f'{field}: must be {{"type": "function", "function": {{"name": ...}}}}')
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidRequest(f"{field}.function.name: 1 to 64 of a-z, A-Z, 0-9, _ and -, got {name!r}")
        if any(t.name == name for t in out):
            raise InvalidRequest(f"{field}.function.name: {name!r} is given twice")
        parameters = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise InvalidRequest(f"{field}.function.parameters: must be a JSON schema (an object)")
        out.append(Tool(name, parameters))
    return out


def tools_problem(tokenizer: Tokenizer) -> str | None:
    """Why the model cannot take tools in the format parsed here (no chat template, a template
    that never reads ``tools``, or one that does not teach ``<tool_call>`` calls), or None."""
    source = tokenizer.chat_template or ""
    takes_tools = bool(source) and "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(source))
    if not takes_tools:
        return "this model's chat template takes no tools (the model was not trained to call them)"
    if OPEN not in source:
        return f"this model's chat template teaches a tool-call format other than {OPEN}...{CLOSE}, the one meshserve parses"
    return None


def call_grammar(tools: Sequence[Tool], tokenizer: Tokenizer, parallel: bool) -> GrammarSpec:
    """The constraint of ``tool_choice`` ``required`` (any of ``tools``) or a named function
    (``tools`` that one alone): one call, or with ``parallel`` one or more on their own lines,
    each ``{"name": <a tool's name>, "arguments": <valid against its parameters>}`` between the
    call markers (the template's special tokens where it has them), in llguidance's Lark with
    each body a ``%json`` schema."""
    bodies = []
    for tool in tools:
        schema = {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": X_GUIDANCE,
        }
        bodies.append(f"%json {json.dumps(schema)}")
    rules = [f'call: {_marker(OPEN, tokenizer)} "\\n" body "\\n" {_marker(CLOSE, tokenizer)}']
    rules += [f"body: {' | '.join(f'body{i}' for i in range(len(bodies)))}"]
    rules += [f"body{i}: {b}" for i, b in enumerate(bodies)]
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return GrammarSpec("grammar", "\n".join([start, *rules]), "tool_choice")


def _marker(text: str, tokenizer: Tokenizer) -> str:
    """A call marker in the grammar: its token by id where the vocabulary holds it as one token
    (Qwen2.5's are added tokens, which llguidance matches by id only), else its text."""
    ids = tokenizer.encode(text)
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(text)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as chat templates take them: an assistant's ``tool_calls`` arguments as
    objects, not JSON text (Qwen2.5's template writes ``arguments | tojson``; vLLM converts
    alike)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_with_object_arguments(c) for c in calls]}
        out.append(m)
    return out


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function", {})
    args = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(json.JSONDecodeError):  # else rendered as the text it is
            args = json.loads(args)
    return {**call, "function": {**fn, "arguments": args}}


class ToolCallStream:
    """Splits one choice's generated text, pushed delta by delta, into content and tool calls.

    Text outside ``<tool_call>``...``</tool_call>`` is content, passed on as it comes, except what
    could still be the start of a call marker (held back, as a stop string's start is) and
    whitespace (held until more text follows: the whitespace before a call, or after the last,
    is dropped). A call is held until its closing marker, then parsed: a JSON object with a
    ``name`` (of an offered tool) and ``arguments`` (an object) becomes a ``ToolCall`` whose
    arguments are that object's JSON; anything else is given back as content, markers
    included. ``finish`` ends the text: a call still open is content.

    An answer that begins with ``{`` is held whole: small models (Qwen2.5-Coder-0.5B) write
    their call's JSON without the markers, and at the end an answer that is such an object, or
    one per line, is taken as those calls (else it is content, as written).

    Args:
        names: the offered tools' names.
        request_id: the request's id, in the calls' ids (``call_<request>_<n>``).
    """

    def __init__(self, names: set[str], request_id: str):
        self._names = names
        self._prefix = f"call_{request_id}_" if request_id else f"call_{uuid.uuid4().hex[:12]}_"
        self._held = ""
        self._in_call = False
        self._released = False  # some content was passed on
        self._gap = ""  # the whitespace dropped before the open call
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content that ``text`` releases, and the calls it completes."""
        self._held += text
        if not self._in_call and not self._released and not self.calls and self._held.lstrip().startswith("{"):
            return "", []  # perhaps a call without its markers: held to the end
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_call:
                end = self._held.find(CLOSE)
                if end < 0:
                    break
                body, self._held = self._held[:end], self._held[end + len(CLOSE) :]
                self._in_call = False
                call = self._parse(body, len(calls))
                if call is None:
                    content.append(self._gap + OPEN + body + CLOSE)
                else:
                    calls.append(call)
                continue
            start = self._held.find(OPEN)
            if start >= 0:
                before, self._held = self._held[:start], self._held[start + len(OPEN) :]
                kept = before.rstrip() if not self.calls and not calls else before.strip()
                # The whitespace dropped before the call, given back should the call not parse.
                self._gap = before[len(before.rstrip()) :] if kept or not (self.calls or calls) else before
                content.append(kept)
                self._in_call = True
                continue
            keep = _held_back(self._held)
            release, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
            if (self.calls or calls) and not release.strip():
                self._held = release + self._held  # whitespace between or after calls waits
                release = ""
            content.append(release)
            break
        self.calls.extend(calls)
        out = "".join(content)
        self._released = self._released or bool(out)
        return out, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content still held when the text ends (an unclosed call's text among it), and the
        calls of an answer that is unmarked calls' JSON."""
        held, self._held = self._held, ""
        if self._in_call:
            self._in_call = False
            return self._gap + OPEN + held, []
        if not self._released and not self.calls and held.lstrip().startswith("{"):
            calls = self._unmarked(held)
            if calls:
                self.calls.extend(calls)
                return "", calls
        return ("" if self.calls and not held.strip() else held), []

    def _unmarked(self, text: str) -> list[ToolCall]:
        """The calls of ``text`` if it is one call's JSON object or one per line, else none."""
        whole = self._parse(text.strip())
        if whole is not None:
            return [whole]
        calls: list[ToolCall] = []
        for line in (line.strip() for line in text.splitlines()):
            call = self._parse(line, len(calls)) if line else None
            if line and call is None:
                return []
            if call is not None:
                calls.append(call)
        return calls

    def _parse(self, body: str, pending: int = 0) -> ToolCall | None:
        """``body`` as a call (numbered after ``pending`` calls not yet recorded), or None."""
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self._names:
            return None
        args = value.get("arguments", {})
        if not isinstance(args, dict):
            return None
        number = len(self.calls) + pending
        return ToolCall(f"{self._prefix}{number}", value["name"], json.dumps(args, ensure_ascii=False))


def _held_back(text: str) -> int:
    """How many characters at the end of ``text`` wait: the longest end that could begin the call
    marker, and the whitespace before it (or at the end)."""
    keep = next((n for n in range(min(len(OPEN) - 1, len(text)), 0, -1) if OPEN.startswith(text[-n:])), 0)
    rest = text[: len(text) - keep]
    return keep + len(rest) - len(rest.rstrip())
