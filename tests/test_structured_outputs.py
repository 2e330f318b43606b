"""Structured outputs through the live server: OpenAI's ``response_format``, vLLM's
``structured_outputs`` and gRPC's ``GenerateRequest.constraint``, through the official ``openai``
client and the gRPC client.

Fast tests use the tiny session server (random weights: only a constraint makes its answers
anything but gibberish, which is what they show); the ``slow`` ones use the real SmolLM2
session ``server``: 20 schemas of the shapes real APIs use (``structured_schemas.py``), greedy
and sampled with three seeds, every answer parsed and validated by ``jsonschema``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import jsonschema
import openai
import pytest
from helpers import openai_client, status_of
from structured_schemas import SCHEMAS, bounded

from protos.meshserve.v1 import meshserve_pb2 as pb
from service.server.client import Client, make_request

HI = [{"role": "user", "content": "hi"}]
DEAD_END = 'start: "a" B\nB: /b/ & /c/'  # after "a", B's two patterns share no text


@pytest.fixture()
def client(tiny_server) -> Iterator[openai.OpenAI]:  # type: ignore[no-untyped-def]
    c = openai_client(tiny_server, timeout=300)
    yield c
    c.close()


@pytest.fixture()
def grpc_client(tiny_server) -> Iterator[Client]:  # type: ignore[no-untyped-def]
    c = Client(tiny_server.address)
    yield c
    c.close()


def chat(c: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("messages", HI)
    kw.setdefault("max_tokens", 40)
    kw.setdefault("temperature", 0)
    return c.chat.completions.create(model="default", **kw)


# ---- the tiny server ----------------------------------------------------------------------------
def test_a_choice_and_a_regex_hold_over_both_apis(client: openai.OpenAI, grpc_client: Client) -> None:
    words = ["alpha", "beta gamma", "delta"]
    for seed in range(3):
        r = chat(client, temperature=1.0, seed=seed, extra_body={"structured_outputs": {"choice": words}})
        assert r.choices[0].message.content in words and r.choices[0].finish_reason == "stop"
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    r = chat(client, extra_body={"structured_outputs": {"regex": phone}})
    assert re.fullmatch(phone, r.choices[0].message.content or "") and r.choices[0].finish_reason == "stop"
    done = client.completions.create(model="default", prompt="x", max_tokens=40, temperature=0, extra_body={"structured_outputs": {"regex": phone}})  # fmt: skip
    assert re.fullmatch(phone, done.choices[0].text)
    got = grpc_client.generate(make_request(prompt="x", max_tokens=40, temperature=0.0, constraint=pb.Constraint(regex=phone)), 60)  # fmt: skip
    assert got.text == done.choices[0].text and got.finish_reason == "FINISH_REASON_EOS"
    got = grpc_client.generate(
        make_request(chat=[("user", "hi")], max_tokens=40, constraint=pb.Constraint(choice=pb.Choices(values=words))),
        60,
    )
    assert got.text in words


def test_streamed_constrained_text_equals_the_whole_answer(client: openai.OpenAI) -> None:
    extra = {"structured_outputs": {"grammar": 'start: "[" NUM ("," NUM)* "]"\nNUM: /[0-9]{1,3}/'}}
    whole = chat(client, max_tokens=30, extra_body=extra)
    chunks = list(chat(client, max_tokens=30, stream=True, extra_body=extra))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    text = whole.choices[0].message.content or ""
    assert re.fullmatch(r"\[[0-9]{1,3}(,[0-9]{1,3})*\]?", text) or re.fullmatch(r"\[([0-9]{1,3},)*[0-9]{0,3}", text)


def test_max_tokens_inside_json_is_length_and_the_text_is_a_prefix(client: openai.OpenAI) -> None:
    r = chat(client, max_tokens=6, response_format={"type": "json_object"})
    text = r.choices[0].message.content or ""
    assert r.choices[0].finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 6
    assert text.startswith("{") and not _parses(text)


def test_a_grammar_dead_end_has_its_finish_reason_over_both_apis(client: openai.OpenAI, grpc_client: Client) -> None:
    r = chat(client, extra_body={"structured_outputs": {"grammar": DEAD_END}})
    assert r.choices[0].message.content == "a" and r.choices[0].finish_reason == "grammar_dead_end"
    got = grpc_client.generate(make_request(prompt="x", max_tokens=10, constraint=pb.Constraint(grammar=DEAD_END)), 60)
    assert got.text == "a" and got.finish_reason == "FINISH_REASON_GRAMMAR_DEAD_END"
    assert chat(client, max_tokens=3).choices[0].finish_reason == "length"  # the server serves on


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         "response_format.json_schema.schema", "strin"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 3}}}},
         "response_format.json_schema.schema", "nsatisfiable"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "^(?!a)"}}}},
         "response_format.json_schema.schema", "look-around"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "unclosed"),
        ({"structured_outputs": {"grammar": "start: x"}}, "structured_outputs.grammar", "x"),
        ({"structured_outputs": {"grammar": 'start: B "c"\nB: /x/ & /y/'}}, "structured_outputs.grammar", "no output"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "not supported"),
        ({"structured_outputs": {"json": "{bad"}}, "structured_outputs.json", "not valid JSON"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs", "one of"),
        ({"guided_json": {"type": "object"}}, "guided_json", "structured_outputs.json"),
    ],
)  # fmt: skip
def test_a_constraint_that_does_not_compile_is_a_400_naming_it(
    client: openai.OpenAI, extra: dict, field: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, extra_body=extra)
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == field and words in body["message"], body


def test_a_bad_constraint_over_grpc_is_invalid_argument(grpc_client: Client) -> None:
    bad = make_request(prompt="x", constraint=pb.Constraint(json_schema='{"type": "strin"}'))
    code, message = status_of(grpc_client, bad)
    assert code is grpc.StatusCode.INVALID_ARGUMENT and message.startswith("constraint.json_schema: ")
    code, message = status_of(grpc_client, make_request(prompt="x", constraint=pb.Constraint()))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and message.startswith("constraint: ")
    code, message = status_of(grpc_client, make_request(prompt="x", constraint=pb.Constraint(json_object=False)))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and message.startswith("constraint.json_object: ")


def test_constrained_logprobs_are_of_the_allowed_ids(client: openai.OpenAI) -> None:
    """The log-probabilities of a constrained row are its grammar's distribution's: at the first
    id of a two-word choice only those words' first ids are alternatives, and they sum to 1."""
    r = chat(client, logprobs=True, top_logprobs=5, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    first = r.choices[0].logprobs.content[0]  # type: ignore[union-attr]
    assert {t.token for t in first.top_logprobs} <= {"y", "ye", "yes", "n", "no"} and first.top_logprobs
    assert abs(sum(__import__("math").exp(t.logprob) for t in first.top_logprobs) - 1) < 1e-3


def test_n_constrained_sequences_each_follow_the_grammar(client: openai.OpenAI) -> None:
    words = ["one", "two", "three", "four"]
    r = chat(client, n=2, temperature=1.0, seed=11, extra_body={"structured_outputs": {"choice": words}})
    assert len(r.choices) == 2 and all(c.message.content in words for c in r.choices)


def test_cached_tokens_report_the_prefix_cache_over_both_apis(
    tiny_server, client: openai.OpenAI, grpc_client: Client
) -> None:  # type: ignore[no-untyped-def]
    page = tiny_server.running.gateway.pools[0].loop.runner.ecfg.page_size
    prompt = [(11 * i + 5) % 250 + 4 for i in range(2 * page + 3)]  # in no other test
    first = client.completions.create(model="default", prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model="default", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert again.usage.prompt_tokens_details.cached_tokens == 2 * page  # type: ignore[union-attr]
    last = list(grpc_client.stream(make_request(token_ids=prompt, max_tokens=2, temperature=0.0), 60))[-1]
    assert last.usage.cached_tokens == 2 * page


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


# ---- the real model -----------------------------------------------------------------------------
@pytest.fixture()
def real(server) -> Iterator[openai.OpenAI]:  # type: ignore[no-untyped-def]
    c = openai_client(server, timeout=300)
    yield c
    c.close()


@pytest.fixture()
def real_grpc(server) -> Iterator[Client]:  # type: ignore[no-untyped-def]
    c = Client(server.address)
    yield c
    c.close()


@pytest.mark.slow
def test_every_schema_answer_parses_and_validates_greedy_and_sampled(real: openai.OpenAI) -> None:
    """20 schemas x (greedy, 3 seeds), strict json_schema: every answer ends ("stop") and
    validates, formats included. The schemas' free strings are bounded (``bounded``), so every
    path ends within max_tokens."""

    def one(job: tuple[str, str, dict, int | None]) -> tuple[str, str | None, str]:
        name, prompt, schema, seed = job
        kw: dict[str, Any] = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        r = real.chat.completions.create(
            model="default", messages=[{"role": "user", "content": prompt}], max_tokens=400, response_format=fmt, **kw
        )  # type: ignore[call-overload]
        return name, r.choices[0].finish_reason, r.choices[0].message.content or ""

    jobs = [(n, p, bounded(s), seed) for n, p, s in SCHEMAS for seed in (None, 1, 2, 3)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, jobs))
    checker = jsonschema.FormatChecker()
    for (name, _, schema, seed), (_, reason, text) in zip(jobs, answers, strict=True):
        assert reason == "stop", (name, seed, text)
        jsonschema.validate(json.loads(text), schema, format_checker=checker)
    assert len({text for _, _, text in answers}) > 60  # sampling does sample


@pytest.mark.slow
def test_every_schema_answer_parses_over_grpc(real_grpc: Client) -> None:
    for name, prompt, schema in SCHEMAS:
        schema = bounded(schema)
        got = real_grpc.generate(
            make_request(chat=[("user", prompt)], max_tokens=400, temperature=0.0,
                         constraint=pb.Constraint(json_schema=json.dumps(schema))), 300,
        )  # fmt: skip
        assert got.finish_reason == "FINISH_REASON_EOS", (name, got.text)
        jsonschema.validate(json.loads(got.text), schema, format_checker=jsonschema.FormatChecker())
