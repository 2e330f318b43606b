"""``meshserve-bench bench``: the statistics on a hand-made trace, and a short run against a real server
on a tiny random model (sane fields only, never timing thresholds)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from benchmarks.bench import (
    BenchConfig,
    format_report,
    goodput,
    load_jsonl,
    mean_decoding_streams,
    parse_range,
    percentile,
    poisson_offsets,
    record_from_chunks,
    roofline_report,
    summarize,
    summarize_run,
    synthetic_specs,
    write_report,
)


def trace() -> list:
    """Four requests: (chunk arrival s, tokens in chunk) per chunk; the last chunk carries the finish."""
    a = record_from_chunks(
        0, 0.0, [(0.100, 1), (0.150, 1), (0.250, 2), (0.300, 0)], 0.300, 10, 4, "FINISH_REASON_LENGTH"
    )
    b = record_from_chunks(1, 0.5, [(0.200, 2), (0.400, 1)], 0.400, 20, 8, "FINISH_REASON_EOS")
    c = record_from_chunks(2, 1.0, [(0.050, 1)], 0.060, 5, 1, "FINISH_REASON_LENGTH")
    d = record_from_chunks(3, 1.5, [], 0.010, 7, 4, error="UNAVAILABLE")
    return [a, b, c, d]


def test_record_from_chunks() -> None:
    a, b, c, d = trace()
    assert a.ttft_s == 0.100 and a.output_tokens == 4 and a.e2e_s == 0.300
    assert a.itl_s == pytest.approx([0.05, 0.05, 0.05])  # the 2-token chunk's 0.1 s gap is split
    assert a.tpot_s == pytest.approx(0.05)  # (0.25 - 0.10) / (4 - 1)
    assert b.itl_s == pytest.approx([0.0, 0.2])  # the second token came with the first
    assert b.tpot_s == pytest.approx(0.1)
    assert c.tpot_s is None and c.itl_s == [] and c.output_tokens == 1
    assert not d.ok and d.ttft_s is None and d.output_tokens == 0


def test_percentiles_by_hand() -> None:
    values = list(range(1, 101))
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([10.0, 20.0], 50) == 15.0
    assert math.isnan(percentile([], 50))
    s = summarize([0.001, 0.003], scale=1e3)
    assert s == {"count": 2, "mean": 2.0, "min": 1.0, "p50": 2.0, "p90": 2.8, "p99": pytest.approx(2.98), "max": 3.0}


def test_summarize_run_on_the_trace() -> None:
    report = summarize_run(trace(), duration_s=2.0, slo_ttft_ms=150, slo_tpot_ms=60)
    assert (report["num_requests"], report["completed"], report["failed"]) == (4, 3, 1)
    assert report["errors"] == {"UNAVAILABLE": 1}
    assert report["finish_reasons"] == {"FINISH_REASON_LENGTH": 2, "FINISH_REASON_EOS": 1}
    assert (report["prompt_tokens"], report["output_tokens"], report["requested_output_tokens"]) == (35, 8, 13)
    assert report["requests_per_s"] == 1.5
    assert report["output_tokens_per_s"] == 4.0
    assert report["total_tokens_per_s"] == 21.5
    ttft = report["ttft_ms"]  # 100, 200, 50
    assert (ttft["count"], ttft["p50"], ttft["min"], ttft["max"]) == (3, pytest.approx(100), 50, 200)
    tpot = report["tpot_ms"]  # 50, 100
    assert (tpot["p50"], tpot["p90"], tpot["p99"]) == (pytest.approx(75), pytest.approx(95), pytest.approx(99.5))
    itl = report["itl_ms"]  # 0, 50, 50, 50, 200
    assert itl["count"] == 5
    assert (itl["p50"], itl["p90"], itl["p99"]) == (pytest.approx(50), pytest.approx(140), pytest.approx(194))
    assert report["e2e_ms"]["max"] == pytest.approx(400)
    # Goodput: a meets both bounds, b's TTFT is 200 > 150, c has one token (no TPOT) and meets, d failed.
    g = report["goodput"]
    assert (g["requests"], g["fraction"], g["requests_per_s"]) == (2, 0.5, 1.0)
    assert goodput(trace(), 2.0, None, None)["requests"] == 3  # no SLO: every completed request
    assert goodput(trace(), 2.0, None, 40)["requests"] == 1  # only c (no TPOT)
    assert "goodput (TTFT <= 150 ms and TPOT <= 60 ms): 1.00 req/s" in format_report(report)


def test_a_request_without_tokens_is_held_to_the_ttft_bound_by_its_end() -> None:
    """Completed at once (EOS first) after 30 ms: no TTFT, no TPOT; it counts as good with no SLO
    and under a TTFT bound it meets by its end-to-end time, and not under one it misses."""
    empty = record_from_chunks(0, 0.0, [(0.030, 0)], 0.030, 9, 4, "FINISH_REASON_EOS")
    assert empty.ok and empty.ttft_s is None and empty.tpot_s is None
    assert goodput([empty], 1.0, None, None)["requests"] == 1
    assert goodput([empty], 1.0, 50, 10)["requests"] == 1
    assert goodput([empty], 1.0, 20, None)["requests"] == 0


def test_error_details_keep_the_servers_message() -> None:
    bad = [
        record_from_chunks(i, 0.0, [], 0.01, 3, 4, error="INVALID_ARGUMENT", error_detail=f"temperature {i} < 0")
        for i in range(2)
    ]
    report = summarize_run([*bad, trace()[0]], duration_s=1.0)
    assert report["errors"] == {"INVALID_ARGUMENT": 2}
    assert report["error_details"] == {"INVALID_ARGUMENT": "temperature 0 < 0"}
    assert "  INVALID_ARGUMENT: temperature 0 < 0" in format_report(report)


def test_mean_decoding_streams_is_littles_law() -> None:
    # a decodes 0.10 -> 0.25 s, b 0.20 -> 0.40 s, c has one token, d failed: 0.35 s over 2 s.
    assert mean_decoding_streams(trace(), 2.0) == pytest.approx(0.175)
    assert math.isnan(mean_decoding_streams(trace(), 0.0))


def _smollm2_info(**overrides: object) -> object:
    from protos.meshserve.v1 import meshserve_pb2 as pb

    fields = dict(layout="1x1", layout_data=1, layout_model=1, attention="heads", platform="cpu", device_kind="cpu",
                  dtype="float32")  # fmt: skip
    return pb.ModelInfo(vocab_size=49152, num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9,
                        num_kv_heads=3, head_dim=64, context_length=8192, max_seq_len=2048, num_slots=4,
                        tie_word_embeddings=True, **{**fields, **overrides})  # fmt: skip


def test_roofline_report_by_hand() -> None:
    """SmolLM2-135M fp32 on the peers.md CPU (25 GB/s, 148 GFLOP/s): the trace's prompts average
    (10 + 20 + 5) / 3 and outputs (4 + 2 + 1) / 3 tokens; TPOT p50 75 ms, TTFT p50 100 ms."""
    from benchmarks import roofline as rl

    hw = rl.load_hardware("cpu-peers-md")
    records = trace()
    report = summarize_run(records, duration_s=2.0)
    roof = roofline_report(_smollm2_info(), hw, "line", records, 2.0, report, fallback_batch=3)
    assert roof["batch"] == 1 and "measured mean of 0.17 " in roof["batch_from"]  # 0.175 streams -> at least 1
    assert roof["context_len"] == round(35 / 3 + 7 / 6) == 13 and roof["prompt_len"] == 12
    # Batch 1, 13 positions: 538,060,032 weight bytes + 13 x 46,080 KV bytes, over 75 ms, over 25 GB/s.
    nbytes = 538_060_032 + 13 * 46_080
    assert roof["tpot_mbu"] == pytest.approx(nbytes / 75e-3 / 25e9)
    assert roof["predicted_tpot_ms"] == pytest.approx(nbytes / 25e9 * 1e3)
    flops = 2 * (134_515_008 - 61 * 576) + 4 * 13 * 30 * 9 * 64  # matmul weights (no norms) + attention
    assert roof["tpot_mfu"] == pytest.approx(flops / 75e-3 / 148e9)
    assert 0 < roof["ttft_mfu"] < 1 and roof["predicted_ttft_ms"] > 0
    report["roofline"] = roof
    text = format_report(report)
    assert "roofline" in text and "MBU" in text and "decode batch 1 per replica" in text
    # Two data-parallel replicas, nobody decoded: the configured concurrency (3) split over dp.
    idle = roofline_report(_smollm2_info(layout_data=2), hw, "line", records[2:], 2.0, report, fallback_batch=3)
    assert idle["batch"] == 2 and "configured concurrency 3" in idle["batch_from"] and idle["dp"] == 2
    # No hardware, or one without the dtype's peak: the line says why, the report stays.
    assert roofline_report(_smollm2_info(), None, "off", records, 2.0, report, 1) == {"hardware": "off"}
    bf16 = roofline_report(_smollm2_info(dtype="bfloat16"), hw, "cpu", records, 2.0, report, 1)
    assert set(bf16) == {"hardware"} and "bfloat16" in bf16["hardware"]


def test_roofline_report_counts_the_bytes_of_stored_weights() -> None:
    """The default model served as stored (Q4_1 matmul weights, the tied embedding Q8_0, float32
    norms): MBU counts those bytes, not float32's (it once said 5x too much of a stored step)."""
    from benchmarks import roofline as rl

    hw = rl.load_hardware("cpu-peers-md")
    records = trace()
    report = summarize_run(records, duration_s=2.0)
    formats = {"wqkv": "q4_1", "wo": "q4_1", "w_gate_up": "q4_1", "w_down": "q4_1", "embed": "q8_0"}
    info = _smollm2_info(weights="stored", weight_formats=formats)
    roof = roofline_report(info, hw, "line", records, 2.0, report, fallback_batch=3)
    embed, norms = 49152 * 576, 61 * 576
    matmul = 134_515_008 - embed - norms
    held = matmul // 32 * 20 + embed // 32 * 34 + norms * 4  # Q4_1: 20 bytes per 32 weights; Q8_0: 34
    nbytes = held + 13 * 46_080  # batch 1 at 13 positions, the float32 KV cache as before
    assert roof["tpot_mbu"] == pytest.approx(nbytes / 75e-3 / 25e9)
    assert roof["weights"] == "stored" and "stored weights, float32 activations;" in format_report(
        {**report, "roofline": roof}
    )


def test_write_report_turns_nan_into_null(tmp_path: Path) -> None:
    report = summarize_run([], duration_s=0.0)
    write_report(report, tmp_path / "r.json")
    loaded = json.loads((tmp_path / "r.json").read_text())
    assert loaded["ttft_ms"]["p50"] is None and loaded["completed"] == 0


def test_parse_range_and_config_checks() -> None:
    assert parse_range("128") == (128, 128)
    assert parse_range("64:256") == (64, 256)
    for bad in ("0", "9:3", "x", "1:y"):
        with pytest.raises(ValueError):
            parse_range(bad)
    with pytest.raises(ValueError, match="rate"):
        BenchConfig(concurrency=None, rate=0.0)
    with pytest.raises(ValueError, match="concurrency"):
        BenchConfig(concurrency=None, rate=None)
    with pytest.raises(ValueError, match="concurrency"):
        BenchConfig(concurrency=0)
    with pytest.raises(ValueError, match="slo_ttft_ms"):
        BenchConfig(slo_ttft_ms=-1.0)
    with pytest.raises(ValueError, match="timeout"):
        BenchConfig(timeout_s=0.0)


def test_poisson_offsets_are_seeded() -> None:
    a = poisson_offsets(2000, 50.0, np.random.default_rng(1))
    assert a == poisson_offsets(2000, 50.0, np.random.default_rng(1))
    assert a[0] == 0.0 and a == sorted(a)
    assert a[-1] / 1999 == pytest.approx(1 / 50.0, rel=0.1)  # mean gap 1/rate


def test_synthetic_specs_have_exact_lengths() -> None:
    specs = synthetic_specs(50, (3, 9), (2, 4), vocab_size=10, rng=np.random.default_rng(0), exclude_ids=[2])
    assert all(3 <= s.sent_prompt_tokens <= 9 and 2 <= s.max_tokens <= 4 for s in specs)
    assert all(2 not in s.token_ids for s in specs if s.token_ids is not None)
    assert {s.sent_prompt_tokens for s in specs} == set(range(3, 10))


def test_load_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi", "max_tokens": 5}\n\n{"prompt": "yo"}\n{"token_ids": [1, 2]}\n')
    specs = load_jsonl(path, (7, 7), np.random.default_rng(0))
    assert [(s.prompt, s.token_ids, s.max_tokens) for s in specs] == [
        ("hi", None, 5),
        ("yo", None, 7),
        (None, (1, 2), 7),
    ]
    path.write_text('{"prompt": "hi"}\n{"text": "x"}\n')
    with pytest.raises(ValueError, match=":2:"):
        load_jsonl(path, (7, 7), np.random.default_rng(0))
    path.write_text('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}\n')
    (chat,) = load_jsonl(path, (7, 7), np.random.default_rng(0))
    assert chat.chat == (("user", "hi"),) and chat.prompt is None and chat.max_tokens == 3


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": 5}', "prompt must be a non-empty string"),
        ('{"prompt": ""}', "prompt must be a non-empty string"),
        ('{"prompt": "a", "token_ids": [1]}', "exactly one of"),
        ('{"token_ids": [1, "x"]}', "token_ids must be a non-empty list of integers"),
        ('{"token_ids": []}', "token_ids must be a non-empty list of integers"),
        ('{"messages": [{"role": "user"}]}', "messages must be a non-empty list"),
        ('{"prompt": "a", "max_tokens": "5"}', "max_tokens must be an integer >= 1"),
        ('{"prompt": "a", "max_tokens": 0}', "max_tokens must be an integer >= 1"),
        ("[1, 2]", "exactly one of"),
        ("{not json", ":1:"),
    ],
)
def test_load_jsonl_rejects_malformed_lines(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message) as exc:
        load_jsonl(path, (7, 7), np.random.default_rng(0))
    assert str(exc.value).startswith(f"{path}:1:")
    with pytest.raises(ValueError, match="cannot read"):
        load_jsonl(tmp_path / "missing.jsonl", (7, 7), np.random.default_rng(0))


# ---- against a real server on a tiny random model (conftest's tiny_server) -----------------------------
def _check_sane(report: dict, n: int) -> None:
    assert report["num_requests"] == n and report["completed"] == n and report["failed"] == 0
    assert report["output_tokens"] > 0 and report["prompt_tokens"] > 0
    assert report["output_tokens"] <= report["requested_output_tokens"]
    assert report["duration_s"] > 0 and report["output_tokens_per_s"] > 0
    assert report["total_tokens_per_s"] > report["output_tokens_per_s"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = report[key]
        assert s["count"] > 0
        assert 0 <= s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"], key
    assert report["ttft_ms"]["p50"] <= report["e2e_ms"]["p50"] or report["ttft_ms"]["count"] == n
    assert len(report["requests"]) == n
    roof = report["roofline"]
    assert roof["layout"] == "single" and (roof["dp"], roof["tp"]) == (1, 1) and roof["batch"] >= 1
    for key in ("predicted_tpot_ms", "predicted_ttft_ms", "tpot_mbu", "tpot_mfu", "ttft_mfu", "mean_decoding_streams"):
        assert math.isfinite(roof[key]) and roof[key] > 0, key


def test_bench_cli_closed_loop(tiny_server, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    from benchmarks.cli import main

    out = tmp_path / "bench.json"
    argv = ["bench", "--address", tiny_server.address, "-n", "6", "--warmup", "1", "--concurrency", "2"]
    argv += [
        "--prompt-len",
        "4:12",
        "--output-len",
        "4:8",
        "--slo-ttft-ms",
        "60000",
        "--out",
        str(out),
        "--no-progress",
        "--hardware",
        "cpu-peers-md",
    ]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    _check_sane(report, 6)
    # Prompts are token ids: the server counts exactly what was sent.
    assert all(4 <= r["prompt_tokens"] <= 12 for r in report["requests"])
    assert all(r["output_tokens"] <= r["max_tokens"] <= 8 for r in report["requests"])
    assert report["server"]["num_slots"] == 2 and report["config"]["concurrency"] == 2
    text = capsys.readouterr().out
    assert "TTFT" in text and "goodput (TTFT <= 60000 ms)" in text
    assert "hardware 'cpu-peers-md'" in text and "MBU" in text and "MFU" in text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--concurrency", "0"], "must be >= 1"),
        (["--slo-ttft-ms", "-1"], "must be > 0"),
        (["--hardware", "nosuch"], "unknown --hardware 'nosuch'"),
        (["--out", "/nonexistent-dir/x.json"], "no folder /nonexistent-dir"),
    ],
)
def test_bench_cli_rejects_bad_flags_before_sending(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.cli import main

    with pytest.raises(SystemExit) as exc:  # no server at this address: nothing may be sent first
        main(["bench", "--address", "127.0.0.1:9", "-n", "1", *extra])
    assert message in str(exc.value.code) + capsys.readouterr().err


def test_bench_cli_exits_1_when_every_request_fails(  # type: ignore[no-untyped-def]
    tiny_server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.cli import main

    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"token_ids": [5] * 100, "max_tokens": 100}) + "\n")  # past max_seq_len 128
    out = tmp_path / "r.json"
    argv = ["bench", "--address", tiny_server.address, "-n", "2", "--warmup", "0", "--dataset", str(data)]
    assert main([*argv, "--no-progress", "--hardware", "none", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["completed"] == 0 and report["errors"] == {"INVALID_ARGUMENT": 2}
    assert "128" in report["error_details"]["INVALID_ARGUMENT"]  # the server's reason, with the limit
    assert "every request failed" in capsys.readouterr().err


def test_bench_poisson_with_dataset(tiny_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from benchmarks import roofline as rl
    from benchmarks.bench import run_bench

    monkeypatch.setattr(rl, "measure_cpu", lambda: (20e9, 100e9))  # "auto" on a CPU server: no measuring here

    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "the hint", "max_tokens": 5}\n{"token_ids": [10, 11, 12], "max_tokens": 3}\n')
    cfg = BenchConfig(
        address=tiny_server.address,
        num_requests=4,
        warmup=0,
        concurrency=None,
        rate=20.0,
        dataset=str(data),
        progress=False,
    )
    report = run_bench(cfg)
    _check_sane(report, 4)
    assert [r["max_tokens"] for r in report["requests"]] == [5, 3, 5, 3]
    starts = [r["start_s"] for r in report["requests"]]
    assert starts == sorted(starts)
    assert "hardware 'cpu-this-machine' (20.0 GB/s, 100 GFLOP/s float32)" in report["roofline"]["hardware"]


@pytest.mark.parametrize("client", ["openai", "raw"])
def test_bench_both_apis_side_by_side(
    tiny_server, tmp_path: Path, capsys: pytest.CaptureFixture[str], client: str
) -> None:  # type: ignore[no-untyped-def]
    """The same greedy requests over gRPC and over the OpenAI-compatible HTTP API, with either
    HTTP client: the same tokens (counted from usage over HTTP), and the comparison of the two."""
    from benchmarks.cli import main

    out = tmp_path / "both.json"
    argv = ["bench", "--address", tiny_server.address, "--api", "both", "--http-address",
            f"127.0.0.1:{tiny_server.running.http_port}", "--http-client", client, "-n", "4", "--warmup", "1",
            "--concurrency", "2", "--prompt-len", "4:8", "--output-len", "3:6", "--out", str(out), "--no-progress",
            "--hardware", "cpu-peers-md"]  # fmt: skip
    assert main(argv) == 0
    both = json.loads(out.read_text())
    for api in ("grpc", "openai"):
        _check_sane(both[api], 4)
        assert both[api]["config"]["api"] == api
    assert both["openai"]["config"]["http_client"] == client and both["comparison"]["http_client"] == client
    by_api = {
        api: [(r["prompt_tokens"], r["output_tokens"]) for r in both[api]["requests"]] for api in ("grpc", "openai")
    }
    assert by_api["grpc"] == by_api["openai"]  # greedy, the same prompts: the same counts
    assert set(both["openai"]["finish_reasons"]) <= {"length", "stop"}
    c = both["comparison"]["ttft_ms"]["p50"]
    assert c["grpc"] == both["grpc"]["ttft_ms"]["p50"] and c["delta"] == pytest.approx(c["openai"] - c["grpc"])
    text = capsys.readouterr().out
    assert "--- over the OpenAI-compatible HTTP API" in text and "meshserve-bench bench over HTTP" in text
    assert f"{client} client)" in text and "client CPU per request (the load generator's own): gRPC" in text
    cpu = both["comparison"]["client_cpu_ms_per_request"]
    assert cpu["grpc"] == both["grpc"]["client_cpu_ms_per_request"] > 0 and cpu["openai"] > 0
    assert f"gRPC and the OpenAI-compatible HTTP API ({client} client), the same requests" in text and "TPOT" in text


def test_raw_client_counts_chat_and_records_the_servers_refusal(tiny_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``--http-client raw`` on chat turns and on a prompt past ``max_seq_len``: the same counts as
    gRPC for the one, ``HTTP 400`` with the server's message for the other (the official client's
    names)."""
    from benchmarks.bench import run_bench

    data = tmp_path / "mixed.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        {"token_ids": [5] * 100, "max_tokens": 100},
    ]
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    common = dict(address=tiny_server.address, num_requests=4, warmup=0, dataset=str(data), progress=False)
    http = f"127.0.0.1:{tiny_server.running.http_port}"
    raw = run_bench(BenchConfig(**common, api="openai", http_address=http, http_client="raw", hardware="none"))
    grpc = run_bench(BenchConfig(**common, hardware="none"))
    assert raw["completed"] == grpc["completed"] == 2 and raw["errors"] == {"HTTP 400": 2}
    assert "128" in raw["error_details"]["HTTP 400"]  # the server's reason, with the limit
    ok = [(r["prompt_tokens"], r["output_tokens"]) for r in raw["requests"] if r["error"] is None]
    assert ok == [(r["prompt_tokens"], r["output_tokens"]) for r in grpc["requests"] if r["error"] is None]


def test_raw_client_reconnects_and_reads_events_split_anywhere() -> None:
    """A server that closes each connection after one answer, sends the SSE body in chunks cut
    mid-event (and mid-line), and fails the third request mid-stream with an error event: the raw
    client opens a new connection for the second request, counts the tokens as the official
    client does (the last event's from usage), and records the error event as ``APIError``."""
    import socketserver
    import threading

    from benchmarks.bench import RawHTTPClient, RequestSpec, send_raw

    def event(obj: object) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    def choice(finish: str | None) -> dict:
        return {"id": "x", "choices": [{"index": 0, "text": "a", "finish_reason": finish}], "usage": None}

    good = event(choice(None)) * 2 + event(choice("length"))
    good += event({"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}})
    bad = event(choice(None)) + event({"error": {"message": "the engine loop died", "type": "server_error"}})
    answers = iter([good, good, bad])
    requests: list[bytes] = []

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                head += self.rfile.read(1)
            length = int(
                next(x for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:")).split(b":")[1]
            )
            requests.append(self.rfile.read(length))
            body = next(answers) + b"data: [DONE]\n\n"
            self.wfile.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            for i in range(0, len(body), 7):
                piece = body[i : i + 7]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")  # then the handler returns: the connection closes

    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        raw = RawHTTPClient(f"127.0.0.1:{server.server_address[1]}", timeout_s=10, model="m")
        cfg = BenchConfig(api="openai", http_client="raw")
        spec = RequestSpec(max_tokens=3, token_ids=(1, 2, 3))
        try:
            records = [send_raw(raw, spec, i, 0.0, cfg) for i in range(3)]
        finally:
            raw.close()
            server.shutdown()
    for r in records[:2]:
        assert (r.error, r.output_tokens, r.prompt_tokens, r.finish_reason) == (None, 3, 3, "length")
        assert r.ttft_s is not None and len(r.itl_s) == 2
    assert (records[2].error, records[2].error_detail, records[2].output_tokens) == (
        "APIError",
        "the engine loop died",
        1,
    )
    sent = [json.loads(b) for b in requests]
    assert sent[0] == {"model": "m", "max_tokens": 3, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}, "prompt": [1, 2, 3]}  # fmt: skip
    assert len(sent) == 3
