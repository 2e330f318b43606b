"""Edge cases of the OpenAI-compatible HTTP API on the tiny session server (2 slots x 128 tokens,
queue of 4): bodies real clients send by mistake, values at and past the engine's limits, stop
strings split across tokens in a stream, a burst past the queue. Each request that is refused
must be OpenAI's error shape with the right status, and the pool must keep serving: a greedy
follow-up answers what it answered before."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx2 as httpx
import jinja2
import pytest
from helpers import scrape, status_of, value, wait_for
from test_http_api import get, post, sse_data

from service.server.client import Client, make_request

PROBE = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture()
def port(tiny_server) -> int:  # type: ignore[no-untyped-def]
    return int(tiny_server.running.http_port)


@pytest.fixture()
def still_serving(port: int):  # type: ignore[no-untyped-def]
    """Checks, after the test, that the pool answers a greedy request as it did before it."""
    status, before = post(port, COMPLETIONS, PROBE)
    assert status == 200, before
    yield
    status, after = post(port, COMPLETIONS, PROBE)
    assert status == 200, after
    assert json.loads(after)["choices"] == json.loads(before)["choices"]


def error_of(status: int, text: str, expected_status: int) -> dict[str, Any]:
    """The error object of an OpenAI error body with ``expected_status``."""
    assert status == expected_status, text
    body = json.loads(text)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]  # type: ignore[no-any-return]


# ---- values past the engine's limits ---------------------------------------------------------------


@pytest.mark.parametrize("top_k", [2**31, 2**40, 10**30])
def test_a_top_k_past_int32_is_no_filter_and_the_pool_survives(port: int, still_serving: None, top_k: int) -> None:
    # Was: the engine's int32 slot array raised OverflowError in the engine loop, which died;
    # every later request was 503 "the engine loop died".
    body = {**PROBE, "top_k": top_k}
    status, text = post(port, COMPLETIONS, body)
    assert status == 200, text
    assert json.loads(text)["choices"] == json.loads(post(port, COMPLETIONS, {**PROBE, "top_k": 0})[1])["choices"]


@pytest.mark.parametrize(
    ("path", "raw", "field"),
    [
        (COMPLETIONS, b'{"model":"tiny","prompt":"a\\ud800b","max_tokens":1}', "prompt"),
        (CHAT, b'{"model":"tiny","messages":[{"role":"user","content":"\\udc00"}]}', "messages[0].content"),
        (
            CHAT,
            b'{"model":"tiny","messages":[{"role":"user","content":[{"type":"text","text":"\\ud800"}]}]}',
            "messages[0].content[0].text",
        ),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(
    port: int, still_serving: None, path: str, raw: bytes, field: str
) -> None:
    # Was: 500 "Internal Server Error" as plain text (the tokenizer's TypeError).
    err = error_of(*post(port, path, raw), 400)
    assert err["param"] == field and err["message"].startswith(f"{field}: not valid Unicode"), err


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p"])
@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_400(port: int, field: str, number: str) -> None:
    raw = f'{{"model":"tiny","messages":[{{"role":"user","content":"hi"}}],"{field}":{number}}}'.encode()
    err = error_of(*post(port, CHAT, raw), 400)
    assert err["param"] == field, err


def test_a_prompt_past_max_seq_len_is_400_with_its_count_and_the_limit(port: int) -> None:
    for path, body, field in (
        (COMPLETIONS, {"model": "tiny", "prompt": [1] * 200}, "prompt"),
        (COMPLETIONS, {"model": "tiny", "prompt": [1] * 128, "max_tokens": 1}, "prompt"),
        (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "x" * 1000}]}, "messages"),
    ):
        err = error_of(*post(port, path, body), 400)
        assert err["param"] == field and "max sequence length of 128 tokens" in err["message"], err
    err = error_of(*post(port, COMPLETIONS, {"model": "tiny", "prompt": [1] * 200}), 400)
    assert err["message"].startswith("prompt: 200 tokens")
    assert post(port, COMPLETIONS, {"model": "tiny", "prompt": [1] * 127, "max_tokens": 1})[0] == 200


# ---- malformed bodies name the field as the body spelled it ----------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop"),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stop": ["a", 5]}, "stop"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (CHAT, {"messages": [{"role": "user", "content": ["x"]}]}, "messages[0].content"),
        (CHAT, {"messages": [{"content": "x"}]}, "messages[0].role"),
        (CHAT, {"messages": {}}, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stream_options": 3}, "stream_options"),
        (COMPLETIONS, {"prompt": 5}, "prompt"),
        (COMPLETIONS, {"prompt": None}, "prompt"),
        (COMPLETIONS, {"prompt": [1.5]}, "prompt"),
        (COMPLETIONS, {"prompt": "hi", "logit_bias": {"7": "up"}}, "logit_bias.7"),
        (COMPLETIONS, [1, 2], "body"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
        # Strict types (was: lax pydantic took these as 3, True, 1 and the ids [1, 2]).
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "n": "3"}, "n"),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": True}, "max_tokens"),
        (COMPLETIONS, {"prompt": [True, 2]}, "prompt"),
        (COMPLETIONS, {"prompt": "hi", "seed": "7"}, "seed"),
        (COMPLETIONS, {"prompt": "hi", "logprobs": True}, "logprobs"),
    ],
)
def test_a_body_of_wrong_types_is_400_naming_the_field(port: int, path: str, body: Any, field: str) -> None:
    # Was: pydantic's union member in the name ("stop.str", "messages.0.content.str").
    err = error_of(*post(port, path, body), 400)
    assert err["param"] == field and err["message"].startswith(f"{field}: "), err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe", b'{"prompt": "hi",}', b""])
def test_a_body_that_is_not_json_is_400(port: int, raw: bytes) -> None:
    # Was: the decoder's offset as the field ("1: JSON decode error", param "1").
    err = error_of(*post(port, COMPLETIONS, raw), 400)
    assert err["param"] == "body" and err["message"].startswith("body: "), err


# ---- streams ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["matches", "diverges", "cut"])
def test_a_stop_string_across_tokens_never_leaks_into_the_stream(port: int, case: str) -> None:
    # The tiny model's logits are peaked (a greedy answer repeats one id): a hot seeded draw
    # gives varied ids.
    body: dict[str, Any] = {
        "model": "tiny", "prompt": [5, 17, 42, 99], "max_tokens": 24, "temperature": 50.0, "seed": 2, "logprobs": 0,
    }  # fmt: skip
    whole = json.loads(post(port, COMPLETIONS, body)[1])["choices"][0]
    tokens, text = whole["logprobs"]["tokens"], whole["text"]
    # A stop string of two one-character tokens (k and k + 1): wherever it first occurs, it
    # spans two tokens, and its first character must be held back until the next token decides.
    printable = [len(t) == 1 and t.isprintable() and t.isascii() for t in tokens]
    k = next(k for k in range(2, len(tokens) - 1) if printable[k] and printable[k + 1])
    stop = tokens[k] + tokens[k + 1]
    expected, finish = text[: text.index(stop)], "stop"
    if case == "diverges":  # its start matches, its end never does: the held-back text is sent after all
        stop += "\x00"
        expected, finish = text, "length"
    elif case == "cut":  # the answer ends (max_tokens) on the stop string's first character: sent at the end
        body["max_tokens"] = k + 1
        stop, finish = stop + "\x00", "length"
        expected = json.loads(post(port, COMPLETIONS, {**body, "logprobs": None})[1])["choices"][0]["text"]
        assert expected.endswith(tokens[k])
    del body["logprobs"]
    answer = json.loads(post(port, COMPLETIONS, {**body, "stop": [stop]})[1])["choices"][0]
    assert (answer["text"], answer["finish_reason"]) == (expected, finish)
    status, raw = post(port, COMPLETIONS, {**body, "stop": [stop], "stream": True})
    events = [json.loads(d) for d in sse_data(raw)[:-1]]
    streamed = "".join(e["choices"][0]["text"] for e in events)
    assert status == 200 and streamed == expected, (stop, streamed, expected)
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == finish
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])


def test_streamed_n2_chat_each_choice_opens_with_the_role_and_finishes_last(port: int) -> None:
    body = {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 2, "seed": 5,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    status, raw = post(port, CHAT, body)
    data = sse_data(raw)
    assert status == 200 and data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 10
    seen: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for e in events[:-1]:
        assert len(e["choices"]) == 1 and e["usage"] is None
        seen[e["choices"][0]["index"]].append(e["choices"][0])
    for choices in seen.values():
        assert choices[0]["delta"]["role"] == "assistant" and all("role" not in c["delta"] for c in choices[1:])
        assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]


def test_min_tokens_holds_back_stop_strings_the_same_streamed_or_not(port: int) -> None:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": "hi",
        "max_tokens": 5,
        "min_tokens": 5,
        "stop": ["i"],
        "temperature": 0,
    }
    whole = json.loads(post(port, COMPLETIONS, body)[1])
    streamed = [json.loads(d) for d in sse_data(post(port, COMPLETIONS, {**body, "stream": True})[1])[:-1]]
    assert whole["usage"]["completion_tokens"] == 5
    assert "".join(e["choices"][0]["text"] for e in streamed) == whole["choices"][0]["text"]


# ---- a burst past the queue -----------------------------------------------------------------------------


def test_a_burst_of_http_and_grpc_past_the_queue(tiny_server, port: int, still_serving: None) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    c = Client(tiny_server.address)
    loop = tiny_server.running.gateway.pools[0].loop
    loop.step_hook = lambda plan: time.sleep(0.01)  # the burst arrives faster than it is served
    try:
        with ThreadPoolExecutor(24) as pool:
            http = [pool.submit(post, port, COMPLETIONS, body) for _ in range(20)]
            rpc = [
                pool.submit(status_of, c, make_request(token_ids=[1, 2, 3], max_tokens=8, temperature=0.0), 120)
                for _ in range(4)
            ]
            answers = [f.result() for f in http]
            rpcs = [f.result() for f in rpc]
    finally:
        loop.step_hook = None
        c.close()
    texts = set()
    for status, text in answers:
        if status == 429:
            err = error_of(status, text, 429)
            assert err["code"] == "queue_full" and err["type"] == "rate_limit_error", err
        else:
            r = json.loads(text)
            assert status == 200 and r["usage"]["completion_tokens"] == 8, text
            texts.add(r["choices"][0]["text"])
    statuses = [s for s, _ in answers]
    assert statuses.count(429) >= 1 and statuses.count(200) >= 1 and len(texts) == 1, statuses  # greedy: one answer
    assert all(code in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED) for code, _ in rpcs), rpcs
    assert wait_for(lambda: value(scrape(port), "meshserve_active_slots", pool="default") == 0, 10)
    assert loop.scheduler.queue_depth == 0 and not any(tiny_server.running.gateway.inflight.values())
    assert get(port, "/health")[0] == 200


def test_a_client_that_drops_a_chat_stream_after_one_event_frees_its_slots(tiny_server, port: int) -> None:  # type: ignore[no-untyped-def]
    loop = tiny_server.running.gateway.pools[0].loop
    loop.step_hook = lambda plan: time.sleep(0.05)  # the stream outlives the close
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "n": 2, "stream": True}
    try:
        with httpx.Client(timeout=30) as h, h.stream("POST", f"http://127.0.0.1:{port}{CHAT}", json=body) as resp:
            assert resp.status_code == 200
            first = next(resp.iter_lines())
            assert first.startswith("data: ") and json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
        assert wait_for(lambda: value(scrape(port), "meshserve_active_slots", pool="default") == 0, 10)
    finally:
        loop.step_hook = None
    assert not any(tiny_server.running.gateway.inflight.values())


# ---- errors from below the API ----------------------------------------------------------------------------


def test_a_chat_template_that_raises_is_400_and_invalid_argument(
    tiny_server, port: int, still_serving: None, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    # Was: jinja2's TemplateError escaped: HTTP 500 text/plain, gRPC UNKNOWN.
    def refuse(messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        raise jinja2.exceptions.TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")

    monkeypatch.setattr(tiny_server.running.gateway.tokenizer, "apply_chat_template", refuse)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    err = error_of(*post(port, CHAT, body), 400)
    assert err["param"] == "messages" and "roles must alternate" in err["message"], err
    c = Client(tiny_server.address)
    try:
        code, details = status_of(c, make_request(chat=[("user", "a"), ("user", "b")], max_tokens=2), 30)
    finally:
        c.close()
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("chat.messages: "), details


def test_an_internal_error_is_a_500_in_openais_shape(
    port: int, still_serving: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Was: Starlette's text/plain "Internal Server Error", which clients cannot parse as an error.
    import service.server.http_api

    def broken(*args: Any) -> Any:
        raise RuntimeError("injected")

    with monkeypatch.context() as m:  # undone before still_serving checks
        m.setattr(service.server.http_api, "completion_request", broken)
        err = error_of(*post(port, COMPLETIONS, {"model": "tiny", "prompt": "hi"}), 500)
    assert err["type"] == "server_error" and "injected" in err["message"], err


# ---- penalties stay in their own slot -------------------------------------------------------------------


def test_a_penalized_neighbour_changes_no_other_answer(tiny_server, port: int) -> None:  # type: ignore[no-untyped-def]
    plain = {"model": "tiny", "prompt": [50, 60, 70, 80], "max_tokens": 12, "temperature": 0}
    penalized = {
        "model": "tiny", "prompt": [5, 17, 42, 99], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "presence_penalty": 2, "frequency_penalty": 2, "repetition_penalty": 100.0, "min_tokens": 12,
    }  # fmt: skip
    alone = [json.loads(post(port, COMPLETIONS, b)[1])["choices"] for b in (plain, penalized)]
    unpenalized = {k: v for k, v in penalized.items() if not k.endswith("_penalty")}
    assert json.loads(post(port, COMPLETIONS, unpenalized)[1])["choices"] != alone[1]  # the penalties bite
    loop = tiny_server.running.gateway.pools[0].loop
    loop.step_hook = lambda plan: time.sleep(0.01)  # both in the batch at once
    try:
        with ThreadPoolExecutor(2) as pool:
            together = [f.result() for f in [pool.submit(post, port, COMPLETIONS, b) for b in (plain, penalized)]]
    finally:
        loop.step_hook = None
    assert [json.loads(t)["choices"] for _, t in together] == alone
    # n = 2 greedy: both sequences penalized alike, each by its own history.
    both = json.loads(post(port, COMPLETIONS, {**penalized, "n": 2})[1])["choices"]
    assert [c["text"] for c in both] == [alone[1][0]["text"]] * 2
