"""benchmarks/served_peers.py: a workload's report from a real server over both APIs, the engine
step read from its metrics, and the ratios against a peer computed from the rounds' medians."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.bench import synthetic_specs
from benchmarks.served_peers import Workload, format_table, ratios, run_workload, step_seconds


def report(tok_s: float, ttft: float, tpot: float) -> dict[str, Any]:
    return {"output_tokens_per_s": tok_s, "ttft_ms": {"p50": ttft}, "tpot_ms": {"p50": tpot}, "failed": 0}


def test_ratios_are_of_the_medians_over_rounds() -> None:
    results = {
        "one": {
            "meshserve-http": [report(100, 50, 10), report(90, 70, 12), report(80, 60, 11)],
            "llama-server": [report(50, 600, 20), report(60, 500, 22)],
            "vllm": [report(45, 300, 40)],
            "meshserve-grpc": [report(95, 40, 10.5)],
        },
        "burst": {"meshserve-http": [report(200, 5000, 30)]},  # no peer: no ratio
    }
    r = ratios(results)
    assert list(r) == ["one"] and list(r["one"]) == ["llama-server", "vllm"]  # gRPC is meshserve, not a peer
    assert r["one"]["llama-server"]["output_tokens_per_s"] == 90 / 55
    assert r["one"]["llama-server"]["ttft_p50"] == 60 / 550 and r["one"]["llama-server"]["tpot_p50"] == 11 / 21
    assert r["one"]["vllm"] == {"output_tokens_per_s": 2.0, "ttft_p50": 0.2, "tpot_p50": 11 / 40}
    table = format_table(results, [10.0, 12.0])
    assert "meshserve / llama-server, one: tok/s 1.64x, TTFT 0.11x, TPOT 0.52x" in table
    assert "meshserve / vllm, one: tok/s 2.00x, TTFT 0.20x, TPOT 0.28x" in table
    assert "one stream, meshserve-grpc: TPOT p50 / engine step 10.50 / 11.00 ms = 0.95x" in table


def test_a_workload_runs_over_http_and_grpc_with_every_token(tiny_server) -> None:  # type: ignore[no-untyped-def]
    """``ignore_eos``: every request makes its ``max_tokens`` on the real server, over both APIs;
    the engine's steps are counted in its metrics."""
    server = {
        "grpc": tiny_server.address,
        "http": f"127.0.0.1:{tiny_server.cfg.http_port}",
        "metrics": tiny_server.cfg.metrics_port,
    }
    w = Workload(requests=3, concurrency=2, prompt=8, output=6)
    specs = synthetic_specs(3, (8, 8), (6, 6), 256, np.random.default_rng(0))
    before = step_seconds(server["metrics"])
    for api in ("openai", "grpc"):
        got = run_workload(server, api, w, specs, seed=0, timeout_s=120)
        assert got["completed"] == 3 and got["failed"] == 0, got["errors"]
        assert got["output_tokens"] == 3 * 6 and got["prompt_tokens"] == 3 * 8
        assert got["tpot_ms"]["p50"] > 0 and got["ttft_ms"]["p50"] > 0
    after = step_seconds(server["metrics"])
    assert after[1] - before[1] >= 2 * 5 and after[0] > before[0]
