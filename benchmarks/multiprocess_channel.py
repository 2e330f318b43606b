"""How process 0 can send each engine step's plan to the other processes of a jax.distributed job
(the issue "Past one machine: one model served across several processes with jax.distributed").

    python -m benchmarks.multiprocess_channel                          # 200 steps after 20 of warm-up
    python -m benchmarks.multiprocess_channel --steps 5 --warmup 1 --json mp.json

The parent (no JAX in it) starts ``--processes`` (2) copies of this script as workers, each with
``JAX_PLATFORMS=cpu`` and ``XLA_FLAGS=--xla_force_host_platform_device_count=4``. Each worker sets
``jax_cpu_collectives_implementation="gloo"`` (also jax 0.10.2's default; without a
cross-process implementation a computation over both processes' devices cannot run), calls
``jax.distributed.initialize(coordinator_address="127.0.0.1:PORT", num_processes=2,
process_id=i)`` and checks ``jax.device_count() == 8`` and ``jax.process_count() == 2``.

The plan of a step (``plan``): int32 scalars [8] (step, rows, decode rows, prefill rows, ...),
tokens [R], positions [R] and a page table [R, P] (R = ``--rows`` 64, P = ``--pages`` 64), drawn
from a seed and the step's number and packed into one int32 buffer (4232 values, 16.9 KB). For
each step the channels take turns (interleaved, so drift on a noisy machine hits all alike):

* ``broadcast_one_to_all``: ``jax.experimental.multihost_utils.broadcast_one_to_all`` (a jitted
  sum over a (processes, local devices) mesh; process 1 gives zeros);
* ``kv_store``: the distributed runtime's key-value store (the coordinator's gRPC service),
  ``jax._src.distributed.global_state.client``: process 0 ``key_value_set_bytes("plan/STEP",
  ...)``, process 1 ``blocking_key_value_get_bytes`` and then ``key_value_delete`` (timed apart,
  as ``cleanup``: someone must delete, or the store grows by a plan a step);
* ``tcp``: one TCP connection from process 0 to process 1 (``TCP_NODELAY``), a 4-byte length and
  the buffer, read with ``recv_into`` into a preallocated buffer.

Before each send, process 1 says "ready" on a separate control connection and process 0 waits
for it, so process 1 is already waiting as a follower would be. Times are ``CLOCK_MONOTONIC``,
one clock for every process of the machine: ``send`` is process 0's time from before packing to
the send's return (what the scheduler loses), ``deliver`` from that start to process 1 holding
the unpacked arrays (when the follower can start its step). Process 1 checks every plan it
gets, each array, against the plan drawn again from the seed (``plans_equal``, ``checked``).

Then the collectives, both processes in the same jitted computations over the global 8-device
mesh (``jax.shard_map`` on axis "x"), each block [8, 576] float32 (a batch-8 activation of
SmolLM2-135M, the size of a tensor-parallel step's all-reduce): ``psum`` (one all-reduce),
``psum x60`` (60 dependent ones: SmolLM2-135M's 30 layers, 2 each) and ``psum local`` (one over
the process's own 4 devices, no other process: the baseline). Each is checked against the value
it must give and timed, dispatch to ``block_until_ready``, on process 0 after the same "ready".

The parent prints a table and writes ``--json``. A worker that fails ends the run: the parent
stops the others (their process groups: SIGTERM, then SIGKILL), shows the failed worker's stderr
and exits 1 (3 where ``jax.distributed.initialize`` itself failed); so does ``--timeout``. A
worker also ends itself when its parent dies (``PR_SET_PDEATHSIG``) and after ``--timeout``
(``SIGALRM``). Results: docs/multiprocess.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python benchmarks/multiprocess_channel.py` from a checkout

from benchmarks import check_writable_file  # noqa: E402
from service.server.arg_types import nonnegative_int, positive_int  # noqa: E402

PROG = "benchmarks.multiprocess_channel"
CHANNELS = ("broadcast_one_to_all", "kv_store", "tcp")
COLLECTIVES = ("psum", "psum x60", "psum local")
CHAIN = 60  # SmolLM2-135M: 30 layers, an all-reduce after attention and after the MLP
HIDDEN = 576  # SmolLM2-135M's hidden size
BATCH = 8
SCALARS = 8
VOCAB = 49152
SEED = 2024
TARGET_MS = 1.0  # the issue: <= 1 ms a step for the plan
EXIT_NO_DISTRIBUTED = 3  # jax.distributed.initialize itself failed
KV_TIMEOUT_MS = 60_000
CPU_COLLECTIVES = "gloo"


# ---------------------------------------------------------------------------------------------
# The plan


def plan_arrays(step: int, rows: int, pages: int) -> dict[str, np.ndarray]:
    """Step ``step``'s plan, the same in every process (drawn from ``SEED`` and ``step``): some
    rows in use (the rest zero, as a padded batch), their tokens, positions and pages."""
    rng = np.random.default_rng([SEED, step])
    used = int(rng.integers(1, rows + 1))
    decode = int(rng.integers(0, used + 1))
    tokens = np.zeros(rows, np.int32)
    tokens[:used] = rng.integers(0, VOCAB, used)
    positions = np.zeros(rows, np.int32)
    positions[:used] = rng.integers(0, 4096, used)
    page_table = np.zeros((rows, pages), np.int32)
    page_table[:used] = rng.integers(0, 1 << 16, (used, pages))
    scalars = np.array([step, used, decode, used - decode, int(positions.max()), rows, pages, SEED], np.int32)
    return {"scalars": scalars, "tokens": tokens, "positions": positions, "page_table": page_table}


def plan_size(rows: int, pages: int) -> int:
    """The packed plan's length in int32 values."""
    return SCALARS + 2 * rows + rows * pages


def pack(plan: dict[str, np.ndarray]) -> np.ndarray:
    """The plan as one int32 buffer: scalars, tokens, positions, page table (row-major)."""
    return np.concatenate([plan[k].ravel() for k in ("scalars", "tokens", "positions", "page_table")]).astype(
        np.int32, copy=False
    )


def unpack(buf: np.ndarray, rows: int, pages: int) -> dict[str, np.ndarray]:
    """``pack``'s inverse (views into ``buf``)."""
    a, b, c = SCALARS, SCALARS + rows, SCALARS + 2 * rows
    return {
        "scalars": buf[:a],
        "tokens": buf[a:b],
        "positions": buf[b:c],
        "page_table": buf[c : c + rows * pages].reshape(rows, pages),
    }


def plans_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> bool:
    return got.keys() == want.keys() and all(
        got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]) for k in want
    )


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)  # one clock for all processes of a machine


# ---------------------------------------------------------------------------------------------
# A worker (one JAX process)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent_pid:  # it died before the prctl
        os._exit(1)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]


def connect_pair(process: int, port: int, deadline: float) -> tuple[socket.socket, socket.socket]:
    """(control, data) connections between process 0 (listening) and process 1."""
    if process == 0:
        with socket.create_server(("127.0.0.1", port)) as server:
            server.settimeout(max(1.0, deadline - time.monotonic()))
            conns: dict[bytes, socket.socket] = {}
            while len(conns) < 2:
                conn, _ = server.accept()
                conn.settimeout(None)
                got = bytearray(1)
                recv_exact(conn, memoryview(got))
                conns[bytes(got)] = conn
        pair = conns[b"c"], conns[b"d"]
    else:
        out = []
        for tag in (b"c", b"d"):
            while True:
                try:
                    s = socket.create_connection(("127.0.0.1", port), timeout=5)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            s.settimeout(None)
            s.sendall(tag)
            out.append(s)
        pair = out[0], out[1]
    for s in pair:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return pair


def run_worker(args: argparse.Namespace) -> int:
    die_with_parent(args.parent_pid)
    signal.alarm(args.timeout)  # the default SIGALRM action ends the process
    deadline = time.monotonic() + args.timeout
    process = args.worker
    import jax
    from jax._src import config as jax_config

    jax.config.update("jax_cpu_collectives_implementation", CPU_COLLECTIVES)
    try:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.coordinator_port}",
            num_processes=args.processes,
            process_id=process,
            initialization_timeout=min(args.timeout, 120),
        )
    except Exception as e:
        print(f"jax.distributed.initialize failed: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_NO_DISTRIBUTED
    counts = {
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "process_count": jax.process_count(),
        "process_index": jax.process_index(),
    }
    want = {
        "device_count": args.processes * args.local_devices,
        "local_device_count": args.local_devices,
        "process_count": args.processes,
        "process_index": process,
    }
    if counts != want:
        raise RuntimeError(f"expected {want}, got {counts}")
    if args.processes != 2:
        raise RuntimeError("the channels are measured between two processes")
    control, data = connect_pair(process, args.socket_port, deadline)
    result: dict[str, Any] = {
        "process": process,
        **counts,
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "cpu_collectives_implementation": jax_config.cpu_collectives_implementation.value,
        "channels": measure_channels(args, process, control, data),
        "collectives": measure_collectives(args, process, control),
    }
    Path(args.result_file).write_text(json.dumps(result))
    # the last word: both are done before either shuts the runtime down
    if process == 0:
        recv_exact(control, memoryview(bytearray(1)))
        control.sendall(b"e")
    else:
        control.sendall(b"e")
        recv_exact(control, memoryview(bytearray(1)))
    control.close()
    data.close()
    jax.distributed.shutdown()
    return 0


def measure_channels(
    args: argparse.Namespace, process: int, control: socket.socket, data: socket.socket
) -> dict[str, dict[str, list]]:
    """Per channel, per timed step: process 0's send start/end, process 1's arrival and checks."""
    from jax._src import distributed
    from jax.experimental import multihost_utils

    client = distributed.global_state.client
    assert client is not None
    rows, pages = args.rows, args.pages
    n = plan_size(rows, pages)
    inbox = bytearray(4 + 4 * n)
    zeros = np.zeros(n, np.int32)
    out: dict[str, dict[str, list]] = {c: {} for c in CHANNELS}
    ready = bytearray(1)
    for step in range(args.warmup + args.steps):
        timed = step >= args.warmup
        for channel in CHANNELS:
            rec = out[channel]
            if process == 0:
                plan = plan_arrays(step, rows, pages)  # the scheduler's work, not the channel's
                recv_exact(control, memoryview(ready))
                t0 = now_ns()
                buf = pack(plan)
                if channel == "broadcast_one_to_all":
                    multihost_utils.broadcast_one_to_all(buf)
                elif channel == "kv_store":
                    client.key_value_set_bytes(f"plan/{step}", buf.tobytes())
                else:
                    data.sendall(struct.pack("<I", buf.nbytes) + buf.tobytes())
                t1 = now_ns()
                if timed:
                    rec.setdefault("send_start", []).append(t0)
                    rec.setdefault("send_end", []).append(t1)
            else:
                cleanup = None
                control.sendall(b"r")
                if channel == "broadcast_one_to_all":
                    got = unpack(np.asarray(multihost_utils.broadcast_one_to_all(zeros)), rows, pages)
                    t2 = now_ns()
                elif channel == "kv_store":
                    blob = client.blocking_key_value_get_bytes(f"plan/{step}", KV_TIMEOUT_MS)
                    got = unpack(np.frombuffer(blob, np.int32), rows, pages)
                    t2 = now_ns()
                    client.key_value_delete(f"plan/{step}")
                    cleanup = now_ns() - t2
                else:
                    view = memoryview(inbox)
                    recv_exact(data, view[:4])
                    (size,) = struct.unpack("<I", view[:4])
                    if size != 4 * n:
                        raise RuntimeError(f"tcp: a plan of {size} bytes, expected {4 * n}")
                    recv_exact(data, view[4:])
                    got = unpack(np.frombuffer(inbox, np.int32, offset=4), rows, pages)
                    t2 = now_ns()
                equal = plans_equal(got, plan_arrays(step, rows, pages))
                if not equal:
                    raise RuntimeError(f"{channel}: step {step}'s plan arrived different from the one sent")
                if timed:
                    rec.setdefault("arrive", []).append(t2)
                    rec.setdefault("equal", []).append(equal)
                    if cleanup is not None:
                        rec.setdefault("cleanup", []).append(cleanup)
    return out


def block_of(index: Any) -> np.ndarray:
    """The [BATCH, HIDDEN] block at ``index`` of a collective's input: its device's place + 1."""
    start = index[0].start or 0
    return np.full((BATCH, HIDDEN), start // BATCH + 1, np.float32)


def measure_collectives(args: argparse.Namespace, process: int, control: socket.socket) -> dict[str, Any]:
    """Per collective: each timed call's ns (dispatch to ``block_until_ready``), its check."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    def psum_chain(count: int):  # type: ignore[no-untyped-def]
        def body(block):  # type: ignore[no-untyped-def]
            for _ in range(count):
                block = jax.lax.psum(block, "x") * (1.0 / jax.lax.axis_size("x"))
            return block

        return body

    out: dict[str, Any] = {}
    for name in COLLECTIVES:
        devices = jax.local_devices() if name == "psum local" else jax.devices()
        mesh = Mesh(np.array(devices), ("x",))
        sharding = NamedSharding(mesh, P("x"))
        shape = (BATCH * len(devices), HIDDEN)
        # device d's block holds d + 1 (its place on the mesh)
        x = jax.make_array_from_callback(shape, sharding, block_of)
        count = CHAIN if name == "psum x60" else 1
        fn = jax.jit(jax.shard_map(psum_chain(count), mesh=mesh, in_specs=P("x"), out_specs=P(), check_vma=False))
        total = sum(range(1, len(devices) + 1))
        want = float(total) / len(devices)  # the first psum's mean; the later ones keep it
        times = []
        ok = True
        local = name == "psum local"
        steps = args.chain_steps if name == "psum x60" else args.collective_steps
        for step in range(args.warmup + steps):
            if not local:  # both processes start together, as the channels do
                if process == 0:
                    recv_exact(control, memoryview(bytearray(1)))
                else:
                    control.sendall(b"r")
            t0 = now_ns()
            y = fn(x)
            y.block_until_ready()
            t1 = now_ns()
            if step >= args.warmup:
                times.append(t1 - t0)
            value = np.asarray(y.addressable_data(0))
            ok = ok and value.shape == (BATCH, HIDDEN) and bool(np.allclose(value, want, rtol=1e-5))
        if not ok:
            raise RuntimeError(f"{name}: wrong result, expected {want} everywhere")
        out[name] = {"ns": times, "value_ok": ok, "devices": len(devices), "all_reduces": count}
    return out


# ---------------------------------------------------------------------------------------------
# The parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop(procs: list[subprocess.Popen]) -> None:  # type: ignore[type-arg]
    """End every worker still running, with its process group: SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
        end = time.monotonic() + wait
        for p in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, end - time.monotonic()))


def ended(rc: int) -> str:
    """How a worker ended, in words ("exited with status 1", "was killed by SIGALRM (its --timeout)")."""
    if rc >= 0:
        return f"exited with status {rc}"
    name = signal.Signals(-rc).name
    return f"was killed by {name}" + (" (its --timeout)" if name == "SIGALRM" else "")


def tail(path: Path, chars: int = 6000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-chars:]


def launch(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start the workers, wait for them; their results, by process.

    Raises:
        SystemExit: a worker failed or the run passed ``--timeout`` (the others stopped first).
    """
    coordinator, sock = free_port(), free_port()
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={args.local_devices}",
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    procs: list[subprocess.Popen] = []  # type: ignore[type-arg]
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` runs
    with tempfile.TemporaryDirectory(prefix="mp-channel-") as tmp:
        folder = Path(tmp)
        try:
            for i in range(args.processes):
                cmd = [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--worker", str(i),
                    "--parent-pid", str(os.getpid()),
                    "--coordinator-port", str(coordinator),
                    "--socket-port", str(sock),
                    "--result-file", str(folder / f"result{i}.json"),
                    "--processes", str(args.processes),
                    "--steps", str(args.steps),
                    "--collective-steps", str(args.collective_steps),
                    "--chain-steps", str(args.chain_steps),
                    "--local-devices", str(args.local_devices),
                    "--warmup", str(args.warmup),
                    "--rows", str(args.rows),
                    "--pages", str(args.pages),
                    "--timeout", str(args.timeout),
                ]  # fmt: skip
                with open(folder / f"out{i}.txt", "w") as o, open(folder / f"err{i}.txt", "w") as e:
                    procs.append(subprocess.Popen(cmd, env=env, stdout=o, stderr=e, start_new_session=True))
            end = time.monotonic() + args.timeout + 15
            while any(p.poll() is None for p in procs):
                failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
                if failed:
                    i = failed[0]
                    rc = procs[i].returncode
                    stop(procs)
                    print(f"{PROG}: process {i} {ended(rc)}; its stderr:", file=sys.stderr)
                    print(tail(folder / f"err{i}.txt"), file=sys.stderr)
                    raise SystemExit(EXIT_NO_DISTRIBUTED if rc == EXIT_NO_DISTRIBUTED else 1)
                if time.monotonic() > end:
                    stop(procs)
                    for i in range(len(procs)):
                        print(f"{PROG}: timed out; process {i}'s stderr:", file=sys.stderr)
                        print(tail(folder / f"err{i}.txt"), file=sys.stderr)
                    raise SystemExit(1)
                time.sleep(0.05)
            for i, p in enumerate(procs):
                if p.returncode != 0:
                    print(f"{PROG}: process {i} {ended(p.returncode)}; its stderr:", file=sys.stderr)
                    print(tail(folder / f"err{i}.txt"), file=sys.stderr)
                    raise SystemExit(EXIT_NO_DISTRIBUTED if p.returncode == EXIT_NO_DISTRIBUTED else 1)
            return [json.loads((folder / f"result{i}.json").read_text()) for i in range(args.processes)]
        finally:
            stop(procs)
            signal.signal(signal.SIGTERM, previous)


def stats_ms(ns: list[int]) -> dict[str, float]:
    ms = sorted(v / 1e6 for v in ns)
    p90 = ms[min(len(ms) - 1, round(0.9 * (len(ms) - 1)))]
    return {"median_ms": statistics.median(ms), "p90_ms": p90, "min_ms": ms[0], "max_ms": ms[-1]}


def summarize(args: argparse.Namespace, results: list[dict[str, Any]]) -> dict[str, Any]:
    p0, p1 = results
    rows = []
    for channel in CHANNELS:
        s, r = p0["channels"][channel], p1["channels"][channel]
        send = [b - a for a, b in zip(s["send_start"], s["send_end"], strict=True)]
        deliver = [b - a for a, b in zip(s["send_start"], r["arrive"], strict=True)]
        row: dict[str, Any] = {
            "channel": channel,
            "steps": len(send),
            "send": stats_ms(send),
            "deliver": stats_ms(deliver),
            "checked": len(r["equal"]),
            "plans_equal": all(r["equal"]) and len(r["equal"]) == args.steps,
        }
        if "cleanup" in r:
            row["cleanup"] = stats_ms(r["cleanup"])
        rows.append(row)
    collectives = []
    for name in COLLECTIVES:
        c0, c1 = p0["collectives"][name], p1["collectives"][name]
        collectives.append(
            {
                "name": name,
                "devices": c0["devices"],
                "all_reduces": c0["all_reduces"],
                "block": [BATCH, HIDDEN],
                "process0": stats_ms(c0["ns"]),
                "process1": stats_ms(c1["ns"]),
                "value_ok": c0["value_ok"] and c1["value_ok"],
            }
        )
    workers = [{k: v for k, v in r.items() if k not in ("channels", "collectives")} for r in results]
    return {
        "settings": {
            "processes": args.processes,
            "local_devices": args.local_devices,
            "steps": args.steps,
            "collective_steps": args.collective_steps,
            "chain_steps": args.chain_steps,
            "warmup": args.warmup,
            "rows": args.rows,
            "pages": args.pages,
            "plan_int32": plan_size(args.rows, args.pages),
            "plan_bytes": 4 * plan_size(args.rows, args.pages),
            "jax_config": {"jax_cpu_collectives_implementation": CPU_COLLECTIVES},
        },
        "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "workers": workers,
        "channels": rows,
        "collectives": collectives,
        "target_ms": TARGET_MS,
    }


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def table(summary: dict[str, Any]) -> str:
    s = summary["settings"]
    lines = [
        f"plan: {s['plan_int32']} int32 ({s['plan_bytes']} B), {s['steps']} steps after {s['warmup']} of warm-up; "
        f"{s['processes']} processes x {s['local_devices']} CPU devices = {summary['workers'][0]['device_count']}",
        f"{'channel':<22}{'send med':>10}{'send p90':>10}{'deliv med':>11}{'deliv p90':>11}{'cleanup':>9}  checked",
    ]
    for r in summary["channels"]:
        cleanup = f"{r['cleanup']['median_ms']:.3f}" if "cleanup" in r else "-"
        ok = f"{r['checked']} {'equal' if r['plans_equal'] else 'DIFFERENT'}"
        lines.append(
            f"{r['channel']:<22}{r['send']['median_ms']:>10.3f}{r['send']['p90_ms']:>10.3f}"
            f"{r['deliver']['median_ms']:>11.3f}{r['deliver']['p90_ms']:>11.3f}{cleanup:>9}  {ok}"
        )
    lines.append(f"{'collective':<22}{'devices':>8}{'p0 med':>10}{'p0 p90':>10}{'p1 med':>10}{'p1 p90':>10}  value")
    for c in summary["collectives"]:
        lines.append(
            f"{c['name']:<22}{c['devices']:>8}{c['process0']['median_ms']:>10.3f}{c['process0']['p90_ms']:>10.3f}"
            f"{c['process1']['median_ms']:>10.3f}{c['process1']['p90_ms']:>10.3f}  {'ok' if c['value_ok'] else 'WRONG'}"
        )
    lines.append("(ms; send: process 0's pack + send; deliver: process 0's start to process 1 holding the arrays)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        description="The step plan's channel from process 0 to process 1 of a jax.distributed job, and collectives.",
    )
    parser.add_argument("--steps", type=positive_int, default=200, help="timed steps per channel (%(default)s)")
    parser.add_argument("--warmup", type=nonnegative_int, default=20, help="untimed steps first (%(default)s)")
    parser.add_argument(
        "--collective-steps", type=positive_int, default=50, help="timed calls of psum, psum local (%(default)s)"
    )
    parser.add_argument("--chain-steps", type=positive_int, default=10, help="timed calls of psum x60 (%(default)s)")
    parser.add_argument(
        "--local-devices", type=positive_int, default=4, help="CPU devices per process (%(default)s; the issue: 4)"
    )
    parser.add_argument("--rows", type=positive_int, default=64, help="the plan's rows R (%(default)s)")
    parser.add_argument("--pages", type=positive_int, default=64, help="page-table columns P (%(default)s)")
    parser.add_argument("--timeout", type=positive_int, default=300, help="seconds for the whole run (%(default)s)")
    parser.add_argument("--json", help="write the results here")
    # a worker's own flags (the parent passes them)
    parser.add_argument("--processes", type=positive_int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--socket-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return run_worker(args)
    if args.processes != 2:
        raise SystemExit(f"{PROG}: --processes must be 2 (the channels are measured between two processes)")
    if args.json:
        check_writable_file(args.json, PROG)
    summary = summarize(args, launch(args))
    print(table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    bad = [r["channel"] for r in summary["channels"] if not r["plans_equal"]]
    bad += [c["name"] for c in summary["collectives"] if not c["value_ok"]]
    if bad:
        print(f"{PROG}: wrong content in {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
