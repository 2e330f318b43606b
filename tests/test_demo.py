"""``make demo`` on the tiny model, with a stand-in venv whose ``meshserve`` runs this checkout:
the answer comes from the demo's own server, and when PORT is held by another server (the tiny
session server, which would answer) the demo fails with its server's log instead."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture()
def venv(tmp_path: Path) -> Path:
    """A directory the Makefile takes for its venv: bin/meshserve and bin/python run this checkout."""
    assert shutil.which("make"), "make is needed for the demo"
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    script = bin_dir / "meshserve"
    script.write_text(f'#!/bin/sh\ncd "{REPO}" && exec "{sys.executable}" -m service.server.cli "$@"\n')
    script.chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    return bin_dir.parent


def demo(venv: Path, port: int, model: Path) -> subprocess.CompletedProcess[str]:
    cmd = ["make", "-s", "-C", str(REPO), "demo", f"VENV={venv}", f"PORT={port}", f"MODEL={model}", "QUESTION=hi"]
    cmd.append("SERVE_FLAGS=--num-slots 1 --max-seq-len 256 --chunk-size 32")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_demo_fails_with_its_server_log_when_the_port_is_taken(venv: Path, tiny_server, tiny_gguf: Path) -> None:  # type: ignore[no-untyped-def]
    port = tiny_server.running.port  # a SERVING server that would answer a Generate
    r = demo(venv, port, tiny_gguf)
    assert r.returncode != 0
    assert "meshserve demo: the demo's server exited before SERVING" in r.stderr
    assert "--- server log ---" in r.stderr
    assert f"port {port} on 127.0.0.1 is in use" in r.stderr
    assert "FINISH_REASON" not in r.stderr  # no answer was taken from the other server
    assert r.stdout == f"{tiny_gguf}\n"  # only fetch's line


@pytest.mark.slow  # a whole demo: fetch, a server compiling the tiny model, 128 tokens (about 40 s here)
def test_demo_streams_an_answer_from_its_own_server(venv: Path, tiny_gguf: Path) -> None:
    from helpers import free_port

    r = demo(venv, free_port(), tiny_gguf)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")
    assert lines[0] == str(tiny_gguf) and r.stdout.endswith("\n") and len(r.stdout) > len(lines[0]) + 1
    assert "[FINISH_REASON_LENGTH; " in r.stderr and "+ 128 generated tokens" in r.stderr
    log = (venv / "demo-server.log").read_text()
    assert "SERVING on 127.0.0.1:" in log
