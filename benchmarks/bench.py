"""``meshserve-bench bench``: a load generator that reports serving latencies and throughput, over gRPC
or over the OpenAI-compatible HTTP API (``--api openai``: streamed completions or chat completions
with ``stream_options.include_usage``, sent by the official ``openai`` client or, with
``--http-client raw``, by ``RawHTTPClient``, a bare-socket client about as light as the gRPC one),
or both against one server in one run (``--api both``: the same requests over gRPC, then over
HTTP, and the two side by side).

Load: ``concurrency`` closed-loop clients (each sends its next request when the previous one
ends), or Poisson arrivals at ``rate`` requests/s (exponential gaps from a seeded generator;
``concurrency`` then caps the requests in flight, and one that waits for the cap is sent late).
Requests: synthetic prompts of random token ids sent as ``token_ids``, so prompt lengths are
exact, with ``max_tokens`` forced and greedy decoding (lengths fixed, ``N``, or uniform,
``LO:HI``); or the prompts of a JSONL file (``{"prompt": ..., "max_tokens": ...}`` per line). EOS
can end a request before ``max_tokens``: the report gives requested and generated counts.
Warm-up requests run first and are not counted.

Over HTTP every streamed event but a choice's last carries one token (the server sends one event per
token, text or not); the last carries the rest of ``usage.completion_tokens`` (0 after EOS, else 1).

Per request: TTFT (send to the first chunk with a token), inter-token latencies (the gap
between consecutive chunks with tokens, split evenly over a chunk's tokens; tokens that arrive
with the first one count as 0 so that there are n - 1 of them), TPOT (mean inter-token time after
the first token: (t_last - t_first) / (n - 1)), and end-to-end latency (send to the stream's
end). The run reports p50/p90/p99 of each, output and total tokens/s and requests/s over the
measured wall time (first send to last end), and goodput: completed requests per second that met
the SLO (TTFT <= X ms and TPOT <= Y ms; a request with one token has no TPOT and meets that part),
the metric of DistServe (Zhong et al. 2024, §2). It also reports the load generator's own CPU time
per request (this process, every thread, over the measured requests): on a machine that runs the
server too, a heavy client takes cores from it, and its own parsing is part of every latency.

Next to the measured TTFT and TPOT the report puts the roofline's prediction
(``benchmarks/roofline.py``) for the served model and the pool's layout (from ``GetModelInfo``) on
a hardware preset (``hardware``; "auto": this machine's CPU measured now, or the preset of the
server's accelerator, as ``meshserve-bench sweep`` picks it), and the measured MBU and MFU: the
roofline's bytes and FLOPs of one decode step over the p50 TPOT, and of one prefill over the p50
TTFT. The decode batch is the measured mean number of concurrently decoding streams (Little's law:
the sum of the requests' first-to-last-token times over the wall time) per replica, the context
the mean prompt plus half the mean output; the report says which values it used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from protos.meshserve.v1 import meshserve_pb2 as pb
from service.server.arg_types import nonnegative_float, nonnegative_int, positive_float, positive_int
from service.server.client import Client, make_request

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_HTTP_ADDRESS = "127.0.0.1:8000"
APIS = ("grpc", "openai")  # what one run speaks; --api both runs each
HTTP_CLIENTS = ("openai", "raw")  # what speaks HTTP: the official client, or RawHTTPClient

PERCENTILES = (50, 90, 99)


# ---- pure statistics --------------------------------------------------------------------------------
@dataclasses.dataclass
class RequestRecord:
    """One measured request. Times are seconds; ``start_s`` is relative to the run's start.

    Attributes:
        index: position in the run.
        prompt_tokens: the server's count (``usage.prompt_tokens``), or what was sent if it failed.
        max_tokens: requested output tokens.
        output_tokens: generated tokens received.
        start_s: when it was sent.
        ttft_s: send to the first chunk with a token (None if no token came).
        e2e_s: send to the end of the stream (or to the error).
        itl_s: inter-token latencies, ``output_tokens - 1`` of them.
        finish_reason: e.g. ``"FINISH_REASON_LENGTH"``; "" on error.
        error: the gRPC status code name, or None.
        error_detail: the server's message with that status ("" when none).
    """

    index: int
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    start_s: float
    ttft_s: float | None
    e2e_s: float
    itl_s: list[float]
    finish_reason: str = ""
    error: str | None = None
    error_detail: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Mean inter-token time after the first token; None with fewer than 2 tokens."""
        return sum(self.itl_s) / len(self.itl_s) if self.itl_s else None


def record_from_chunks(
    index: int,
    start_s: float,
    chunks: Sequence[tuple[float, int]],
    end_s: float,
    prompt_tokens: int,
    max_tokens: int,
    finish_reason: str = "",
    error: str | None = None,
    error_detail: str = "",
) -> RequestRecord:
    """Build a record from the arrival of each chunk.

    Args:
        start_s: send time, seconds since the run's start.
        chunks: (seconds since send, tokens in the chunk) for every chunk, in order.
        end_s: seconds from send to the end of the stream.
    """
    itl: list[float] = []
    ttft: float | None = None
    last = 0.0
    total = 0
    for t, n in chunks:
        if n <= 0:
            continue
        if ttft is None:
            ttft = t
            itl.extend([0.0] * (n - 1))
        else:
            itl.extend([(t - last) / n] * n)
        last = t
        total += n
    return RequestRecord(
        index=index,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        output_tokens=total,
        start_s=start_s,
        ttft_s=ttft,
        e2e_s=end_s,
        itl_s=itl,
        finish_reason=finish_reason,
        error=error,
        error_detail=error_detail,
    )


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear interpolation between order statistics (numpy's
    default, as vLLM's benchmark reports them); NaN for no values."""
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """count, mean, min, p50, p90, p99, max of ``values`` times ``scale`` (e.g. 1e3 for ms)."""
    xs = [v * scale for v in values]
    out: dict[str, float] = {"count": len(xs)}
    out["mean"] = float(np.mean(xs)) if xs else math.nan
    out["min"] = min(xs) if xs else math.nan
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(xs, q)
    out["max"] = max(xs) if xs else math.nan
    return out


def meets_slo(record: RequestRecord, ttft_ms: float | None, tpot_ms: float | None) -> bool:
    """Whether a completed request met TTFT <= ``ttft_ms`` and TPOT <= ``tpot_ms`` (None = no bound).

    A completed request that streamed no token (it ended at once, e.g. on EOS) is held to the TTFT
    bound by its end-to-end time, when its empty answer was known; it has no TPOT."""
    if not record.ok:
        return False
    ttft_s = record.ttft_s if record.ttft_s is not None else record.e2e_s
    if ttft_ms is not None and ttft_s * 1e3 > ttft_ms:
        return False
    tpot = record.tpot_s
    return not (tpot_ms is not None and tpot is not None and tpot * 1e3 > tpot_ms)


def goodput(
    records: Iterable[RequestRecord], duration_s: float, ttft_ms: float | None, tpot_ms: float | None
) -> dict[str, Any]:
    """Requests per second that completed within the SLO, and their share of all requests."""
    records = list(records)
    met = sum(meets_slo(r, ttft_ms, tpot_ms) for r in records)
    return {
        "slo_ttft_ms": ttft_ms,
        "slo_tpot_ms": tpot_ms,
        "requests": met,
        "fraction": met / len(records) if records else math.nan,
        "requests_per_s": met / duration_s if duration_s > 0 else math.nan,
    }


def first_error_details(records: Iterable[RequestRecord]) -> dict[str, str]:
    """Status code of the failed requests -> the server's message with the first of them."""
    details: dict[str, str] = {}
    for r in records:
        if r.error and r.error not in details:
            details[r.error] = r.error_detail
    return details


def summarize_run(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict[str, Any]:
    """The report of a run: counts, throughput over ``duration_s``, latency percentiles (ms),
    goodput."""
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: math.nan)
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(Counter(r.error for r in records if r.error)),
        "error_details": first_error_details(records),
        "finish_reasons": dict(Counter(r.finish_reason for r in ok)),
        "duration_s": duration_s,
        "prompt_tokens": prompt,
        "requested_output_tokens": sum(r.max_tokens for r in ok),
        "output_tokens": output,
        "requests_per_s": per_s(len(ok)),
        "output_tokens_per_s": per_s(output),
        "total_tokens_per_s": per_s(prompt + output),
        "ttft_ms": summarize([r.ttft_s for r in ok if r.ttft_s is not None], 1e3),
        "tpot_ms": summarize([t for r in ok if (t := r.tpot_s) is not None], 1e3),
        "itl_ms": summarize([x for r in ok for x in r.itl_s], 1e3),
        "e2e_ms": summarize([r.e2e_s for r in ok], 1e3),
        "goodput": goodput(records, duration_s, slo_ttft_ms, slo_tpot_ms),
    }


def format_report(report: dict[str, Any]) -> str:
    """The terminal table of a report from :func:`run_bench` (or :func:`summarize_run`)."""
    lines = []
    cfg = report.get("config")
    if cfg:
        load = (
            f"Poisson {cfg['rate']:g} req/s (seed {cfg['seed']})"
            + (f", at most {cfg['concurrency']} in flight" if cfg.get("concurrency") else "")
            if cfg.get("rate")
            else f"concurrency {cfg['concurrency']}"
        )
        server = report.get("server", {})
        over = (
            ""
            if cfg.get("api", "grpc") == "grpc"
            else f" over HTTP ({cfg['http_address']}, {cfg.get('http_client', 'openai')} client)"
        )
        lines.append(
            f"meshserve-bench bench{over}: {report['num_requests']} requests ({cfg['warmup']} warm-up not counted), {load}; "
            f"server {server.get('name', '?')}, layout {server.get('layout', '?')}, {server.get('num_slots', '?')} slots"
        )
    lines.append(
        f"completed {report['completed']}, failed {report['failed']}"
        + (f" {report['errors']}" if report["errors"] else "")
        + f"; {report['duration_s']:.2f} s"
    )
    for code, detail in report.get("error_details", {}).items():
        lines.append(f"  {code}: {detail or '(no message)'}")
    lines.append(
        f"requests/s {report['requests_per_s']:.2f}   output tokens/s {report['output_tokens_per_s']:.1f}   "
        f"total tokens/s {report['total_tokens_per_s']:.1f}"
    )
    lines.append(
        f"tokens: prompt {report['prompt_tokens']}, output {report['output_tokens']} of "
        f"{report['requested_output_tokens']} requested; finish {report['finish_reasons']}"
        + (
            f"; client CPU {report['client_cpu_ms_per_request']:.2f} ms per request"
            if "client_cpu_ms_per_request" in report
            else ""
        )
    )
    roof = report.get("roofline", {})
    pred = "predicted_tpot_ms" in roof
    extra = {
        "ttft_ms": f" {roof.get('predicted_ttft_ms', 0):9.2f} {'-':>7s} {roof.get('ttft_mfu', 0):7.2%}",
        "tpot_ms": f" {roof.get('predicted_tpot_ms', 0):9.2f} {roof.get('tpot_mbu', 0):7.2%} {roof.get('tpot_mfu', 0):7.2%}",
    }
    head = f" {'roofline':>9s} {'MBU':>7s} {'MFU':>7s}" if pred else ""
    lines.append(f"{'(ms)':10s} {'mean':>9s} {'p50':>9s} {'p90':>9s} {'p99':>9s} {'max':>9s} {'n':>7s}{head}")
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        s = report[key]
        lines.append(
            f"{label:10s} {s['mean']:9.2f} {s['p50']:9.2f} {s['p90']:9.2f} {s['p99']:9.2f} {s['max']:9.2f} "
            f"{s['count']:7d}" + (extra.get(key, "") if pred else "")
        )
    if pred:
        held = (
            roof["dtype"]
            if roof.get("weights", roof["dtype"]) == roof["dtype"]
            else f"{roof['weights']} weights, {roof['dtype']} activations"
        )
        lines.append(
            f"{roof['hardware']}; layout {roof['layout']} (dp {roof['dp']}, tp {roof['tp']}, attention "
            f"{roof['attention']}), {held}; decode batch {roof['batch']} per replica ({roof['batch_from']}), "
            f"context {roof['context_len']} tokens (mean prompt "
            f"{roof['mean_prompt_tokens']:.1f} + half the mean output {roof['mean_output_tokens']:.1f}); TTFT: "
            f"prefill of one {roof['prompt_len']}-token prompt; MBU and MFU of the p50 TPOT and p50 TTFT"
        )
    elif roof:
        lines.append(roof["hardware"])
    g = report["goodput"]
    slo = " and ".join(
        f"{name} <= {v:g} ms" for name, v in (("TTFT", g["slo_ttft_ms"]), ("TPOT", g["slo_tpot_ms"])) if v is not None
    )
    lines.append(
        f"goodput ({slo or 'no SLO: every completed request'}): {g['requests_per_s']:.2f} req/s, "
        f"{g['requests']} of {report['num_requests']} requests ({g['fraction']:.0%})"
    )
    return "\n".join(lines)


# ---- against the roofline ----------------------------------------------------------------------------
def held_weights(info: Any, cfg: Any) -> Any:
    """The roofline's ``HeldWeights`` of a pool whose ``ModelInfo.weight_formats`` names weights
    held as blocks (stored GGUF blocks, int8), so that MBU counts the bytes a step reads (a Q4_1
    model's are about a fifth of float32's); None when every weight is ``info.dtype``. Builds the
    pool's sharding plan (imports JAX)."""
    formats = dict(info.weight_formats)
    if not formats:
        return None
    from benchmarks import roofline as rl
    from sharding.layouts import Layout
    from sharding.plan import make_plan

    layout = Layout(info.layout, data=info.layout_data, model=info.layout_model, attention=info.attention)
    itemsize = rl.Workload(dtype=info.dtype).itemsize
    return rl.held_weights(cfg, make_plan(layout, cfg), itemsize, formats, info.weights)


def model_config(info: Any) -> Any:
    """The ``LlamaConfig`` of the served model from its ``ModelInfo`` (RoPE and norm constants are
    not in ModelInfo and not used by the roofline: placeholders)."""
    from model.config import LlamaConfig

    return LlamaConfig(
        vocab_size=info.vocab_size,
        hidden_size=info.hidden_size,
        intermediate_size=info.intermediate_size,
        num_layers=info.num_layers,
        num_heads=info.num_heads,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=info.context_length,
        tie_word_embeddings=info.tie_word_embeddings,
    )


def mean_decoding_streams(records: Iterable[RequestRecord], duration_s: float) -> float:
    """Time-average number of requests between their first and last token over the run (Little's
    law: the sum of each completed request's first-to-last-token time, divided by ``duration_s``)."""
    busy = sum(sum(r.itl_s) for r in records if r.ok)
    return busy / duration_s if duration_s > 0 else math.nan


def roofline_report(
    info: Any,
    hardware: Any,
    hardware_line: str,
    records: Sequence[RequestRecord],
    duration_s: float,
    summary: dict[str, Any],
    fallback_batch: int,
) -> dict[str, Any]:
    """The roofline's TPOT and TTFT for this run and the measured MBU and MFU (see the module
    docstring), or ``{"hardware": why not}``; never raises.

    Args:
        info: the server's ``ModelInfo`` (model dims and the pool's layout).
        hardware: a ``benchmarks.roofline.Hardware``, or None.
        summary: the :func:`summarize_run` report (its p50 TTFT and TPOT are the measured steps).
        fallback_batch: the batch to assume when no request decoded (the configured concurrency).
    """
    out: dict[str, Any] = {"hardware": hardware_line}
    if hardware is None:
        return out
    try:
        from benchmarks import roofline as rl

        cfg, par = model_config(info), rl.Parallelism(info.layout_data, info.layout_model, info.attention)
        ok = [r for r in records if r.ok]
        streams = mean_decoding_streams(ok, duration_s)
        measured = streams > 0
        batch = max(1, round((streams if measured else fallback_batch) / par.dp))
        prompt = float(np.mean([r.prompt_tokens for r in ok])) if ok else 0.0
        output = float(np.mean([r.output_tokens for r in ok])) if ok else 0.0
        context, prompt_len = round(prompt + output / 2), max(1, round(prompt))
        held = held_weights(info, cfg)
        tpot_s, ttft_s = summary["tpot_ms"]["p50"] / 1e3, summary["ttft_ms"]["p50"] / 1e3
        decode = rl.decode_utilization(cfg, hardware, par, batch, context, info.dtype, tpot_s, held=held)
        prefill = rl.prefill_utilization(cfg, hardware, par, prompt_len, info.dtype, ttft_s, held=held)
    except Exception as exc:  # a prediction must never lose a measurement
        out["hardware"] = f"{hardware_line}; no prediction: {type(exc).__name__}: {exc}"
        return out
    return {
        **out,
        "layout": info.layout,
        "dp": par.dp,
        "tp": par.tp,
        "attention": par.attention,
        "dtype": info.dtype,
        "weights": info.weights or info.dtype,
        "mean_decoding_streams": streams,
        "batch": batch,
        "batch_from": f"the measured mean of {streams:.2f} concurrently decoding streams over {par.dp} replica(s)"
        if measured
        else f"the configured concurrency {fallback_batch} over {par.dp} replica(s): no request decoded",
        "mean_prompt_tokens": prompt,
        "mean_output_tokens": output,
        "context_len": context,
        "prompt_len": prompt_len,
        "predicted_tpot_ms": decode.predicted_s * 1e3,
        "predicted_ttft_ms": prefill.predicted_s * 1e3,
        "tpot_mbu": decode.mbu,
        "tpot_mfu": decode.mfu,
        "ttft_mfu": prefill.mfu,
    }


# ---- requests -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request to send: ``token_ids``, ``prompt`` (raw text) or ``chat`` ((role, content)
    turns), and ``max_tokens``."""

    max_tokens: int
    token_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    chat: tuple[tuple[str, str], ...] | None = None

    @property
    def sent_prompt_tokens(self) -> int:
        return len(self.token_ids) if self.token_ids is not None else 0


def parse_range(text: str) -> tuple[int, int]:
    """``"128"`` -> (128, 128); ``"64:256"`` -> (64, 256), a uniform integer range, both ends included.

    Raises:
        ValueError: not an integer or range of integers >= 1, or LO > HI.
    """
    lo_s, _, hi_s = text.partition(":")
    try:
        lo, hi = int(lo_s), int(hi_s or lo_s)
    except ValueError:
        raise ValueError(f"expected N or LO:HI (integers), got {text!r}") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


def synthetic_specs(
    n: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    rng: np.random.Generator,
    exclude_ids: Iterable[int] = (),
) -> list[RequestSpec]:
    """``n`` requests of random token ids (never an id in ``exclude_ids``, e.g. EOS), lengths
    uniform in the inclusive ranges."""
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(exclude_ids, dtype=np.int64))
    specs = []
    for _ in range(n):
        p = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        o = int(rng.integers(output_len[0], output_len[1] + 1))
        specs.append(RequestSpec(max_tokens=o, token_ids=tuple(int(i) for i in rng.choice(allowed, p))))
    return specs


PROMPT_KEYS = ("prompt", "messages", "token_ids")  # a JSONL request's prompt, exactly one of these


def _spec_from_object(obj: Any, default_output_len: tuple[int, int], rng: np.random.Generator) -> RequestSpec:
    """One JSONL line's request; raises ValueError saying what is wrong with it."""
    if not isinstance(obj, dict) or sum(k in obj for k in PROMPT_KEYS) != 1:
        raise ValueError('needs exactly one of "prompt" (raw text), "messages" (chat) or "token_ids"')
    if "max_tokens" in obj:
        max_tokens = obj["max_tokens"]
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    else:
        max_tokens = int(rng.integers(default_output_len[0], default_output_len[1] + 1))
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ValueError(f"prompt must be a non-empty string, got {obj['prompt']!r}")
        return RequestSpec(max_tokens=max_tokens, prompt=obj["prompt"])
    if "messages" in obj:
        msgs = obj["messages"]
        ok = (
            isinstance(msgs, list)
            and msgs
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs
            )
        )
        if not ok:
            raise ValueError('messages must be a non-empty list of {"role": str, "content": str}')
        return RequestSpec(max_tokens=max_tokens, chat=tuple((m["role"], m["content"]) for m in msgs))
    ids = obj["token_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"token_ids must be a non-empty list of integers, got {ids!r}")
    return RequestSpec(max_tokens=max_tokens, token_ids=tuple(ids))


def load_jsonl(path: str | Path, default_output_len: tuple[int, int], rng: np.random.Generator) -> list[RequestSpec]:
    """Requests from a JSONL file, one object per line: exactly one of ``"prompt"`` (raw text,
    sent as is: no chat template), ``"messages"`` (chat turns ``[{"role": ..., "content": ...}]``,
    rendered by the server with the model's chat template) or ``"token_ids"``; and optionally
    ``"max_tokens"`` (else drawn from ``default_output_len``). Blank lines are skipped.

    Raises:
        ValueError: the file cannot be read, or a line is not such an object (the message gives
            the line number).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    specs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            specs.append(_spec_from_object(json.loads(line), default_output_len, rng))
        except ValueError as exc:  # json.JSONDecodeError is one
            raise ValueError(f"{path}:{lineno}: {exc}") from None
    if not specs:
        raise ValueError(f"{path}: no requests")
    return specs


# ---- running --------------------------------------------------------------------------------------
@dataclasses.dataclass
class BenchConfig:
    """Settings of one run (the ``meshserve-bench bench`` flags).

    Attributes:
        address: server host:port.
        num_requests: measured requests.
        warmup: requests sent first and not counted.
        concurrency: closed-loop clients; with ``rate``, the cap on requests in flight (None = none).
        rate: Poisson arrivals per second (None = closed loop).
        seed: seeds prompts, lengths and arrival gaps.
        prompt_len, output_len: (lo, hi) token counts, uniform; output = ``max_tokens``.
        dataset: JSONL file of prompts (cycled if shorter than the run), instead of synthetic ones.
        temperature: 0 = greedy.
        ignore_eos: generate ``max_tokens`` whatever the model says (vLLM's and llama.cpp's
            ``ignore_eos``), so that servers compared make as many tokens.
        layout: engine pool (or layout name) to send the requests to (over HTTP: the model id).
        api: "grpc", or "openai" for the OpenAI-compatible HTTP API at ``http_address``.
        http_address: host:port of the server's HTTP API (``serve --http-port``).
        http_client: over HTTP, "openai" (the official client) or "raw" (``RawHTTPClient``).
        timeout_s: deadline of each request.
        slo_ttft_ms, slo_tpot_ms: goodput SLO (None = no bound).
        hardware: roofline preset for the prediction, MBU and MFU ("auto": as ``meshserve-bench sweep``
            picks it; "none": no prediction).
        progress: show a progress bar on stderr.
    """

    address: str = "127.0.0.1:50051"
    num_requests: int = 100
    warmup: int = 2
    concurrency: int | None = 1
    rate: float | None = None
    seed: int = 0
    prompt_len: tuple[int, int] = (128, 128)
    output_len: tuple[int, int] = (128, 128)
    dataset: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    layout: str | None = None
    timeout_s: float = 600.0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    hardware: str = "auto"
    progress: bool = True
    api: str = "grpc"
    http_address: str = DEFAULT_HTTP_ADDRESS
    http_client: str = "openai"

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.warmup < 0:
            raise ValueError("num_requests must be >= 1 and warmup >= 0")
        if self.rate is None and not self.concurrency:
            raise ValueError("give a concurrency (closed loop) or a rate (Poisson arrivals)")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.api not in APIS:
            raise ValueError(f"api must be one of {', '.join(APIS)}, got {self.api!r}")
        if self.http_client not in HTTP_CLIENTS:
            raise ValueError(f"http_client must be one of {', '.join(HTTP_CLIENTS)}, got {self.http_client!r}")
        if not self.timeout_s > 0 or self.temperature < 0:
            raise ValueError(f"timeout must be > 0 s and temperature >= 0, got {self.timeout_s}, {self.temperature}")
        for name, bound in (("slo_ttft_ms", self.slo_ttft_ms), ("slo_tpot_ms", self.slo_tpot_ms)):
            if bound is not None and not bound > 0:
                raise ValueError(f"{name} must be > 0 ms, got {bound}")


def send(client: Any, spec: RequestSpec, index: int, run_start: float, cfg: BenchConfig) -> RequestRecord:
    """Send one request and time its chunks (never raises for a gRPC error: it is recorded)."""
    request = make_request(
        prompt=spec.prompt,
        chat=spec.chat,
        token_ids=spec.token_ids,
        max_tokens=spec.max_tokens,
        temperature=cfg.temperature,
        ignore_eos=cfg.ignore_eos or None,
        layout=cfg.layout,
        request_id=f"bench-{index}",
    )
    chunks: list[tuple[float, int]] = []
    finish, prompt_tokens, error, detail = "", spec.sent_prompt_tokens, None, ""
    t0 = time.perf_counter()
    try:
        for resp in client.stream(request, cfg.timeout_s):
            chunks.append((time.perf_counter() - t0, len(resp.token_ids)))
            if resp.finish_reason:
                finish, prompt_tokens = pb.FinishReason.Name(resp.finish_reason), resp.usage.prompt_tokens
    except grpc.RpcError as exc:
        error, detail = exc.code().name, exc.details() or ""
    end = time.perf_counter() - t0
    return record_from_chunks(index, t0 - run_start, chunks, end, prompt_tokens, spec.max_tokens, finish, error, detail)


@dataclasses.dataclass
class OpenAIClient:
    """The official client on the server's HTTP API and the model id that selects the pool."""

    client: Any  # openai.OpenAI
    model: str

    @classmethod
    def connect(cls, cfg: BenchConfig) -> OpenAIClient:
        """A client on ``cfg.http_address`` (no retries: a refusal is recorded, not retried).

        Raises:
            ImportError: the ``openai`` package (the ``bench`` extra) is missing.
            openai.APIError: ``/v1/models`` failed (the model id, when ``cfg.layout`` names none).
        """
        import openai

        client = openai.OpenAI(
            base_url=f"http://{cfg.http_address}/v1", api_key="unused", max_retries=0, timeout=cfg.timeout_s
        )
        model = cfg.layout or client.models.list().data[0].id
        return cls(client, model)

    def close(self) -> None:
        self.client.close()


def send_openai(oa: OpenAIClient, spec: RequestSpec, index: int, run_start: float, cfg: BenchConfig) -> RequestRecord:
    """Send one request over the OpenAI-compatible API, streamed, and time its events (never
    raises for an HTTP or stream error: it is recorded as ``HTTP <status>`` or the error's class).
    Token ids and raw prompts go to ``/v1/completions``, chat turns to ``/v1/chat/completions``."""
    import openai

    common: dict[str, Any] = dict(
        model=oa.model,
        max_tokens=spec.max_tokens,
        temperature=cfg.temperature,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-request-id": f"bench-{index}"},
        extra_body={"ignore_eos": True} if cfg.ignore_eos else None,
    )
    tally = _StreamTally(spec.sent_prompt_tokens)
    error, detail = None, ""
    t0 = time.perf_counter()
    try:
        if spec.chat is not None:
            messages = [{"role": r, "content": c} for r, c in spec.chat]
            stream = oa.client.chat.completions.create(messages=messages, **common)
        else:
            prompt = list(spec.token_ids) if spec.token_ids is not None else spec.prompt
            stream = oa.client.completions.create(prompt=prompt, **common)
        for event in stream:
            usage = event.usage
            tally.add(
                time.perf_counter() - t0,
                None if usage is None else (usage.prompt_tokens, usage.completion_tokens),
                [choice.finish_reason for choice in event.choices],
            )
    except openai.APIStatusError as exc:
        error, detail = f"HTTP {exc.status_code}", exc.message
    except openai.APIError as exc:  # a connection error, or an error event mid-stream
        error, detail = type(exc).__name__, exc.message
    end = time.perf_counter() - t0
    return tally.record(index, t0 - run_start, end, spec.max_tokens, error, detail)


class _StreamTally:
    """The chunks of one streamed OpenAI answer as its events arrive: an event's choice without a
    finish_reason carries one token; a choice's last carries what ``usage.completion_tokens``
    counts beyond the others (0 after EOS, else 1), known from the usage event."""

    def __init__(self, prompt_tokens: int):
        self.chunks: list[tuple[float, int]] = []
        self.finish = ""
        self.prompt_tokens = prompt_tokens
        self.counted = 0  # tokens in the events before a choice's last
        self.last: int | None = None  # the last event's place in chunks

    def add(self, t: float, usage: tuple[int, int] | None, finish_reasons: Sequence[str | None]) -> None:
        """One event at ``t`` s after sending: its usage (prompt, completion tokens) if it has one,
        and each of its choices' finish_reason."""
        if usage is not None:
            self.prompt_tokens = usage[0]
            if self.last is not None:
                self.chunks[self.last] = (self.chunks[self.last][0], usage[1] - self.counted)
        for reason in finish_reasons:
            if reason is not None:
                self.finish, self.last = reason, len(self.chunks)
                self.chunks.append((t, 0))
            else:
                self.chunks.append((t, 1))
                self.counted += 1

    def record(
        self, index: int, start_s: float, end_s: float, max_tokens: int, error: str | None, detail: str
    ) -> RequestRecord:
        return record_from_chunks(
            index, start_s, self.chunks, end_s, self.prompt_tokens, max_tokens, self.finish, error, detail
        )


class RawHTTPError(Exception):
    """An answer the raw client could not take: an error status (``status``; its OpenAI error
    message as the text), or a connection that broke or spoke no HTTP/1.1 (``status`` 0)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class _Connection:
    """One keep-alive HTTP/1.1 connection with Nagle off. A request goes out in one write; the
    answer is read off the socket as it comes (a Content-Length body, or chunked)."""

    def __init__(self, host: str, port: int, timeout_s: float):
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        self.reused = False  # has answered a request before (the server may have closed it since)

    def close(self) -> None:
        self.sock.close()

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionResetError("the server closed the connection")
        self.buf += data

    def _line(self) -> bytes:
        while (i := self.buf.find(b"\r\n")) < 0:
            self._fill()
        line, self.buf = self.buf[:i], self.buf[i + 2 :]
        return line

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def send(self, head: bytes, body: bytes) -> tuple[int, dict[bytes, bytes]]:
        """Send one request; return the answer's status and headers (names lowercased)."""
        self.sock.sendall(head + body)
        status_line = self._line()
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise RawHTTPError(0, f"not an HTTP/1.1 status line: {status_line[:80]!r}")
        headers = {}
        while line := self._line():
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        self.reused = True
        return int(parts[1]), headers

    def body(self, headers: dict[bytes, bytes]) -> Iterator[bytes]:
        """The answer's body as it arrives (a chunk at a time when chunked); read it to its end
        before the next request."""
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            while size := int(self._line().split(b";")[0], 16):
                yield self._exactly(size)
                self._exactly(2)  # the chunk's CRLF
            while self._line():  # trailers, then the empty line
                pass
        else:
            yield self._exactly(int(headers.get(b"content-length", b"0")))


class RawHTTPClient:
    """``--http-client raw``: streamed requests over bare sockets, the HTTP API's counterpart of
    the gRPC client in weight. Per request it writes one JSON body; per event it splits the SSE
    lines and runs ``json.loads``, as the gRPC client parses one message per token. The official
    client builds typed request options and a pydantic object per event, about 4 ms more per
    request on the tiny model (docs/performance.md): a cost of that client, not of the server.

    Keep-alive connections (``TCP_NODELAY``), one per request in flight, kept between requests
    (and runs: the warm-up's serve the measured requests) and opened again when the server closed
    one between two requests.

    Args:
        address: the HTTP API's host:port.
        timeout_s: each socket operation's limit.
        model: the model id sent in each request.
    """

    def __init__(self, address: str, timeout_s: float, model: str = ""):
        host, _, port = address.rpartition(":")
        self.host, self.port, self.timeout_s, self.model = host.strip("[]"), int(port), timeout_s, model
        self._idle: list[_Connection] = []  # kept-alive connections no request holds
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, cfg: BenchConfig) -> RawHTTPClient:
        """A client on ``cfg.http_address`` with the model id of ``cfg.layout`` or, when it names
        none, the first of ``/v1/models``.

        Raises:
            RawHTTPError: ``/v1/models`` failed. OSError: no server there.
        """
        client = cls(cfg.http_address, cfg.timeout_s)
        if cfg.layout:
            client.model = cfg.layout
        else:
            status, body = client.get("/v1/models")
            if status != 200:
                raise RawHTTPError(status, _error_message(body))
            client.model = json.loads(body)["data"][0]["id"]
        return client

    def close(self) -> None:
        """Close the idle connections (those of requests still running close as they end)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _connection(self) -> _Connection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _Connection(self.host, self.port, self.timeout_s)

    def _drop(self, conn: _Connection) -> None:
        conn.close()

    def _open(self, method: str, path: str, body: bytes, extra: str) -> tuple[_Connection, int, dict[bytes, bytes]]:
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n"
        ).encode()
        for attempt in (0, 1):
            conn = self._connection()
            try:
                status, headers = conn.send(head, body)
            except (ConnectionError, RawHTTPError):
                self._drop(conn)
                if attempt or not conn.reused:  # a fresh connection failed: no retry
                    raise
                continue  # a kept-alive connection the server had closed: once more, on a new one
            except BaseException:
                self._drop(conn)
                raise
            return conn, status, headers
        raise AssertionError("unreachable")

    def _done(self, conn: _Connection, headers: dict[bytes, bytes]) -> None:
        """The answer was read to its end: keep the connection for the next request, unless the
        server said it closes it."""
        if headers.get(b"connection", b"").lower() == b"close":
            conn.close()
        else:
            with self._lock:
                self._idle.append(conn)

    def get(self, path: str) -> tuple[int, bytes]:
        """``GET path``: the status and the whole body."""
        conn, status, headers = self._open("GET", path, b"", "")
        try:
            body = b"".join(conn.body(headers))
        except BaseException:
            self._drop(conn)
            raise
        self._done(conn, headers)
        return status, body

    def stream(self, path: str, body: dict[str, Any], request_id: str) -> Iterator[Any]:
        """POST ``body`` to ``path`` and yield each SSE event's JSON as it arrives, up to
        ``[DONE]``.

        Raises:
            RawHTTPError: an error status (``status``; OpenAI's message), an error event mid-stream
                (``status`` 200), or a broken answer (0).
        """
        data = json.dumps(body, separators=(",", ":")).encode()
        conn, status, headers = self._open(
            "POST", path, data, f"Accept: text/event-stream\r\nx-request-id: {request_id}\r\n"
        )
        try:
            if status != 200:
                raise RawHTTPError(status, _error_message(b"".join(conn.body(headers))))
            pending = b""
            for piece in conn.body(headers):
                pending += piece
                while (i := pending.find(b"\n\n")) >= 0:
                    event, pending = pending[:i], pending[i + 2 :]
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        text = line[5:].lstrip(b" ")
                        if text == b"[DONE]":
                            continue  # the body ends next
                        obj = json.loads(text)
                        if "error" in obj:
                            raise RawHTTPError(200, str(obj["error"].get("message", obj["error"])))
                        yield obj
        except BaseException:
            self._drop(conn)  # the rest of the answer is unread: this connection is done
            raise
        self._done(conn, headers)


def _error_message(body: bytes) -> str:
    """OpenAI's error message in ``body``, else the body's start."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", errors="replace")


def send_raw(raw: RawHTTPClient, spec: RequestSpec, index: int, run_start: float, cfg: BenchConfig) -> RequestRecord:
    """:func:`send_openai`'s request and timing with :class:`RawHTTPClient` (never raises for an
    HTTP or stream error: it is recorded as ``HTTP <status>``, or ``APIError`` for an error event
    mid-stream and ``APIConnectionError`` for a connection that failed, the official client's
    names)."""
    body: dict[str, Any] = {
        "model": raw.model,
        "max_tokens": spec.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if spec.chat is not None:
        path, body["messages"] = "/v1/chat/completions", [{"role": r, "content": c} for r, c in spec.chat]
    else:
        path, body["prompt"] = "/v1/completions", list(spec.token_ids) if spec.token_ids is not None else spec.prompt
    tally = _StreamTally(spec.sent_prompt_tokens)
    error, detail = None, ""
    t0 = time.perf_counter()
    try:
        for event in raw.stream(path, body, f"bench-{index}"):
            usage = event.get("usage")
            tally.add(
                time.perf_counter() - t0,
                None if usage is None else (usage["prompt_tokens"], usage["completion_tokens"]),
                [choice["finish_reason"] for choice in event["choices"]],
            )
    except RawHTTPError as exc:
        error = f"HTTP {exc.status}" if exc.status not in (0, 200) else "APIError"
        detail = exc.message
    except OSError as exc:  # refused, reset, timed out
        error, detail = "APIConnectionError", str(exc) or type(exc).__name__
    end = time.perf_counter() - t0
    return tally.record(index, t0 - run_start, end, spec.max_tokens, error, detail)


def poisson_offsets(n: int, rate: float, rng: np.random.Generator) -> list[float]:
    """Send times (seconds from the start) of ``n`` Poisson arrivals at ``rate``/s; the first at 0."""
    gaps = rng.exponential(1.0 / rate, size=max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


def run_specs(
    client: Any,
    specs: Sequence[RequestSpec],
    cfg: BenchConfig,
    offsets: Sequence[float] | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send ``specs`` (closed loop at ``cfg.concurrency``, or at ``offsets`` seconds from the
    start) with ``client`` (a ``Client`` for gRPC; for ``cfg.api`` "openai" an ``OpenAIClient``, or
    a ``RawHTTPClient`` with ``cfg.http_client`` "raw");
    return the records in index order and the wall time from the first send to the last end."""
    sender = send if cfg.api == "grpc" else send_raw if cfg.http_client == "raw" else send_openai
    workers = cfg.concurrency if offsets is None else min(cfg.concurrency or len(specs), len(specs))
    workers = max(1, min(workers or 1, len(specs)))
    run_start = time.perf_counter()

    def done(fut: Future[RequestRecord]) -> None:  # on a worker thread, as each request ends
        if on_done is not None and fut.exception() is None:
            on_done(fut.result())

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bench") as pool:
        futures = []
        for i, spec in enumerate(specs):
            if offsets is not None:
                delay = run_start + offsets[i] - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            futures.append(pool.submit(sender, client, spec, i, run_start, cfg))
            futures[-1].add_done_callback(done)
        # In index order; re-raises anything but a gRPC error (those are recorded).
        records = [fut.result() for fut in futures]
    first = min(r.start_s for r in records)
    last = max(r.start_s + r.e2e_s for r in records)
    return records, last - first


def run_bench(cfg: BenchConfig, client: Any = None) -> dict[str, Any]:
    """Run warm-up and measured requests against the server over ``cfg.api``; return the report
    (JSON-ready). The model's facts come from gRPC's ``GetModelInfo`` at ``cfg.address`` in
    either case.

    Raises:
        ValueError: a request would not fit the server's ``max_seq_len``, or a bad dataset.
        grpc.RpcError: ``GetModelInfo`` failed (no server, or not serving yet). Errors of the
            benchmark's own requests are recorded in the report instead.
        openai.APIError: with ``api`` "openai", ``/v1/models`` failed.
    """
    from tqdm import tqdm

    own = client is None
    if client is None:
        client = Client(cfg.address)
    try:
        info = client.stub.GetModelInfo(pb.GetModelInfoRequest(layout=cfg.layout or ""), timeout=10)
        from benchmarks.sweep import pick_hardware  # before the load: "auto" on a CPU measures it

        hardware, hardware_line = pick_hardware(cfg.hardware, info.platform, info.device_kind)
        sender: Any = (
            client
            if cfg.api == "grpc"
            else RawHTTPClient.connect(cfg)
            if cfg.http_client == "raw"
            else OpenAIClient.connect(cfg)
        )
        rng = np.random.default_rng(cfg.seed)
        total = cfg.warmup + cfg.num_requests
        if cfg.dataset:
            pool = load_jsonl(cfg.dataset, cfg.output_len, rng)
            specs = [pool[i % len(pool)] for i in range(total)]
        else:
            if cfg.prompt_len[1] + cfg.output_len[1] > info.max_seq_len:
                raise ValueError(
                    f"prompt {cfg.prompt_len[1]} + output {cfg.output_len[1]} tokens exceed the server's "
                    f"max_seq_len {info.max_seq_len}"
                )
            specs = synthetic_specs(total, cfg.prompt_len, cfg.output_len, info.vocab_size, rng, info.eos_token_ids)
        offsets = poisson_offsets(cfg.num_requests, cfg.rate, rng) if cfg.rate else None
        if cfg.warmup:
            run_specs(sender, specs[: cfg.warmup], dataclasses.replace(cfg, concurrency=cfg.concurrency or 1))
        with tqdm(total=cfg.num_requests, desc="bench", unit="req", disable=not cfg.progress, leave=False) as bar:
            cpu0 = time.process_time()
            records, duration = run_specs(sender, specs[cfg.warmup :], cfg, offsets, on_done=lambda _r: bar.update())
            client_cpu_s = time.process_time() - cpu0
        if sender is not client:
            sender.close()
    finally:
        if own:
            client.close()
    report: dict[str, Any] = {
        "config": {
            **dataclasses.asdict(cfg),
            "prompt_len": list(cfg.prompt_len),
            "output_len": list(cfg.output_len),
        },
        "server": {
            "name": info.name,
            "layout": info.layout,
            "num_slots": info.num_slots,
            "max_seq_len": info.max_seq_len,
            "dtype": info.dtype,
            "num_parameters": info.num_parameters,
        },
        **summarize_run(records, duration, cfg.slo_ttft_ms, cfg.slo_tpot_ms),
        # The load generator's own weight: this process's CPU time (every thread) over the measured
        # requests, per request. Only the client's: a server on this machine runs in its own process.
        "client_cpu_ms_per_request": client_cpu_s / len(records) * 1e3,
        "requests": [{**dataclasses.asdict(r), "tpot_s": r.tpot_s} for r in records],
    }
    report["roofline"] = roofline_report(
        info, hardware, hardware_line, records, duration, report, cfg.concurrency or info.num_slots
    )
    return report


COMPARED = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def compare_reports(grpc_report: dict[str, Any], openai_report: dict[str, Any]) -> dict[str, Any]:
    """The HTTP API against gRPC for the same requests: per latency (TTFT, TPOT, ITL, E2E), the
    mean, p50 and p90 of each (ms), their difference (HTTP minus gRPC, ms) and ratio, the
    output tokens/s of each, which HTTP client ran (``http_client``) and each client's CPU time per
    request."""
    out: dict[str, Any] = {}
    for key, _ in COMPARED:
        a, b = grpc_report[key], openai_report[key]
        out[key] = {
            stat: {
                "grpc": a[stat],
                "openai": b[stat],
                "delta": b[stat] - a[stat],
                "ratio": b[stat] / a[stat] if a[stat] else math.nan,
            }
            for stat in ("mean", "p50", "p90")
        }
    out["output_tokens_per_s"] = {
        "grpc": grpc_report["output_tokens_per_s"],
        "openai": openai_report["output_tokens_per_s"],
    }
    out["http_client"] = openai_report.get("config", {}).get("http_client", "openai")
    if "client_cpu_ms_per_request" in grpc_report and "client_cpu_ms_per_request" in openai_report:
        out["client_cpu_ms_per_request"] = {
            "grpc": grpc_report["client_cpu_ms_per_request"],
            "openai": openai_report["client_cpu_ms_per_request"],
        }
    return out


def format_comparison(comparison: dict[str, Any]) -> str:
    """The side-by-side table of :func:`compare_reports`."""
    lines = [
        f"gRPC and the OpenAI-compatible HTTP API ({comparison.get('http_client', 'openai')} client), the same "
        "requests (ms; delta = HTTP - gRPC):",
        f"{'':6s} {'gRPC p50':>9s} {'HTTP p50':>9s} {'delta':>8s} {'ratio':>6s}   "
        f"{'gRPC p90':>9s} {'HTTP p90':>9s} {'delta':>8s}   {'gRPC mean':>9s} {'HTTP mean':>9s} {'delta':>8s}",
    ]
    for key, label in COMPARED:
        c = comparison[key]
        p50, p90, mean = c["p50"], c["p90"], c["mean"]
        lines.append(
            f"{label:6s} {p50['grpc']:9.2f} {p50['openai']:9.2f} {p50['delta']:+8.2f} {p50['ratio']:6.3f}   "
            f"{p90['grpc']:9.2f} {p90['openai']:9.2f} {p90['delta']:+8.2f}   "
            f"{mean['grpc']:9.2f} {mean['openai']:9.2f} {mean['delta']:+8.2f}"
        )
    tps = comparison["output_tokens_per_s"]
    lines.append(f"output tokens/s: gRPC {tps['grpc']:.1f}, HTTP {tps['openai']:.1f}")
    cpu = comparison.get("client_cpu_ms_per_request")
    if cpu:
        lines.append(
            f"client CPU per request (the load generator's own): gRPC {cpu['grpc']:.2f} ms, HTTP "
            f"({comparison.get('http_client', 'openai')} client) {cpu['openai']:.2f} ms"
        )
    return "\n".join(lines)


def write_report(report: dict[str, Any], path: str | Path) -> None:
    """Write the report as JSON (NaN written as null)."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        return x

    Path(path).write_text(json.dumps(clean(report), indent=1) + "\n", encoding="utf-8")


# ---- ``meshserve-bench bench`` ------------------------------------------------------------------------------
def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``meshserve-bench bench`` (``benchmarks/cli.py`` makes the subcommand)."""
    p.add_argument("--address", default=DEFAULT_ADDRESS, help="server host:port (default %(default)s)")
    p.add_argument(
        "--api",
        choices=["grpc", "openai", "both"],
        default="grpc",
        help="send over gRPC, over the OpenAI-compatible HTTP API at --http-address, or both in one run (the same "
        "requests, gRPC first) with the two side by side (%(default)s)",
    )
    p.add_argument(
        "--http-address",
        default=DEFAULT_HTTP_ADDRESS,
        help="the server's HTTP API host:port (serve --http-port) for --api openai|both (default %(default)s)",
    )
    p.add_argument(
        "--http-client",
        choices=HTTP_CLIENTS,
        default="openai",
        help="over HTTP: the official openai client, or raw, a bare-socket client about as light as the gRPC one "
        "(compares the servers' two layers rather than the clients) (default %(default)s)",
    )
    p.add_argument("-n", "--num-requests", type=positive_int, default=100, help="measured requests (%(default)s)")
    p.add_argument("--warmup", type=nonnegative_int, default=2, help="requests sent first, not counted (%(default)s)")
    p.add_argument(
        "--concurrency", type=positive_int, help="closed-loop clients (default 1); with --rate, the in-flight cap"
    )
    p.add_argument("--rate", type=positive_float, help="Poisson arrivals, requests/s (default: closed loop)")
    p.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals (%(default)s)")
    p.add_argument("--prompt-len", default="128", help="synthetic prompt tokens: N or LO:HI uniform (%(default)s)")
    p.add_argument("--output-len", default="128", help="max_tokens: N or LO:HI uniform (%(default)s)")
    p.add_argument("--dataset", help='JSONL of {"prompt": ..., "max_tokens": ...} instead of synthetic prompts')
    p.add_argument("--temperature", type=nonnegative_float, default=0.0, help="0 = greedy (%(default)s)")
    p.add_argument("--ignore-eos", action="store_true", help="every request makes max_tokens tokens")
    p.add_argument("--layout", help="engine pool (or its layout name) to send to")
    p.add_argument("--timeout", type=positive_float, default=600.0, help="per-request deadline, s (%(default)s)")
    p.add_argument("--slo-ttft-ms", type=positive_float, help="goodput: TTFT bound, ms")
    p.add_argument("--slo-tpot-ms", type=positive_float, help="goodput: TPOT bound, ms")
    p.add_argument(
        "--hardware",
        default="auto",
        help="roofline preset (configs/hardware.yaml) for the predicted TTFT/TPOT, MBU and MFU; 'auto': this CPU "
        "measured now (a remote CPU server: pass its preset), or the server's accelerator; 'none' (%(default)s)",
    )
    p.add_argument("--out", help="write the full report (and every request) as JSON here")
    p.add_argument("--wait", type=nonnegative_float, default=0, help="wait up to this many seconds for SERVING")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_from_args(args: argparse.Namespace) -> int:
    """Run ``meshserve-bench bench``: load-test the server at ``--address`` (over ``--api``), print the
    report, and with ``--out`` write it as JSON. ``--api both`` runs the same requests over gRPC,
    then over HTTP, prints both reports and the two side by side (:func:`format_comparison`), and
    writes ``{"grpc": ..., "openai": ..., "comparison": ...}``.

    Returns 0, or 1 when every measured request (of either run) failed. Exits with a message on
    bad flags, an unknown ``--hardware`` preset, an unwritable ``--out``, or a server that is not
    reachable.
    """
    from benchmarks import check_writable_file

    if args.out:
        check_writable_file(args.out, "meshserve-bench bench")
    if args.hardware not in ("auto", "none", ""):
        from benchmarks.roofline import hardware_names  # numpy and YAML only

        if args.hardware not in hardware_names():
            raise SystemExit(f"meshserve-bench bench: unknown --hardware {args.hardware!r}; presets: "
                             f"{', '.join(hardware_names())}, or auto, none")  # fmt: skip
    try:
        cfg = BenchConfig(
            address=args.address,
            num_requests=args.num_requests,
            warmup=args.warmup,
            concurrency=args.concurrency if args.concurrency is not None or args.rate else 1,
            rate=args.rate,
            seed=args.seed,
            prompt_len=parse_range(args.prompt_len),
            output_len=parse_range(args.output_len),
            dataset=args.dataset,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            layout=args.layout,
            timeout_s=args.timeout,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
            hardware=args.hardware,
            progress=not args.no_progress,
            api="grpc" if args.api == "both" else args.api,
            http_address=args.http_address,
            http_client=args.http_client,
        )
    except ValueError as exc:
        raise SystemExit(f"meshserve-bench bench: {exc}") from None
    apis = list(APIS) if args.api == "both" else [cfg.api]
    http_errors: tuple[type[Exception], ...] = (RawHTTPError,)  # /v1/models failed (or openai.APIError)
    if "openai" in apis and cfg.http_client == "openai":
        try:
            import openai
        except ImportError:
            raise SystemExit(
                "meshserve-bench bench: --api openai needs the openai package: pip install 'meshserve[bench]'"
            ) from None
        http_errors = (RawHTTPError, openai.APIError)
    client = Client(cfg.address)
    reports: dict[str, dict[str, Any]] = {}
    try:
        if args.wait:
            client.wait_serving(args.wait)
        for api in apis:
            reports[api] = run_bench(dataclasses.replace(cfg, api=api), client)
    except (ValueError, TimeoutError, OSError) as exc:
        raise SystemExit(f"meshserve-bench bench: {exc}") from None
    except grpc.RpcError as exc:
        raise SystemExit(f"meshserve-bench bench: {exc.code().name}: {exc.details()}") from None
    except http_errors as exc:
        raise SystemExit(f"meshserve-bench bench: {cfg.http_address}: {exc}") from None
    finally:
        client.close()
    for api, report in reports.items():
        if len(reports) > 1:
            print(f"--- over {'gRPC' if api == 'grpc' else 'the OpenAI-compatible HTTP API'}")
        print(format_report(report))
    out: dict[str, Any] = reports[apis[0]]
    if len(reports) > 1:
        comparison = compare_reports(reports["grpc"], reports["openai"])
        print(format_comparison(comparison))
        out = {**reports, "comparison": comparison}
    if args.out:
        write_report(out, args.out)
        print(f"meshserve: wrote {args.out}", file=sys.stderr)
    failed = [api for api, r in reports.items() if not r["completed"]]
    for api in failed:
        print(f"meshserve-bench bench: every request failed over {api} {reports[api]['errors']}", file=sys.stderr)
    return 1 if failed else 0
