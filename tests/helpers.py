"""Helpers shared by the test modules (``tests/`` is on ``sys.path`` under pytest):
``from helpers import free_port, status_of, scrape, value, wait_for, cpu_flags, penalized``."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset], float]


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status_of(client, req, timeout_s: float = 180.0) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    """Run a Generate request to the end; its final status code and details."""
    try:
        client.generate(req, timeout_s=timeout_s)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def scrape(port: int) -> Samples:
    """Every sample of ``http://127.0.0.1:port/metrics``: {(name, labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        body = resp.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample of ``scrape``'s result (0.0 when absent)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def wait_for(predicate: Callable[[], object], timeout_s: float = 10.0) -> bool:
    """Poll ``predicate`` every 50 ms until it is true or ``timeout_s`` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (x86 Linux; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def penalized(
    logits: np.ndarray,
    prompt: list[int],
    generated: list[int],
    repetition: float = 1.0,
    presence: float = 0.0,
    frequency: float = 0.0,
) -> np.ndarray:
    """Reference penalized logits [V] float32 of one row of raw ``logits`` [V]: Hugging Face's
    ``RepetitionPenaltyLogitsProcessor`` over prompt + generated ids, then OpenAI's documented
    ``mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence`` (c: the counts of the
    generated ids) in numpy float32. Skips the test when transformers (or torch) is missing."""
    torch = pytest.importorskip("torch")
    processors = pytest.importorskip("transformers.generation.logits_process")
    input_ids = torch.tensor([list(prompt) + list(generated)])
    scores = torch.tensor(np.asarray(logits, np.float32)[None])
    mu = processors.RepetitionPenaltyLogitsProcessor(penalty=repetition)(input_ids, scores).numpy()[0]
    c = np.bincount(np.asarray(generated, np.int64), minlength=len(mu)).astype(np.float32)
    return mu - c * np.float32(frequency) - (c > 0).astype(np.float32) * np.float32(presence)
