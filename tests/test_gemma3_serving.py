"""``serve --model gemma-3-270m``: the real Gemma 3 file (a base model, no chat template) served
end to end. gRPC's model info names the family, its heads and its end-of-generation ids; a chat
request is a clear INVALID_ARGUMENT / HTTP 400 naming what to send instead; a plain prompt over
OpenAI's /v1/completions (BOS prepended, as the file asks) streams the ids of a direct greedy
gRPC generate of the same tokens, and the server keeps serving after the refusals.

A module of its own, so the model loaded by ``test_gemma3_gguf.py`` is released before this
server loads it again.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
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
PROMPT = "The capital of France is Paris. The capital of Germany is"
N = 16


@pytest.fixture(scope="module")
def gemma_server() -> Iterator[Any]:
    cfg = ServerConfig(
        model="gemma-3-270m", port=0, metrics_port=0, http_port=free_port(),
        engine=EngineConfig(num_slots=2, max_seq_len=256, chunk_size=128),
    )  # fmt: skip
    srv = ServerThread(cfg).start()
    yield srv
    srv.stop()


def post(server: Any, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.cfg.http_port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_chat_is_refused_and_a_prompt_is_served_greedy(gemma_server: Any) -> None:
    tokenizer = Tokenizer.from_gguf(fetch_model("gemma-3-270m"))
    client = Client(gemma_server.address)
    try:
        info = client.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        assert (info.architecture, info.num_heads, info.num_kv_heads, info.vocab_size) == ("gemma3", 4, 1, 262144)
        assert info.tie_word_embeddings and {1, 106} <= set(info.eos_token_ids)  # <eos>, <end_of_turn>
        assert dict(info.weight_formats) == {  # every matmul weight as stored (docs/models.md)
            "wqkv": "q8_0", "wo": "q4_k", "w_gate_up": "q5_0", "w_down": "q6_k", "embed": "q8_0",
        }  # fmt: skip
        chat = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")]), max_tokens=4)
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(chat, timeout_s=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "no chat template" in refused.value.details()
        prompt_ids = tokenizer.encode(PROMPT)
        assert prompt_ids[0] == 2  # <bos>: the file asks for it
        direct = client.generate(
            pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids), max_tokens=N, temperature=0.0), timeout_s=300
        )
    finally:
        client.close()
    status, body = post(gemma_server, "/v1/chat/completions", {"model": "default", "max_tokens": 4,
                                                               "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert status == 400 and "no chat template" in body["error"]["message"]
    status, answer = post(gemma_server, "/v1/completions", {"model": "default", "prompt": PROMPT, "max_tokens": N,
                                                             "temperature": 0})  # fmt: skip
    assert status == 200
    choice = answer["choices"][0]
    assert answer["usage"]["prompt_tokens"] == len(prompt_ids)
    assert choice["text"] == tokenizer.decode(list(direct.token_ids), skip_special_tokens=True)
    assert "Berlin" in choice["text"]  # the base model continues the pattern
