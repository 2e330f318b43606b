"""A server that speculates (``--speculative ngram``) on the tiny model: the same answers as with
speculation off for the request, the draft ids verified in each request's usage (OpenAI's
``completion_tokens_details``, gRPC's ``Usage``), and the pool's speculative-decoding metrics;
the flags reach the engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import free_port, openai_client, scrape, value

from protos.meshserve.v1 import meshserve_pb2 as pb
from service.server.cli import _serve_config, build_parser
from service.server.client import Client, make_request

# The tiny random model's greedy ids fall into a loop at once: n-gram drafts are kept.
PROMPT = "hello hello hello"


@pytest.fixture(scope="module")
def server(tiny_gguf: Path) -> Iterator[Any]:
    from service.engine.config import EngineConfig
    from service.server.app import ServerThread
    from service.server.config import ServerConfig

    cfg = ServerConfig(
        model=str(tiny_gguf), port=0, metrics_port=free_port(), http_port=free_port(),
        engine=EngineConfig(num_slots=2, max_seq_len=128, chunk_size=32, speculative="ngram", speculative_tokens=3),
    )  # fmt: skip
    srv = ServerThread(cfg).start()
    yield srv
    srv.stop()


def test_answers_equal_those_without_speculation_and_usage_counts_the_drafts(server: Any) -> None:
    c = openai_client(server)
    try:
        kw: dict[str, Any] = dict(model="default", prompt=PROMPT, max_tokens=40, temperature=0)
        spec = c.completions.create(**kw)
        off = c.completions.create(**kw, extra_body={"speculative": False})
    finally:
        c.close()
    assert spec.choices[0].text == off.choices[0].text and spec.choices[0].finish_reason == "length"
    details = spec.usage.completion_tokens_details  # type: ignore[union-attr]
    assert details is not None and details.accepted_prediction_tokens > 10
    assert details.rejected_prediction_tokens is not None
    none = off.usage.completion_tokens_details  # type: ignore[union-attr]
    assert none is not None and none.accepted_prediction_tokens == none.rejected_prediction_tokens == 0


def test_grpc_usage_reports_the_draft_ids_and_the_opt_out(server: Any) -> None:
    client = Client(server.address)
    try:
        last: list[pb.GenerateResponse] = []
        for speculative in (True, False):
            req = make_request(prompt=PROMPT, max_tokens=40, temperature=0.0, speculative=speculative)
            last.append(list(client.stream(req, 120))[-1])
    finally:
        client.close()
    on, off = (r.usage for r in last)
    assert on.accepted_draft_tokens > 10 and on.completion_tokens == off.completion_tokens == 40
    assert off.accepted_draft_tokens == off.rejected_draft_tokens == 0


def test_the_metrics_count_proposals_acceptances_and_verifying_steps(server: Any) -> None:
    c = openai_client(server)
    try:
        c.completions.create(model="default", prompt=PROMPT, max_tokens=30, temperature=0)
    finally:
        c.close()
    samples = scrape(server.cfg.metrics_port)
    drafts = value(samples, "meshserve_spec_decode_draft_tokens_total", pool="default", proposer="ngram")
    kept = value(samples, "meshserve_spec_decode_accepted_tokens_total", pool="default", proposer="ngram")
    verify = value(samples, "meshserve_spec_decode_verify_steps_total", pool="default")
    steps = value(samples, "meshserve_engine_step_seconds_count", pool="default")
    proposals = value(samples, "meshserve_spec_decode_acceptance_length_count", pool="default")
    kept_sum = value(samples, "meshserve_spec_decode_acceptance_length_sum", pool="default")
    assert drafts >= kept > 10 and kept_sum == kept
    assert 0 < verify <= proposals and verify < steps


def test_the_flags_reach_the_engine() -> None:
    args = build_parser().parse_args(
        ["serve", "--speculative", "ngram", "--speculative-tokens", "5", "--ngram-max", "4", "--ngram-min", "1"]
    )
    engine = _serve_config(args).engine
    assert (engine.speculative, engine.speculative_tokens, engine.ngram_max, engine.ngram_min) == ("ngram", 5, 4, 1)
    assert engine.verify_tokens == 8
    assert build_parser().parse_args(["serve"]).speculative is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative", "eagle"])
    with pytest.raises(SystemExit):
        _serve_config(build_parser().parse_args(["serve", "--speculative", "ngram", "--speculative-tokens", "0"]))
