"""The OpenAI-compatible HTTP API (service/server/http_api.py, service/server/openai_api.py) through the
official ``openai`` client and raw HTTP.

Fast tests use the tiny session server (2 slots x 128 tokens, queue of 4, random weights: its
answers are gibberish, their shapes and counts are not) and servers of their own on the tiny
model; the ``slow`` ones use the real SmolLM2 session ``server`` (its HTTP port beside gRPC), with
short generations: the CPU decodes 10-20 tokens/s."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.sse import format_sse_event
from helpers import free_port, full_queue, get, held_port, openai_client, post, scrape, value, wait_for

from model.sampling import sequence_seed
from model.text.tokenizer import Tokenizer
from service.engine.config import EngineConfig
from service.engine.request import Chunk, FinishReason, TokenLogprob
from service.engine.scheduler import StepPlan
from service.server import app
from service.server.app import PortInUse, ServerThread, start_server
from service.server.client import Client, make_request
from service.server.config import ServerConfig
from service.server.gateway import Gateway
from service.server.http_api import bind
from service.server.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    Responses,
    chat_request,
    completion_request,
    sse_event,
)
from service.server.validation import InvalidRequest

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 120.0
HI = [{"role": "user", "content": "hi"}]


def api(srv: Any, **kwargs: Any) -> openai.OpenAI:
    """The official client on ``srv``'s HTTP port (``helpers.openai_client``)."""
    return openai_client(srv, **{"timeout": TIMEOUT_S, **kwargs})  # type: ignore[no-any-return]


def sse_data(text: str) -> list[str]:
    """The ``data`` of each event of an SSE body (each event here is one ``data:`` line)."""
    events = [e for e in text.replace("\r\n", "\n").split("\n\n") if e.strip()]
    out = []
    for e in events:
        lines = e.split("\n")
        assert len(lines) == 1 and lines[0].startswith("data: "), e
        out.append(lines[0][len("data: ") :])
    return out


@pytest.fixture()
def client(tiny_server) -> Iterator[openai.OpenAI]:  # type: ignore[no-untyped-def]
    c = api(tiny_server)
    yield c
    c.close()


@pytest.fixture()
def grpc_client(tiny_server) -> Iterator[Client]:  # type: ignore[no-untyped-def]
    c = Client(tiny_server.address)
    yield c
    c.close()


# ---- endpoints and shapes (tiny server) ---------------------------------------------------------


def test_models_lists_the_default_pool_under_the_model_name(tiny_server, client: openai.OpenAI) -> None:  # type: ignore[no-untyped-def]
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]  # the GGUF's stem, as GetModelInfo.name
    assert models[0].owned_by == "meshserve" and models[0].object == "model"
    assert models[0].model_extra is not None and models[0].model_extra["max_model_len"] == 128
    status, body = get(tiny_server.running.http_port, "/v1/models")
    assert status == 200 and json.loads(body)["object"] == "list"
    # OpenAI's "retrieve model", by id or by the pool's or layout's name; an unknown one is 404.
    assert client.models.retrieve("tiny") == models[0]
    assert client.models.retrieve("default") == client.models.retrieve("single") == models[0]
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert err.value.code == "model_not_found" and "models: tiny" in err.value.message


def test_health_and_metrics_on_the_http_port(tiny_server) -> None:  # type: ignore[no-untyped-def]
    port = tiny_server.running.http_port
    assert get(port, "/health") == (200, '{"status":"SERVING"}')
    samples = scrape(port)  # the same registry as --metrics-port
    assert value(samples, "meshserve_num_slots", pool="default") == 2
    assert value(samples, "meshserve_serving") == 1
    assert {name for name, _ in samples} == {name for name, _ in scrape(tiny_server.running.metrics_port)}


def test_chat_answer_shape_and_usage_counts(client: openai.OpenAI, tiny_tokenizer: Tokenizer) -> None:
    r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=6, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    rendered = tiny_tokenizer.apply_chat_template(HI, add_generation_prompt=True)
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(tiny_tokenizer.encode(rendered))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 1 <= r.usage.completion_tokens <= 6
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 6


def test_streamed_chat_equals_the_answer_and_ends_with_done(tiny_server, client: openai.OpenAI) -> None:  # type: ignore[no-untyped-def]
    whole = client.chat.completions.create(model="tiny", messages=HI, max_tokens=8, temperature=0)
    stream = client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()  # type: ignore[union-attr]
    deltas = [c.choices[0].delta for c in chunks[:-1]]
    assert deltas[0].role == "assistant" and all(d.role is None for d in deltas[1:])
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks[:-1])
    # One event per generated token: the finish event carries the last token, or none (EOS).
    assert len(deltas) - (whole.choices[0].finish_reason == "stop") == whole.usage.completion_tokens  # type: ignore[union-attr]
    # On the wire: one data line per event, JSON, then [DONE].
    body = {"model": "tiny", "messages": HI, "max_tokens": 3, "temperature": 0, "stream": True}
    status, text = post(tiny_server.running.http_port, "/v1/chat/completions", body)
    data = sse_data(text)
    assert status == 200 and data[-1] == "[DONE]"
    assert all(json.loads(d)["object"] == "chat.completion.chunk" for d in data[:-1])


def test_completions_match_grpc_with_token_id_prompts_and_logprobs(
    client: openai.OpenAI, grpc_client: Client, tiny_tokenizer: Tokenizer
) -> None:
    prompt = [5, 17, 42, 99]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, logprobs=3)
    ids, records, offsets, chars = [], [], [], 0
    for resp in grpc_client.stream(make_request(token_ids=prompt, max_tokens=5, temperature=0.0, logprobs=3), 60):
        ids.extend(resp.token_ids)
        records.extend(resp.logprobs)
        offsets += [chars] * len(resp.logprobs)  # each token at the text before its chunk
        chars += len(resp.text)
    choice = r.choices[0]
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert choice.text == tiny_tokenizer.decode(ids)
    assert r.usage is not None and r.usage.prompt_tokens == 4 and r.usage.completion_tokens == len(ids)
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert lp.tokens == [tiny_tokenizer.token_bytes(i).decode("utf-8", "backslashreplace") for i in ids]
    assert lp.token_logprobs == [rec.logprob for rec in records]  # float32 values, exactly
    for top, rec in zip(lp.top_logprobs, records, strict=True):
        assert list(top.values()) == [t.logprob for t in rec.top][: len(top)] and 1 <= len(top) <= 3
    assert lp.text_offset == offsets  # indexes into choice.text
    # A one-element list of token-id lists is the same prompt.
    again = client.completions.create(model="tiny", prompt=[prompt], max_tokens=5, temperature=0)
    assert again.choices[0].text == choice.text


def test_completions_top_logprobs_hold_the_sampled_token_and_offsets_index_the_text(client: openai.OpenAI) -> None:
    """As OpenAI's: "the API will always return the logprob of the sampled token, so there may be
    up to logprobs+1 elements"; a draw at temperature 100 picks ids outside the tiny model's top one."""
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=12, temperature=100.0, seed=5, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.top_logprobs and lp.token_logprobs and lp.text_offset is not None
    outside = 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == logprob and 1 <= len(top) <= 2
        outside += len(top) == 2
    assert outside > 0, (lp.tokens, lp.top_logprobs)  # some draws were not the most likely id
    zero = client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=0, logprobs=0)
    zlp = zero.choices[0].logprobs
    assert zlp is not None and zlp.tokens and zlp.token_logprobs and zlp.top_logprobs
    assert zlp.top_logprobs == [{t: v} for t, v in zip(zlp.tokens, zlp.token_logprobs, strict=True)]
    text, offsets = r.choices[0].text, lp.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and all(o <= len(text) for o in offsets)


def test_the_prefix_cache_opt_out_over_http_and_grpc(tiny_server, client: openai.OpenAI, grpc_client: Client) -> None:  # type: ignore[no-untyped-def]
    """``prefix_cache: false`` (HTTP's extra field, gRPC's optional bool) neither reads nor fills
    the prefix cache: a prompt sent twice that way is prefilled whole both times, and the same
    prompt sent afterwards finds nothing cached; by default it is then reused. The answers agree."""
    port = tiny_server.running.metrics_port
    page = tiny_server.running.gateway.pools[0].loop.runner.ecfg.page_size
    prompt = [(7 * i + 3) % 250 + 4 for i in range(3 * page + 5)]  # in no other test: 3 full pages

    def hits() -> float:
        return value(scrape(port), "meshserve_prefix_cache_hit_tokens_total", pool="default")

    def queried() -> float:
        return value(scrape(port), "meshserve_prefix_cache_queried_tokens_total", pool="default")

    def http(**extra: Any) -> str:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, extra_body=extra)
        return r.choices[0].text

    def grpc_ids(**extra: Any) -> list[int]:
        return grpc_client.generate(
            make_request(token_ids=prompt, max_tokens=3, temperature=0.0, **extra), 60
        ).token_ids

    start_hits, start_queried = hits(), queried()
    texts = [http(prefix_cache=False), http(prefix_cache=False)]
    ids = [grpc_ids(prefix_cache=False)]
    assert hits() == start_hits and queried() == start_queried  # not even looked up
    ids.append(grpc_ids())  # nothing was kept by the opted-out requests: a miss that fills the cache
    assert wait_for(lambda: queried() > start_queried)
    assert hits() == start_hits
    texts.append(http())
    assert wait_for(lambda: hits() >= start_hits + 3 * page)
    assert texts[0] == texts[1] == texts[2] and ids[0] == ids[1]


def test_chat_logprobs_shape(client: openai.OpenAI, tiny_tokenizer: Tokenizer) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    for item in content:
        assert item.bytes is not None and bytes(item.bytes).decode("utf-8", "backslashreplace") == item.token
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == item.top_logprobs[0].logprob  # greedy: the most likely id
    plain = client.chat.completions.create(model="tiny", messages=HI, max_tokens=4, temperature=0, logprobs=True)
    assert all(item.top_logprobs == [] for item in plain.choices[0].logprobs.content)  # type: ignore[union-attr]


def test_n_sequences_have_their_own_seeds_over_http_and_grpc(client: openai.OpenAI, grpc_client: Client) -> None:
    kwargs: dict[str, Any] = dict(model="tiny", prompt=[7, 8, 9], max_tokens=6, temperature=3.0, seed=11)
    three = client.completions.create(n=3, **kwargs)
    again = client.completions.create(n=3, **kwargs)
    one = client.completions.create(n=1, **kwargs)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.text for c in three.choices] == [c.text for c in again.choices]  # reproducible
    assert three.choices[0].text == one.choices[0].text  # sequence 0 uses the seed itself
    assert three.usage is not None and three.usage.prompt_tokens == 3  # the prompt counted once
    assert 3 <= three.usage.completion_tokens <= 18
    # gRPC: every chunk says its sequence; each sequence ends once; sequence i's ids are those of
    # an n = 1 request seeded with sequence_seed(seed, i).
    req = make_request(token_ids=[7, 8, 9], max_tokens=6, temperature=3.0, seed=11, n=3)
    finished: list[int] = []
    for resp in grpc_client.stream(req, 60):
        if resp.finish_reason:
            finished.append(resp.index)
    assert sorted(finished) == [0, 1, 2]
    runs = grpc_client.generate_all(req, 60)
    assert [r.completion_tokens for r in runs] == [len(r.token_ids) for r in runs]
    assert all(r.finish_reason != "FINISH_REASON_UNSPECIFIED" for r in runs)
    for i in (0, 1, 2):
        solo = grpc_client.generate(
            make_request(token_ids=[7, 8, 9], max_tokens=6, temperature=3.0, seed=sequence_seed(11, i)), 60
        )
        assert solo.token_ids == runs[i].token_ids
    with pytest.raises(ValueError, match="use generate_all"):
        grpc_client.generate(req)


def test_streamed_n_interleaves_choices_by_index(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=4, n=2, seed=3, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    texts = {0: "", 1: ""}
    finishes = {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert set(finishes) == {0, 1}
    whole = client.chat.completions.create(model="tiny", messages=HI, max_tokens=4, n=2, seed=3)
    assert [c.message.content for c in whole.choices] == [texts[0], texts[1]]
    assert usage is not None and whole.usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_unknown_fields_are_ignored(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi", "name": "ann"}],
        max_tokens=2,
        user="someone",
        store=False,
        metadata={"k": "v"},
        response_format={"type": "text"},
        tool_choice="none",
        extra_body={"frobnicate": 3, "top_k": -1, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True},
    )
    assert r.usage is not None and r.usage.completion_tokens >= 1


# ---- errors (tiny server) ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 500}, "max_completion_tokens"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"stop": [""]}, "stop[0]"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"temperature": "warm"}, "temperature"),
        ({"messages": [{"role": "robot", "content": "beep"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
    ],
)
def test_bad_chat_fields_are_400_naming_the_field(tiny_server, client: openai.OpenAI, extra: dict, field: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as info:  # extra_body: sent as given, past the client's types
        client.chat.completions.create(model="tiny", messages=HI, extra_body=extra)
    err = info.value
    assert err.status_code == 400
    assert isinstance(err.body, dict) and err.body["param"] == field and err.body["message"].startswith(field)
    assert err.body["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"response_format": {"type": "json_xml"}}, "response_format.type"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].type",
        ),
    ],
)
def test_unsupported_chat_fields_are_refused(client: openai.OpenAI, extra: dict, field: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=HI, extra_body=extra)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == field


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"echo": True}, "echo"),
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": [1, 10**6]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 200}, "max_tokens"),
    ],
)
def test_bad_or_unsupported_completion_fields_are_refused(client: openai.OpenAI, extra: dict, field: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hi", extra_body=extra)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == field


def test_unknown_model_is_404_and_rejections_are_counted(tiny_server, client: openai.OpenAI) -> None:  # type: ignore[no-untyped-def]
    port = tiny_server.running.http_port
    before = scrape(port)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=HI)
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "model_not_found"
    assert (
        "'gpt-4o' is not served; models: tiny (or a pool or layout name: default, single)" in info.value.body["message"]
    )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=HI, temperature=-1)
    after = scrape(port)
    for code, pool in (("not_found", ""), ("invalid_argument", "default")):
        name = "meshserve_requests_rejected_total"
        assert value(after, name, pool=pool, code=code) == value(before, name, pool=pool, code=code) + 1
    # The pool's own name and its layout's name select it too, as gRPC's layout field does.
    for model in ("default", "single"):
        assert client.completions.create(model=model, prompt="hi", max_tokens=1).model == "tiny"


def test_malformed_json_and_unknown_paths(tiny_server) -> None:  # type: ignore[no-untyped-def]
    port = tiny_server.running.http_port
    status, text = post(port, "/v1/chat/completions", b"{not json")
    assert status == 400 and json.loads(text)["error"]["type"] == "invalid_request_error"
    status, text = post(port, "/v1/chat/completions", {"model": "tiny"})
    assert status == 400 and json.loads(text)["error"]["param"] == "messages"
    status, text = get(port, "/v1/embeddings")
    assert status == 404 and json.loads(text)["error"]["message"] == "Not Found"
    status, text = get(port, "/v1/completions")
    assert status == 405 and json.loads(text)["error"]["code"] == "method_not_allowed"


def test_a_body_over_the_limit_is_413_before_it_is_read_whole(tiny_server) -> None:  # type: ignore[no-untyped-def]
    """A body over 1 MiB + 1 KiB per token of the length limit is refused in OpenAI's shape, by its
    Content-Length at once or by the bytes received when it is chunked; one just under it that
    parses is served (its padding is in a field the server ignores)."""
    import http.client

    from service.server.http_api import max_body_bytes

    port = tiny_server.running.http_port
    most = max_body_bytes(128)  # the tiny server's length limit
    assert tiny_server.running.http.max_body_bytes == most

    def counted() -> float:
        samples = scrape(tiny_server.running.metrics_port)
        return value(samples, "meshserve_requests_rejected_total", pool="", code="invalid_argument")

    before = counted()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:  # the head and 10 bytes of the body
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {most + 1}\r\n\r\n".encode() + b"x" * 10
        )
        reply = sock.makefile("rb")
        head = [line.decode().strip() for line in iter(reply.readline, b"\r\n")]
        length = next(int(h.split(":")[1]) for h in head if h.lower().startswith("content-length:"))
        text = reply.read(length).decode()
    status = int(head[0].split()[1])
    err = json.loads(text)["error"]
    assert status == 413 and (err["param"], err["code"], err["type"]) == (
        "body",
        "request_too_large",
        "invalid_request_error",
    )
    assert err["message"].startswith(f"body: {most + 1} bytes, more than the {most} this server takes")

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    chunks = [b"y" * 65536] * (most // 65536) + [b"y" * 1000]  # no Content-Length: sent chunked
    conn.request(
        "POST", "/v1/completions", body=iter(chunks), headers={"Content-Type": "application/json"}, encode_chunked=True
    )
    resp = conn.getresponse()
    err = json.loads(resp.read())["error"]
    conn.close()
    assert resp.status == 413 and err["code"] == "request_too_large", err
    assert err["message"].startswith("body: at least ") and f"more than the {most} this server takes" in err["message"]
    assert counted() == before + 2
    # Any path gets the 413 and its connection closes, but only completion requests count.
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: {most + 1}\r\n\r\n".encode())
        head = sock.makefile("rb").readline()
        assert head.split()[1] == b"413", head
    assert counted() == before + 2

    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 2, "user": "u" * (most - 200)}
    status, text = post(port, "/v1/completions", body)
    assert status == 200 and len(json.dumps(body)) <= most, text[:300]


def test_bodies_fastapi_does_not_parse_name_the_body(tiny_server) -> None:  # type: ignore[no-untyped-def]
    """Bytes that are not UTF-8 JSON, and JSON sent without a JSON content type (curl's -d sends
    a form type), are 400s naming ``body`` and what to send (they were "There was an error
    parsing the body" with no param, and "Input should be a valid dictionary")."""
    port = tiny_server.running.http_port
    url = f"http://127.0.0.1:{port}/v1/completions"
    for data, kind, says in (
        (b"\x1f\x8b\x08garbage", "application/json", "body: There was an error parsing the body (it must be UTF-8 JSON)"),
        (b'{"prompt": "hi", "max_tokens": 1}', "application/x-www-form-urlencoded",
         "body: send it as JSON with Content-Type: application/json (got 'application/x-www-form-urlencoded')"),
    ):  # fmt: skip
        req = urllib.request.Request(url, data=data, headers={"Content-Type": kind}, method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
        err = json.loads(info.value.read())["error"]
        assert info.value.code == 400 and (err["message"], err["param"]) == (says, "body"), err


def test_a_full_queue_is_429(tiny_server, client: openai.OpenAI, grpc_client: Client) -> None:  # type: ignore[no-untyped-def]
    with full_queue(tiny_server.running.gateway.pools[0].loop, grpc_client):
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model="tiny", messages=HI, max_tokens=2)
        assert info.value.status_code == 429
        assert isinstance(info.value.body, dict) and info.value.body["code"] == "queue_full"
        assert info.value.body["message"] == "queue full: 4 requests waiting (max 4)"
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="tiny", prompt="hi", max_tokens=2, stream=True)


def test_n_larger_than_the_room_left_in_the_queue_is_429(tiny_server, client: openai.OpenAI) -> None:  # type: ignore[no-untyped-def]
    loop = tiny_server.running.gateway.pools[0].loop
    entered, release = threading.Event(), threading.Event()

    def hold(plan: StepPlan) -> None:
        entered.set()
        release.wait(60)

    loop.step_hook = hold
    try:
        with ThreadPoolExecutor(2) as pool:
            # A queue of 4: the step that prefills the first request's first sequence holds the
            # loop, so its other 3 wait (in the loop's queue or still in its inbox: both count)
            # and 1 place is left. The server submits all 4 before it reads the next request.
            first = pool.submit(client.completions.create, model="tiny", prompt="a", max_tokens=2, n=4)
            assert entered.wait(30)
            assert loop.queue_full() is None
            with pytest.raises(openai.RateLimitError) as info:
                client.completions.create(model="tiny", prompt="b", max_tokens=2, n=3)
            assert "no room for all 3 sequences" in info.value.message
            release.set()
            assert len(first.result(60).choices) == 4
    finally:
        loop.step_hook = None
        release.set()
    assert wait_for(lambda: loop.scheduler.active_slots == 0 and loop.scheduler.queue_depth == 0, 10)


# ---- disconnects free the slots (tiny server) ------------------------------------------------------


def test_a_client_that_closes_the_stream_frees_its_slot(tiny_server, client: openai.OpenAI) -> None:  # type: ignore[no-untyped-def]
    port = tiny_server.running.http_port
    loop = tiny_server.running.gateway.pools[0].loop
    cancelled = value(scrape(port), "meshserve_requests_total", pool="default", finish_reason="cancelled")
    loop.step_hook = lambda plan: time.sleep(0.05)  # about 20 steps a second: the stream outlives the close
    try:
        stream = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=100, n=2, stream=True)
        next(iter(stream))
        assert wait_for(lambda: value(scrape(port), "meshserve_active_slots", pool="default") == 2, 10)
        stream.close()
        assert wait_for(lambda: value(scrape(port), "meshserve_active_slots", pool="default") == 0, 10)
    finally:
        loop.step_hook = None
    assert wait_for(
        lambda: (
            value(scrape(port), "meshserve_requests_total", pool="default", finish_reason="cancelled") == cancelled + 2
        )
    )
    assert not any(tiny_server.running.gateway.inflight.values())


def test_a_client_that_gives_up_on_a_whole_answer_frees_its_slot(tiny_server) -> None:  # type: ignore[no-untyped-def]
    port = tiny_server.running.http_port
    loop = tiny_server.running.gateway.pools[0].loop
    loop.step_hook = lambda plan: time.sleep(0.05)  # 100 tokens: about 5 s
    impatient = api(tiny_server, timeout=1.0)
    try:
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=100)
        assert wait_for(lambda: value(scrape(port), "meshserve_active_slots", pool="default") == 0, 10)
        assert loop.scheduler.queue_depth == 0
    finally:
        loop.step_hook = None
        impatient.close()


# ---- mapping onto the engine's parameters (no server) ----------------------------------------------


def test_chat_fields_map_onto_the_validated_request(tiny_tokenizer: Tokenizer) -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_completion_tokens": 9, "temperature": 0.5, "top_p": 0.9, "n": 2, "stop": "x", "seed": -1,
            "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.2, "min_p": 0.05,
            "top_k": -1, "min_tokens": 3, "ignore_eos": True, "logprobs": True, "top_logprobs": 4,
        }
    )  # fmt: skip
    v = chat_request(body, tiny_tokenizer, max_seq_len=128, default_max_tokens=50, max_queue=4)
    rendered = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "a\nb"}], add_generation_prompt=True)
    assert v.prompt_ids == tiny_tokenizer.encode(rendered)
    assert (v.max_tokens, v.n, v.stop, v.logprobs, v.min_tokens, v.ignore_eos) == (9, 2, ("x",), 4, 3, True)
    s = v.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.5, 0.9, 0, 2**64 - 1)  # -1 wraps mod 2**64
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p) == (0.5, -0.25, 1.2, 0.05)
    unset = chat_request(ChatCompletionRequest(messages=HI), tiny_tokenizer, 128, 50, 4)  # type: ignore[arg-type]
    assert (unset.max_tokens, unset.n, unset.logprobs, unset.min_tokens, unset.ignore_eos) == (50, 1, None, 0, False)
    assert (unset.sampling.temperature, unset.sampling.repetition_penalty) == (1.0, 1.0)
    with pytest.raises(InvalidRequest, match=r"^n: must be in \[1, 4\] \(at most 16 and at most the server's queue"):
        chat_request(ChatCompletionRequest(messages=HI, n=5), tiny_tokenizer, 128, 50, 4)  # type: ignore[arg-type]


def test_completions_default_to_16_tokens_as_openai(tiny_tokenizer: Tokenizer) -> None:
    v = completion_request(CompletionRequest(prompt="hello"), tiny_tokenizer, 128, 4)
    assert v.max_tokens == 16 and v.prompt_ids == tiny_tokenizer.encode("hello")
    assert completion_request(CompletionRequest(prompt=["hello"]), tiny_tokenizer, 128, 4).prompt_ids == v.prompt_ids
    near_the_end = completion_request(CompletionRequest(prompt=[1] * 120), tiny_tokenizer, 128, 4)
    assert near_the_end.max_tokens == 8  # the room left


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])
def test_streamed_event_bytes_are_the_event_as_compact_json(
    tiny_tokenizer: Tokenizer, chat: bool, include_usage: bool, logprobs: bool
) -> None:
    """``Responses.event_bytes`` (a prefix built once, the text's JSON per token) writes what
    FastAPI's SSE encoder wrote of ``Responses.event``'s dict, byte for byte: n = 2 interleaved,
    the chat role on each choice's first delta only, text that JSON escapes or keeps as UTF-8,
    every finish reason."""
    texts = ["", " plain", 'q"uote\\', "tab\tnew\nline\r", "\x00\x1f\x7f", "é中😀", "\u2028\u2029\x85", "</script>"]
    finishes = [FinishReason.EOS, FinishReason.STOP_STRING, FinishReason.LENGTH, FinishReason.CANCELLED]
    chunks: list[tuple[int, Chunk]] = []
    for i, text in enumerate(texts):
        lps = [TokenLogprob(token_id=5 + i, logprob=-0.25 * i, top=((5 + i, -0.25 * i), (7, -3.5)))]
        chunks.append((i % 2, Chunk(text=text, token_ids=[5 + i], logprobs=lps if logprobs else [])))
    for i, reason in enumerate(finishes[:2]):
        chunks.append((i, Chunk(text="end", token_ids=[9], finish_reason=reason, completion_tokens=5)))
    for reason in finishes[2:]:  # the other reasons, on fresh answers
        chunks.append((0, Chunk(text="", token_ids=[], finish_reason=reason, completion_tokens=1)))

    def responses() -> Responses:
        r = Responses(chat, 'id"é', "m\\odel", 2, 3, logprobs, tiny_tokenizer)
        r.created = 1_700_000_000
        return r

    fast, reference = responses(), responses()
    for index, chunk in chunks:
        want = format_sse_event(
            data_str=json.dumps(reference.event(index, chunk, include_usage), separators=(",", ":"), ensure_ascii=False)
        )
        got = fast.event_bytes(index, chunk, include_usage)
        assert got == want
        assert json.loads(got.decode().removeprefix("data: ")) == json.loads(want.decode().removeprefix("data: "))
    assert [c.started for c in fast.choices] == [c.started for c in reference.choices]
    assert fast.completion_tokens == reference.completion_tokens
    assert sse_event("[DONE]") == b"data: [DONE]\n\n"


# ---- servers of their own: loading, a dead engine, ports, signals ----------------------------------


def test_503_while_loading_and_after_the_engine_dies(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loading = threading.Event()
    original = app.load

    def held_load(gateway: Gateway, job: object = None) -> int:
        loading.wait(60)
        return original(gateway, job)

    monkeypatch.setattr(app, "load", held_load)
    http_port = free_port()
    srv = ServerThread(
        ServerConfig(
            model=str(tiny_gguf), port=0, metrics_port=0, http_port=http_port, watchdog_interval_s=0.1,
            engine=EngineConfig(num_slots=2, max_seq_len=128, chunk_size=32),
        )
    )  # fmt: skip
    starter = threading.Thread(target=srv.start, daemon=True)
    starter.start()
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x", max_retries=0, timeout=30)
    try:
        assert wait_for(lambda: _answers(http_port), 30)
        assert get(http_port, "/health") == (503, '{"status":"NOT_SERVING"}')
        for call in (
            lambda: c.chat.completions.create(model="tiny", messages=HI),
            lambda: c.completions.create(model="tiny", prompt="hi", stream=True),
            lambda: c.models.list(),
        ):
            with pytest.raises(openai.InternalServerError) as info:
                call()
            assert info.value.status_code == 503
            assert isinstance(info.value.body, dict) and info.value.body["message"] == "the model is still loading"
        loading.set()
        starter.join(120)
        assert srv.running is not None and get(http_port, "/health")[0] == 200

        # The engine loop dies mid-stream: the stream ends with an error event, then every
        # request is 503 and /health follows within a few watchdog intervals.
        loop = srv.running.gateway.pools[0].loop
        armed = threading.Event()

        def hook(plan: StepPlan) -> None:
            if armed.is_set():
                raise RuntimeError("injected engine failure")

        loop.step_hook = hook
        stream = iter(c.completions.create(model="tiny", prompt=[1, 2], max_tokens=50, stream=True))
        next(stream)
        armed.set()
        with pytest.raises(openai.APIError) as failed:
            for _ in stream:
                pass
        assert "injected engine failure" in str(failed.value.message)
        with pytest.raises(openai.InternalServerError) as info:
            c.chat.completions.create(model="tiny", messages=HI, max_tokens=2)
        assert "the engine loop died" in str(info.value.body)
        assert wait_for(lambda: get(http_port, "/health")[0] == 503, 10)
    finally:
        loading.set()
        c.close()
        starter.join(120)
        srv.stop()


def _answers(port: int) -> bool:
    try:
        get(port, "/health")
    except OSError:
        return False
    return True


def test_a_taken_http_port_is_one_clear_line() -> None:
    with held_port() as taken_port:
        cfg = ServerConfig(model="no-such-model.gguf", port=0, metrics_port=0, http_port=taken_port)
        with pytest.raises(PortInUse) as info:
            asyncio.run(start_server(cfg))  # the model path is never looked at
    assert str(info.value) == (
        f"HTTP port {taken_port} on 127.0.0.1 is in use (a second server needs its own HTTP port); "
        "pick a free one with --http-port, or --http-port 0 for no HTTP API"
    )
    assert ServerConfig().http_port == 0  # off unless asked for


def test_http_connections_have_nagle_off() -> None:
    """The HTTP socket's connections are TCP_NODELAY, as gRPC's are: with Nagle on, a streamed
    event written while the previous one is unacknowledged waited for the client's delayed ACK
    (40 ms; a raw keep-alive client saw every event of a short answer arrive at once, 40 ms late).
    asyncio sets the option only where the listening socket's ``proto`` is IPPROTO_TCP, and
    uvicorn serves ``bind``'s socket through ``loop.create_server(sock=...)`` as here."""

    async def accepted_nodelay() -> int:
        sock = bind("127.0.0.1", 0)
        got: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                s = transport.get_extra_info("socket")
                got.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            value = await asyncio.wait_for(got, 10)
            writer.close()
            return value
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(accepted_nodelay()) != 0


def test_serve_with_http_port_drains_and_exits_on_sigterm(tiny_gguf: Path, tmp_path: Path) -> None:
    """uvicorn runs without its own signal handlers: SIGTERM reaches serve_forever's drain, which
    lets the stream end, stops the HTTP server too, and the process exits 0.

    Greedy on a prompt of real tokens, so that the stream runs to max_tokens: this test once
    sampled (temperature 1) on the prompt [1, 2], whose special tokens' zero embeddings make every
    first logit 0, and about 1 time in 200 (3 of 600 seeds) its first token was EOS, so the stream's first chunk was
    also its last and nothing was left to read after SIGTERM (tests/test_drain.py holds the
    drain's own guarantees)."""
    http_port = free_port()
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "service.server.cli", "serve", "--model", str(tiny_gguf), "--port", "0",
           "--metrics-port", "0", "--http-port", str(http_port), "--num-slots", "2", "--max-seq-len", "128",
           "--chunk-size", "32", "--grace-period", "5"]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        try:
            assert wait_for(lambda: _answers(http_port) and get(http_port, "/health")[0] == 200, 120), (
                log_path.read_text()
            )
            c = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x", max_retries=0)
            stream = iter(
                c.completions.create(
                    model="tiny", prompt="the drain", max_tokens=60, temperature=0, stream=True,
                    stream_options={"include_usage": True},
                )
            )  # fmt: skip
            first = next(stream)
            proc.send_signal(signal.SIGTERM)
            rest = list(stream)  # the in-flight stream finishes within the grace period
            chunks = [first, *rest]
            assert chunks[-2].choices[0].finish_reason == "length"  # then the usage chunk
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 60
            assert len(chunks) == 60 + 1
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    text = log_path.read_text()
    assert "signal received: draining" in text and "OpenAI-compatible API on http://127.0.0.1" in text


# ---- the real model through the official client (slow) ---------------------------------------------

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture()
def real(server) -> Iterator[openai.OpenAI]:  # type: ignore[no-untyped-def]
    c = api(server)
    yield c
    c.close()


@pytest.mark.slow
def test_real_streamed_chat_equals_the_answer_with_paris_and_usage(real: openai.OpenAI, tokenizer: Tokenizer) -> None:
    model = real.models.list().data[0].id  # the served model's name: the default pool
    whole = real.chat.completions.create(model=model, messages=FRANCE, max_tokens=24, temperature=0)
    answer = whole.choices[0].message.content
    assert answer is not None and "Paris" in answer and whole.choices[0].finish_reason == "stop"
    chunks = list(
        real.chat.completions.create(
            model=model, messages=FRANCE, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == answer
    usage = chunks[-1].usage
    assert usage is not None and whole.usage is not None
    streamed, answered = usage.model_dump(), whole.usage.model_dump()
    # The streamed request came second: the prefix cache served its prompt's full pages.
    assert streamed.pop("prompt_tokens_details")["cached_tokens"] == usage.prompt_tokens // 16 * 16 > 0
    answered.pop("prompt_tokens_details")
    assert streamed == answered
    rendered = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True)
    assert usage.prompt_tokens == len(tokenizer.encode(rendered))
    assert usage.completion_tokens == len(tokenizer.encode(answer))  # greedy ids re-encode to themselves here


@pytest.mark.slow
def test_real_completions_with_a_stop_list(real: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    plain = real.completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0).choices[0]
    text = plain.text
    assert len(text) > 6
    stop = text[4:6]
    cut = real.completions.create(
        model="default", prompt=prompt, max_tokens=12, temperature=0, stop=["QZXJ", stop]
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)]


@pytest.mark.slow
def test_real_n3_seeded_answers_differ_and_repeat(real: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="default", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8, temperature=1.0, n=3,
        seed=1234,
    )  # fmt: skip
    first = [c.message.content for c in real.chat.completions.create(**kwargs).choices]
    second = [c.message.content for c in real.chat.completions.create(**kwargs).choices]
    assert first == second
    assert len(set(first)) == 3, first


@pytest.mark.slow
def test_real_top5_logprobs_equal_grpc(server, real: openai.OpenAI, tokenizer: Tokenizer) -> None:  # type: ignore[no-untyped-def]
    r = real.chat.completions.create(
        model="default", messages=FRANCE, max_tokens=6, temperature=0, logprobs=True, top_logprobs=5
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    grpc_client = Client(server.address)
    try:
        records, ids = [], []
        chat = [(m["role"], m["content"]) for m in FRANCE]
        for resp in grpc_client.stream(make_request(chat=chat, max_tokens=6, temperature=0.0, logprobs=5), TIMEOUT_S):
            records.extend(resp.logprobs)
            ids.extend(resp.token_ids)
    finally:
        grpc_client.close()
    assert content is not None and len(content) == len(records) == 6
    for item, rec in zip(content, records, strict=True):
        assert item.logprob == rec.logprob
        assert item.bytes == list(tokenizer.token_bytes(rec.token_id))
        assert [t.logprob for t in item.top_logprobs] == [t.logprob for t in rec.top]
        assert [bytes(t.bytes or []) for t in item.top_logprobs] == [tokenizer.token_bytes(t.token_id) for t in rec.top]
    assert r.choices[0].message.content == tokenizer.decode(ids)


@pytest.mark.slow
def test_real_errors_as_the_client_raises_them(real: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        real.chat.completions.create(model="gpt-4o", messages=FRANCE)
    with pytest.raises(openai.BadRequestError) as info:
        real.chat.completions.create(model="default", messages=FRANCE, max_tokens=5000)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        real.chat.completions.create(model="default", messages=FRANCE, response_format={"type": "xml"})  # type: ignore[typeddict-item]
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "response_format.type"
