"""Prometheus metrics: the per-server registry, and the HTTP endpoint of the session ``server``
(4 slots x 1024 tokens)."""

from __future__ import annotations

import re

import grpc
import pytest
from helpers import scrape, value, wait_for

from service.engine.runner import CompileCounts
from service.server.client import Client, make_request
from service.server.config import ServerConfig
from service.server.metrics import FINISH_REASONS, Metrics

TIMEOUT_S = 120.0


def test_each_metrics_object_has_its_own_registry() -> None:
    a, b = Metrics(), Metrics()  # a second server in the same process must not raise "Duplicated timeseries"
    assert a.registry is not b.registry
    a.requests.labels(pool="default", finish_reason="eos").inc()
    assert a.registry.get_sample_value("meshserve_requests_total", {"pool": "default", "finish_reason": "eos"}) == 1
    assert b.registry.get_sample_value("meshserve_requests_total", {"pool": "default", "finish_reason": "eos"}) is None
    a.set_layout("default", "single", 1, 1, "heads")
    a.set_layout("default", "1x4", 1, 4, "replicated")  # replaces the value, no stale second series
    infos = [s for m in a.registry.collect() if m.name == "meshserve_pool_layout" for s in m.samples]
    assert [s.labels["layout"] for s in infos] == ["1x4"]


@pytest.mark.slow
def test_metrics_endpoint_names_and_pool_gauges(server) -> None:
    port = server.running.metrics_port
    assert ServerConfig().metrics_port == 9400  # the default; 0 turns the endpoint off
    assert port is not None and port == server.cfg.metrics_port
    samples = scrape(port)
    assert samples and all(name.startswith("meshserve_") for name, _ in samples)
    assert value(samples, "meshserve_serving") == 1
    assert value(samples, "meshserve_num_slots", pool="default") == 4
    assert value(samples, "meshserve_active_slots", pool="default") == 0
    assert value(samples, "meshserve_queue_depth", pool="default") == 0
    assert value(samples, "meshserve_kv_cache_usage_ratio", pool="default") == 0
    layout = server.running.gateway.pools[0].layout
    layouts = [dict(labels) for name, labels in samples if name == "meshserve_pool_layout_info"]
    assert len(layouts) == 1
    assert layouts[0]["pool"] == "default" and layouts[0]["layout"] == layout.name == "single"
    assert layouts[0]["data"] == "1" and layouts[0]["model"] == "1"
    for hist in ("time_to_first_token", "time_per_output_token", "e2e_request_latency", "queue_time"):
        assert (f"meshserve_{hist}_seconds_count", frozenset({("pool", "default")})) in samples, hist


@pytest.mark.slow
def test_a_finished_request_is_counted_once_with_its_latencies(server, client: Client, tokenizer) -> None:
    port = server.running.metrics_port
    before = scrape(port)
    r = client.generate(make_request(prompt="Hello", temperature=0.0, max_tokens=8), timeout_s=TIMEOUT_S)
    assert r.finish_reason == "FINISH_REASON_LENGTH" and len(r.token_ids) == 8
    after = scrape(port)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("meshserve_requests_total", pool="default", finish_reason="length") == 1
    for reason in set(FINISH_REASONS) - {"length"}:
        assert delta("meshserve_requests_total", pool="default", finish_reason=reason) == 0
    assert delta("meshserve_generation_tokens_total", pool="default") == 8
    assert delta("meshserve_prompt_tokens_total", pool="default") == len(tokenizer.encode("Hello"))
    for hist in ("time_to_first_token", "time_per_output_token", "e2e_request_latency", "queue_time"):
        assert delta(f"meshserve_{hist}_seconds_count", pool="default") == 1, hist
    # The server's own timings agree with what the client saw (the server's are a little shorter).
    e2e = delta("meshserve_e2e_request_latency_seconds_sum", pool="default")
    ttft = delta("meshserve_time_to_first_token_seconds_sum", pool="default")
    tpot = delta("meshserve_time_per_output_token_seconds_sum", pool="default")
    assert 0 < ttft <= e2e <= r.total_s
    assert ttft <= r.ttft_s
    assert tpot == pytest.approx((e2e - ttft) / 7, rel=1e-6)
    assert 0 <= delta("meshserve_queue_time_seconds_sum", pool="default") <= ttft
    # one prefill + 7 decode steps; the last may be observed just after the client got its chunk
    assert delta("meshserve_engine_step_seconds_count", pool="default") >= 7
    # Host time per id: every iteration that brought ids observed once, each a share of the
    # request's time (the last may land just after the client's chunk).
    assert 7 <= delta("meshserve_engine_host_seconds_per_token_count", pool="default") <= 8
    assert 0 < delta("meshserve_engine_host_seconds_per_token_sum", pool="default") < e2e


@pytest.mark.slow
def test_rejections_are_counted_by_code(server, client: Client) -> None:
    port = server.running.metrics_port
    before = value(scrape(port), "meshserve_requests_rejected_total", pool="default", code="invalid_argument")
    with pytest.raises(grpc.RpcError) as info:
        client.generate(make_request(prompt="Hello", max_tokens=0), timeout_s=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = value(scrape(port), "meshserve_requests_rejected_total", pool="default", code="invalid_argument")
    assert after == before + 1


@pytest.mark.slow
def test_gauges_follow_a_running_stream_and_its_cancellation(server, client: Client, tokenizer) -> None:
    port = server.running.metrics_port
    before = scrape(port)
    prompt = "1, 2, 3, 4, 5,"
    call = client.stream(make_request(prompt=prompt, temperature=0.0, max_tokens=200), timeout_s=TIMEOUT_S)
    next(call)
    next(call)
    during = scrape(port)
    assert value(during, "meshserve_active_slots", pool="default") == 1
    assert value(during, "meshserve_queue_depth", pool="default") == 0
    cached = len(tokenizer.encode(prompt)) + 1  # the prompt and at least the first id fed back
    assert value(during, "meshserve_kv_cache_usage_ratio", pool="default") >= cached / (4 * 1024)
    assert value(during, "meshserve_kv_cache_usage_ratio", pool="default") <= (cached + 200) / (4 * 1024)
    call.cancel()
    assert wait_for(lambda: value(scrape(port), "meshserve_active_slots", pool="default") == 0)
    after = scrape(port)
    assert value(after, "meshserve_kv_cache_usage_ratio", pool="default") == 0
    cancelled = value(after, "meshserve_requests_total", pool="default", finish_reason="cancelled")
    assert cancelled == value(before, "meshserve_requests_total", pool="default", finish_reason="cancelled") + 1
    assert value(after, "meshserve_e2e_request_latency_seconds_count", pool="default") == value(
        before, "meshserve_e2e_request_latency_seconds_count", pool="default"
    )  # only completed requests have an end-to-end latency


def test_the_docstring_lists_every_metric_with_its_labels_and_every_finish_reason() -> None:
    """service/server/metrics.py's docstring (the source of the docs) names each metric the registry
    exports as ``name{labels}`` with exactly its labels, and each finish_reason value."""
    import service.server.metrics

    doc = service.server.metrics.__doc__ or ""
    documented: dict[str, list[str]] = {}
    for line in doc.splitlines():
        if line.strip().startswith("meshserve_"):
            name, _, labels = line.split()[0].partition("{")
            documented[name] = sorted(labels.rstrip("}").split(",")) if labels else []
    m = Metrics()
    m.track_pool("default", 2, lambda: 0, lambda: 0, lambda: 0)
    m.set_layout("default", "single", 1, 1, "heads")
    m.set_weights("stored", {"wqkv": "q4_1", "embed": "q8_0"})
    m.track_pages("default", lambda: {"used": 0, "cached": 0, "free": 8})
    m.track_compiles("default", CompileCounts)
    m.track_speculation("default", "ngram")
    m.rejected.labels(pool="", code="unavailable").inc()
    exported: dict[str, list[str]] = {}
    for family in m.registry.collect():
        suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
        exported[family.name + suffix] = sorted({k for s in family.samples for k in s.labels if k != "le"})
    assert len(exported) == 28
    assert documented == exported
    assert exported["meshserve_requests_rejected_total"] == ["code", "pool"]
    assert exported["meshserve_serving"] == []
    for reason in FINISH_REASONS:
        assert re.search(rf"^\s+{reason}\s{{2,}}\S", doc, re.MULTILINE), reason


def test_compile_counts_are_read_when_scraped() -> None:
    """Background compiles end between steps: the counters read the engine's counts at
    scrape time, not at the next step."""
    counts = CompileCounts()
    m = Metrics()
    m.track_compiles("default", lambda: counts)

    def scraped(name: str, **labels: str) -> float | None:
        return m.registry.get_sample_value(name, {"pool": "default", **labels})

    assert scraped("meshserve_compiles_after_serving_total", path="step") == 0
    counts.add(ahead=2, widened_steps=5)
    assert scraped("meshserve_compiles_after_serving_total", path="background") == 2
    assert scraped("meshserve_compiles_after_serving_total", path="step") == 0
    assert scraped("meshserve_steps_in_larger_program_total") == 5
    counts.add(in_step=1)
    assert scraped("meshserve_compiles_after_serving_total", path="step") == 1
