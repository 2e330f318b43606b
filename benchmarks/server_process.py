"""A ``meshserve serve`` child process for the benchmarks that compare servers started with
different flags (``long_context``, ``kv_memory``): started on free ports, waited for until its log
says SERVING, stopped with SIGTERM."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

SERVING = re.compile(r"SERVING on \S+:(\d+)")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick; another process may take it after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: list[str], log_path: Path, timeout_s: float) -> tuple[subprocess.Popen[bytes], int]:
    """Start ``python -m service.server.cli serve --port 0 ARGS`` (add ``--metrics-port`` to ARGS for
    metrics; else they are off) with its output in ``log_path``; return the process and its
    gRPC port once its log says SERVING.

    Raises:
        RuntimeError: the server exited first, or is not SERVING within ``timeout_s`` seconds
            (the message ends with the log's tail).
    """
    return wait_serving(launch_server(args, log_path), log_path, timeout_s)


def launch_server(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """``start_server``'s process, not waited for (start several, then ``wait_serving`` each)."""
    if "--metrics-port" not in args:
        args = [*args, "--metrics-port", "0"]
    cmd = [sys.executable, "-m", "service.server.cli", "serve", "--port", "0", *args]
    with open(log_path, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def wait_serving(
    proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float
) -> tuple[subprocess.Popen[bytes], int]:
    """``proc`` and its gRPC port once ``log_path`` says SERVING (raises as ``start_server``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        if m := SERVING.search(text):
            return proc, int(m.group(1))
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before SERVING:\n{text[-3000:]}")
        time.sleep(0.5)
    stop_server(proc, grace_s=0)
    raise RuntimeError(f"server not SERVING after {timeout_s:.0f} s:\n{log_path.read_text(errors='replace')[-3000:]}")


def stop_server(proc: subprocess.Popen[bytes], grace_s: float = 60.0) -> None:
    """SIGTERM (the server drains), then SIGKILL after ``grace_s`` seconds."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
