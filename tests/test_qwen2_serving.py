"""``serve --model qwen2.5-coder-0.5b-instruct``: the real Qwen2 file served end to end. gRPC's
model info names the family and how its tensors are held; an OpenAI chat request is rendered
with the file's ChatML template (its prompt tokens are exactly the template's tokens) and
streams the ids a direct greedy gRPC generate of the same tokens gives, ending at
``<|im_end|>`` or its length. Tool calls with the file's template: the model's own call
(``auto``), a forced one, streamed as whole, and the tool's result turn.

A module of its own, so the model loaded by ``test_qwen2_gguf.py`` is released before this
server loads it again.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import free_port

from model.text.tokenizer import Tokenizer
from model.weights.fetch import fetch_model
from protos.meshserve.v1 import meshserve_pb2 as pb
from service.engine.config import EngineConfig
from service.server.app import ServerThread
from service.server.client import Client
from service.server.config import ServerConfig

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Write a Python function that reverses a string."}]
N = 24


@pytest.fixture(scope="module")
def qwen_server() -> Iterator[Any]:
    cfg = ServerConfig(
        model="qwen2.5-coder-0.5b-instruct", port=0, metrics_port=0, http_port=free_port(),
        engine=EngineConfig(num_slots=2, max_seq_len=1024, chunk_size=128),
    )  # fmt: skip
    srv = ServerThread(cfg).start()
    yield srv
    srv.stop()


def test_a_chat_request_is_rendered_by_the_files_template_and_served_greedy(qwen_server: Any) -> None:
    tokenizer = Tokenizer.from_gguf(fetch_model("qwen2.5-coder-0.5b-instruct"))
    client = Client(qwen_server.address)
    try:
        info = client.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        assert (info.architecture, info.num_heads, info.num_kv_heads, info.vocab_size) == ("qwen2", 14, 2, 151936)
        assert not info.tie_word_embeddings and 151645 in info.eos_token_ids
        assert dict(info.weight_formats) == {  # every matmul weight as stored (docs/models.md)
            "wqkv": "q8_0", "wo": "q5_0", "w_gate_up": "q5_0", "w_down": "q6_k", "embed": "q5_0", "lm_head": "q8_0",
        }  # fmt: skip
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES))
        direct = client.generate(
            pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids), max_tokens=N, temperature=0.0), timeout_s=300
        )
    finally:
        client.close()
    body = json.dumps({"model": "default", "messages": MESSAGES, "max_tokens": N, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{qwen_server.cfg.http_port}/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        answer = json.loads(r.read())
    choice = answer["choices"][0]
    assert answer["usage"]["prompt_tokens"] == len(prompt_ids)
    assert choice["message"]["content"] == tokenizer.decode(list(direct.token_ids), skip_special_tokens=True)
    assert choice["finish_reason"] == ("stop" if len(direct.token_ids) < N else "length")
    assert "def " in choice["message"]["content"]  # the answer is Python, as asked


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "description": "Get the local time in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
}  # fmt: skip
PARIS = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_tool_calls_with_the_files_template(qwen_server: Any) -> None:
    import openai

    c = openai.OpenAI(
        base_url=f"http://127.0.0.1:{qwen_server.cfg.http_port}/v1", api_key="-", max_retries=0, timeout=600
    )
    tools = [WEATHER_TOOL, TIME_TOOL]
    for choice in ("auto", {"type": "function", "function": {"name": "get_weather"}}):
        kw: dict[str, Any] = dict(model="default", messages=PARIS, tools=tools, tool_choice=choice, temperature=0, max_tokens=100, parallel_tool_calls=False)  # fmt: skip
        whole = c.chat.completions.create(**kw).choices[0]
        calls = whole.message.tool_calls or []
        assert whole.finish_reason == "tool_calls" and [t.function.name for t in calls] == ["get_weather"], whole
        assert json.loads(calls[0].function.arguments)["city"] == "Paris"
        chunks = list(c.chat.completions.create(stream=True, **kw))
        deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
        assert [(d.function.name, d.function.arguments) for d in deltas] == [
            ("get_weather", calls[0].function.arguments)
        ]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    turn = [
        *PARIS,
        {"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps({"temperature_c": 21, "sky": "sunny"})},
    ]
    after = c.chat.completions.create(model="default", messages=turn, tools=tools, temperature=0, max_tokens=60)  # type: ignore[arg-type]
    tokenizer = Tokenizer.from_gguf(fetch_model("qwen2.5-coder-0.5b-instruct"))
    rendered = tokenizer.apply_chat_template(
        [PARIS[0], {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "get_weather", "arguments": json.loads(calls[0].function.arguments)}}]}, turn[2]],
        tools=tools,
    )  # fmt: skip
    assert after.usage is not None and after.usage.prompt_tokens == len(tokenizer.encode(rendered))
    assert "<tool_response>" in rendered and after.choices[0].finish_reason in ("stop", "tool_calls", "length")
