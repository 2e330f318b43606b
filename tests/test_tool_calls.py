"""Tool calls in ``/v1/chat/completions`` (service/server/tool_calls.py) through the official
``openai`` client: a tiny random-weight model whose chat template takes tools (``TOOLS_CHATML``)
for what a grammar guarantees (``tool_choice`` "required" or a named function: calls that parse
and validate, whatever the weights), streamed deltas joined against whole answers, the tool
message turn, and the refusals; the parser itself on texts cut at every size; the real
Qwen2.5-Coder's own calls are in tests/test_qwen2_serving.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from helpers import free_port, openai_client
from tiny_gguf import TOOLS_CHATML, write_tiny_llama_gguf

from model.text.tokenizer import Tokenizer
from service.engine.config import EngineConfig
from service.server.app import ServerThread
from service.server.config import ServerConfig
from service.server.tool_calls import ToolCallStream

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CLOCK = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["zone"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama_gguf(
        tmp_path_factory.mktemp("tools") / "tools.gguf", chat_template=TOOLS_CHATML, context_length=2048
    )


@pytest.fixture(scope="module")
def tools_server(tools_gguf: Path) -> Iterator[Any]:
    cfg = ServerConfig(
        model=str(tools_gguf), port=0, metrics_port=0, http_port=free_port(), max_queue=8,
        engine=EngineConfig(num_slots=4, max_seq_len=1280, chunk_size=256),
    )  # fmt: skip
    srv = ServerThread(cfg).start()
    yield srv
    srv.stop()


@pytest.fixture()
def client(tools_server: Any) -> Iterator[openai.OpenAI]:
    c = openai_client(tools_server, timeout=300)
    yield c
    c.close()


def chat(c: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 200)
    kw.setdefault("temperature", 0)
    return c.chat.completions.create(model="default", tools=TOOLS, **kw)


def joined_calls(chunks: list[Any]) -> list[tuple[str, str, str]]:
    """The streamed ``tool_calls`` deltas joined per index, as a client accumulates them."""
    calls: dict[int, list[str]] = {}
    for ch in chunks:
        for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            entry = calls.setdefault(d.index, [d.id or "", "", ""])
            entry[1] += d.function.name or ""
            entry[2] += d.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)]  # type: ignore[misc]


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "names"),
    [
        ("required", False, {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, False, {"get_time"}),
        ("required", True, {"get_weather", "get_time"}),
    ],
)
def test_forced_calls_parse_validate_and_stream_as_whole(
    client: openai.OpenAI, tool_choice: Any, parallel: bool, names: set[str]
) -> None:
    """Forced calls are grammar-constrained: on random weights, greedy and sampled, every call
    names an offered tool and its arguments validate; the streamed deltas join to the whole
    answer's calls exactly."""
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        whole = chat(client, tool_choice=tool_choice, parallel_tool_calls=parallel, **kw)
        choice = whole.choices[0]
        calls = choice.message.tool_calls or []
        if parallel and choice.finish_reason == "length":
            # Random weights may keep adding calls: max_tokens cuts the last, which is content.
            assert calls and (choice.message.content or "").lstrip().startswith("<tool_call>\n{"), choice
        else:
            assert choice.finish_reason == "tool_calls" and calls and choice.message.content is None, choice
        assert len(calls) == 1 or parallel
        for call in calls:
            assert call.type == "function" and call.function.name in names and call.id
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        chunks = list(chat(client, tool_choice=tool_choice, parallel_tool_calls=parallel, stream=True, **kw))
        joined = joined_calls(chunks)
        assert [(name, args) for _, name, args in joined] == [(c.function.name, c.function.arguments) for c in calls]
        assert all(call_id.startswith("call_") for call_id, _, _ in joined)  # another request: other ids
        assert chunks[-1].choices[0].finish_reason == choice.finish_reason
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert streamed == (choice.message.content or "")


def test_a_tool_result_turn_is_rendered_by_the_template(client: openai.OpenAI, tools_gguf: Path) -> None:
    first = chat(
        client, tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False
    )
    call = first.choices[0].message.tool_calls[0]
    turn = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    answer = chat(client, messages=turn, max_tokens=5)
    tokenizer = Tokenizer.from_gguf(tools_gguf)
    rendered = tokenizer.apply_chat_template(
        [turn[0], {**turn[1], "tool_calls": [{"function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]}, turn[2]],
        tools=TOOLS,
    )  # fmt: skip
    assert '<tool_response>\n{"temperature": 21}' in rendered and call.function.arguments in rendered
    assert answer.usage.prompt_tokens == len(tokenizer.encode(rendered))


def test_auto_parses_what_the_model_writes_streamed_as_whole(client: openai.OpenAI) -> None:
    """``auto`` leaves the model free (random weights write no call): its text comes back as
    content, streamed deltas joining to the whole answer, finish "length"."""
    whole = chat(client, tool_choice="auto", max_tokens=12)
    chunks = list(chat(client, tool_choice="auto", max_tokens=12, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "length" and not whole.choices[0].message.tool_calls


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        ({"tool_choice": "sometimes"}, "tool_choice", "must be"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name", "not one of"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", "a-z"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]", "function"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}], "tool_choice": "required"},
         "tool_choice", "does not compile"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "exclude"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}], "tools": None, "tool_choice": "required"},
         "tool_choice", "needs tools"),
    ],
)  # fmt: skip
def test_bad_tools_are_a_400_naming_the_field(client: openai.OpenAI, extra: dict, field: str, words: str) -> None:
    body: dict[str, Any] = {"model": "default", "messages": ASK, "tools": TOOLS, **extra}
    if body["tools"] is None:
        del body["tools"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**body)
    assert isinstance(err.value.body, dict) and err.value.body["param"] == field and words in err.value.body["message"]


def test_a_model_whose_template_takes_no_tools_says_so(tiny_server: Any) -> None:
    c = openai_client(tiny_server)
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="default", messages=ASK, tools=TOOLS)  # type: ignore[arg-type]
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "tools"
    assert "takes no tools" in err.value.body["message"]
    # tool_choice "none" offers none: the request is served as without tools.
    r = c.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=2)  # type: ignore[arg-type]
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Hello there", "Hello there", []),
        ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
         "Sure.", [("f", '{"a": 1}'), ("g", "{}")]),
        ('{"name": "f", "arguments": {"x": "é"}}', "", [("f", '{"x": "é"}')]),
        ('{"name": "f", "arguments": {}}\n{"name": "g", "arguments": {"b": [1]}}', "", [("f", "{}"), ("g", '{"b": [1]}')]),
        ('{"a": 1}', '{"a": 1}', []),
        ('x <tool_call>\n{"name": "h", "arguments": {}}\n</tool_call>', 'x <tool_call>\n{"name": "h", "arguments": {}}\n</tool_call>', []),
        ("a <tool_ca", "a <tool_ca", []),
        ('a <tool_call>{"name": "f"', 'a <tool_call>{"name": "f"', []),
    ],
)  # fmt: skip
def test_the_parser_gives_the_same_split_however_the_text_is_cut(text: str, content: str, calls: list) -> None:
    """Content and calls are the same whether the text arrives whole or a character at a time:
    streamed deltas join to the whole answer. A call names an offered tool ("h" is not one);
    an unmarked call is the whole answer's JSON; an unclosed call is content."""
    for size in (1, 2, 3, 7, len(text)):
        stream = ToolCallStream({"f", "g"}, "r")
        got, parsed = [], []
        for i in range(0, len(text), size):
            part, done = stream.push(text[i : i + size])
            got.append(part)
            parsed += done
        rest, done = stream.finish()
        got.append(rest)
        parsed += done
        assert ("".join(got), [(c.name, c.arguments) for c in parsed]) == (content, calls), size
        assert [c.id for c in parsed] == [f"call_r_{i}" for i in range(len(calls))]
