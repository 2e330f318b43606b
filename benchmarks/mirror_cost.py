"""The per-step cost of keeping the processes of a jax.distributed job in step (process 0's
``Runner`` with its ``channel``, a ``service.engine.distributed.StepChannel``: each step's batch
sent to the followers before the step itself) against a batch-8 decode step of SmolLM2-135M:
the issue "Past one machine"'s target, <= 1 ms a step and <= 5 % of that step.

    python -m benchmarks.mirror_cost                     # 200 messages after 20 of warm-up
    python -m benchmarks.mirror_cost --json mirror.json
    python -m benchmarks.mirror_cost --steps 5 --warmup 1 --tiny-steps 3 --tiny-warmup 1   # a smoke run

The parent (no JAX in it) runs three jobs, one after the other, each in its own processes, and
prints one table from them:

1. ``smollm`` (one process, ``JAX_PLATFORMS=cpu``, one CPU device): SmolLM2-135M (the default
   GGUF, ``model.weights.fetch.default_model_path``, loaded as the server does: blocks as stored where the
   native quantized matmul is built, else float32) in a ``Runner`` on layout ``single``
   (``EngineConfig``'s defaults: max_seq_len 2048, pages of 16; 8 rows, a pool of 8 x 2048
   tokens). Eight requests of ``PROMPT_LEN`` random ids (greedy, EOS ignored, no prefix cache)
   are run to ``--warmup + --steps`` decode steps by the real planning code
   (``record_decode_steps``: ``Scheduler.schedule``, ``EngineLoop.step``, which builds each
   ``RaggedBatch``, dispatches it and postprocesses the step before; the loop's own body without
   its thread and warm-up); every ``Runner.step`` is timed end to end, dispatch to
   ``block_until_ready`` of its output (so the loop does not pipeline). **step**: the median over the ``--steps`` steps that decode all 8 rows with no
   prefill after the first ``--warmup`` of them (the first compiles). All those steps'
   ``RaggedBatch``es (decode region 8, page tables [8, 128] int32) are kept: they
   are the messages of job 3.
2. ``tiny8`` (one process, 8 CPU devices): the tiny random model (``random_llama`` of
   ``LlamaConfig.tiny()``, seed 0) in a ``Runner`` on layout ``1x8`` (8 rows, pages of 16,
   max_seq_len 2048). Its batches come from ``record_decode_steps`` too (prompts of
   ``TINY_PROMPT_LEN``), then ``--tiny-warmup + --tiny-steps`` of them are replayed
   (``replay``: ``runner.step(batch, prev)``, ``prev`` the previous replayed step's output, each
   waited for with ``block_until_ready``). **tiny 1 process**: the replayed steps' median.
3. ``mirror`` (two processes, each ``JAX_PLATFORMS=cpu
   XLA_FLAGS=--xla_force_host_platform_device_count=4``): ``service.engine.distributed.initialize``
   (gloo, ``jax.distributed.initialize``), ``StepChannel.open`` (the real code path), the tiny
   runner of job 2 on layout ``1x8`` over all 8 devices in both, process 0's with the channel
   (``Runner.channel``: it mirrors its own calls).

   * **send**: on process 0, ``channel.send(("step", (batch, PREVIOUS), {}))`` for each of job
     1's batches (the message ``Runner.step`` sends before its own step, ``Runner._mirror``):
     pickle (protocol 5) and ``sendall`` of the frame. Times are
     ``time.clock_gettime_ns(CLOCK_MONOTONIC)``.
   * **deliver**: from the start of that send on process 0 to the follower holding the
     unpickled message (``StepChannel.recv``'s return, read by this script's loop, not
     ``follow``, so it can answer): both processes read one CLOCK_MONOTONIC (one machine; the
     run checks ``time.get_clock_info`` and that every arrival lies between its send's start
     and process 0 reading the follower's answer). **rtt/2**: half of that whole round trip
     (send start to process 0 holding the follower's 8-byte answer, the arrival time), a
     second estimate that needs no shared clock. The follower compares each message with the
     batch sent (every array, after the timing). Before each send process 0 waits
     ``--gap-ms`` (the follower back in ``recv``, as it is while process 0 plans a step).
   * **bytes**: the frame (8-byte length + pickle) of a message.
   * **tiny mirrored**: process 0 replays job 2's batches through its runner's ``step`` (the
     send of the batch, then the step) while process 1 runs
     ``service.engine.distributed.follow`` (the real follower), each step timed on process 0
     from the call to ``block_until_ready`` of its output. The program spans both processes, so
     this includes the send, the follower's start and the model-axis collectives across the
     processes (gloo over TCP): the extra synchronisation against **tiny 1 process** (the same
     layout and batches on one process of 8 devices).

Ratios: send and deliver medians over the SmolLM2 step's median; PASS where a median is <= 1 ms
and <= 5 % of the step. A request's row state (sampling parameters, token history) travels in
the batch of its first step (``RaggedBatch.installs``), not in messages of its own; the decode
steps measured here carry none. The compiled programs persist in JAX's compilation cache
(``model.weights.fetch.cache_dir() / "jax"``, as the server's): a rerun compiles less. A worker that
fails ends the run (the others stopped, its stderr shown, exit 1; 3 where
``jax.distributed.initialize`` failed). Results: docs/multiprocess.md, "Per-step cost of the
mirror".
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python benchmarks/mirror_cost.py` from a checkout

from benchmarks import check_writable_file  # noqa: E402
from benchmarks.multiprocess_channel import (  # noqa: E402
    cpu_name,
    die_with_parent,
    ended,
    free_port,
    now_ns,
    recv_exact,
    stats_ms,
    stop,
    tail,
)
from service.server.arg_types import nonnegative_int, positive_int  # noqa: E402

PROG = "benchmarks.mirror_cost"
ROWS = 8  # the batch: 8 decoding rows
PROMPT_LEN = 64  # SmolLM2's prompts (random ids)
TINY_PROMPT_LEN = 16
TINY_LAYOUT = "1x8"
LOCAL_DEVICES = 4
SEED = 0
TARGET_MS = 1.0  # the issue: <= 1 ms a step
TARGET_FRACTION = 0.05  # and <= 5 % of a batch-8 decode step of SmolLM2-135M
EXIT_NO_DISTRIBUTED = 3
_ARRIVAL = struct.Struct("<q")


# ---------------------------------------------------------------------------------------------
# Steps planned by the real scheduler


class _NoText:
    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def record_decode_steps(engine: Any, prompt_len: int, decode_steps: int, seed: int = SEED) -> list[tuple[Any, int]]:
    """Run ``engine.ecfg.num_slots`` requests of ``prompt_len`` random ids (greedy, EOS ignored,
    no prefix cache, ``decode_steps + 1`` ids each) on the ``Runner`` ``engine`` through the real
    planning code, the body of ``EngineLoop._run`` without its thread, inbox or warm-up:
    ``Scheduler.schedule`` and ``EngineLoop.step`` (which builds each ``RaggedBatch``, dispatches
    it and postprocesses the step before). Every ``engine.step`` is waited for
    (``block_until_ready``) and timed.

    Returns:
        (batch, ns) of every step whose rows all decode (no prefill), in order: ``decode_steps``.
    """
    from service.engine.loop import make_loop
    from service.engine.request import Request, SamplingOptions
    from service.engine.text_stream import TextStream

    rows = engine.ecfg.num_slots
    loop: Any = make_loop(engine, max_queue=rows)
    sched = loop.scheduler
    rng = np.random.default_rng(seed)
    for i in range(rows):
        sched.add(
            Request(
                request_id=f"mirror-cost-{i}",
                prompt_ids=rng.integers(0, engine.cfg.vocab_size, prompt_len).tolist(),
                max_tokens=decode_steps + 1,  # the first id comes from the prefill step
                sampling=SamplingOptions(temperature=0.0),
                text=TextStream(_NoText()),
                emit=lambda chunk: None,
                eos_ids=frozenset(),
                ignore_eos=True,
                prefix_cache=False,
            )
        )
    steps: list[tuple[Any, int]] = []
    real_step = engine.step

    def timed_step(batch: Any, prev: Any = None) -> Any:
        t0 = now_ns()
        out = real_step(batch, prev)
        out.packed.block_until_ready()
        steps.append((batch, now_ns() - t0))
        return out

    engine.step = timed_step  # an instance attribute over the method, removed below
    try:
        while True:  # EngineLoop._run's body: an empty plan lands the step in flight, if any
            plan = sched.schedule()
            if plan.empty:
                if loop._inflight is None:
                    break
                loop._finish_inflight()
                continue
            loop.step(plan)
    finally:
        del engine.step
    n = rows * engine.replicas
    return [(b, ns) for b, ns in steps if b.decode_tokens == rows and len(b.tokens) == n and b.num_real == rows]


def replay(step: Any, batches: list[Any]) -> list[int]:
    """Each batch through ``step(batch, prev)`` (prev: the previous replayed step's output, None
    first), each waited for (``block_until_ready``); the ns of each."""
    times, prev = [], None
    for b in batches:
        t0 = now_ns()
        prev = step(b, prev)
        prev.packed.block_until_ready()
        times.append(now_ns() - t0)
    return times


def batches_equal(a: Any, b: Any) -> bool:
    """Two ``RaggedBatch``es with equal fields (arrays: dtype, shape and values)."""
    import dataclasses

    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            if not (isinstance(y, np.ndarray) and x.dtype == y.dtype and np.array_equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def batch_shapes(b: Any) -> dict[str, Any]:
    """The batch's arrays' shapes and dtypes and its scalars (for the report)."""
    import dataclasses

    out: dict[str, Any] = {}
    for f in dataclasses.fields(b):
        v = getattr(b, f.name)
        out[f.name] = [list(v.shape), str(v.dtype)] if isinstance(v, np.ndarray) else v
    return out


def tiny_engine(devices: list[Any]) -> Any:
    from model.config import LlamaConfig
    from model.weights.build import random_llama
    from service.engine.config import EngineConfig
    from service.engine.runner import Runner
    from sharding.layouts import load_layout

    cfg = LlamaConfig.tiny()
    graphdef, params = random_llama(cfg, seed=SEED)
    ecfg = EngineConfig(num_slots=ROWS, kv_cache_tokens=ROWS * 2048)
    return Runner(cfg, graphdef, params, load_layout(TINY_LAYOUT), ecfg, devices)


def enable_compilation_cache() -> None:
    """The server's persistent compilation cache (``service.server.startup.enable_compilation_cache``)."""
    from model.weights.fetch import cache_dir
    from service.server.startup import enable_compilation_cache as enable

    enable(cache_dir())


# ---------------------------------------------------------------------------------------------
# The workers


def worker_smollm(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import jax

    from model.native import quant_matmul
    from model.weights.fetch import default_model_path
    from model.weights.loader import load_model
    from service.engine.config import EngineConfig
    from service.engine.runner import Runner
    from sharding.layouts import load_layout

    enable_compilation_cache()
    t0 = time.monotonic()
    path = default_model_path()
    stored = {"auto": quant_matmul.available(), "stored": True, "float32": False}[args.weights]
    loaded = load_model(path, "float32", stored=stored)
    ecfg = EngineConfig(num_slots=ROWS, kv_cache_tokens=ROWS * 2048)
    engine = Runner(loaded.cfg, loaded.graphdef, loaded.state, load_layout("single"), ecfg, jax.devices()[:1])
    built = time.monotonic() - t0
    steps = record_decode_steps(engine, PROMPT_LEN, args.warmup + args.steps)
    batches = [b for b, _ in steps]
    with open(out.with_suffix(".batches.pkl"), "wb") as f:
        pickle.dump(batches, f, protocol=5)
    return {
        "model": path.name,
        "weights": "blocks as stored" if stored else "float32",
        "attention": engine.kernels.attention.name,
        "devices": engine.mesh.devices.size,
        "max_seq_len": engine.ecfg.max_seq_len,
        "page_size": engine.ecfg.page_size,
        "step_ns": [ns for _, ns in steps[args.warmup :]],
        "batch": batch_shapes(batches[0]),
        "positions": [int(batches[0].positions.min()), int(batches[-1].positions.max())],
        "build_s": built,
        "total_s": time.monotonic() - t0,
    }


def worker_tiny8(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import jax

    enable_compilation_cache()
    engine = tiny_engine(jax.devices())
    steps = record_decode_steps(engine, TINY_PROMPT_LEN, args.tiny_warmup + args.tiny_steps)
    batches = [b for b, _ in steps]
    with open(out.with_suffix(".batches.pkl"), "wb") as f:
        pickle.dump(batches, f, protocol=5)
    times = replay(engine.step, batches)
    return {"devices": jax.device_count(), "processes": jax.process_count(), "step_ns": times[args.tiny_warmup :]}


def worker_mirror(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from service.engine import distributed
    from service.engine.runner import PREVIOUS, STOP

    process = args.process_id
    try:
        distributed.initialize(f"127.0.0.1:{args.coordinator_port}", 2, process)
    except Exception as e:
        print(f"jax.distributed.initialize failed: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(EXIT_NO_DISTRIBUTED) from e
    import jax

    enable_compilation_cache()
    counts = (jax.device_count(), jax.local_device_count(), jax.process_count(), jax.process_index())
    if counts != (2 * LOCAL_DEVICES, LOCAL_DEVICES, 2, process):
        raise RuntimeError(f"expected 8 devices, 4 local, 2 processes, index {process}; got {counts}")
    channel = distributed.StepChannel.open()
    with open(args.messages, "rb") as f:
        messages = pickle.load(f)
    with open(args.tiny_batches, "rb") as f:
        tiny = pickle.load(f)
    engine = tiny_engine(jax.devices())
    sock = channel.peers[0]
    answer = bytearray(_ARRIVAL.size)
    result: dict[str, Any] = {
        "process": process,
        "device_count": counts[0],
        "local_device_count": counts[1],
        "process_count": counts[2],
        "clocks": {name: time.get_clock_info(name).implementation for name in ("monotonic", "perf_counter")},
    }
    if process == 0:
        start, end, back, arrive = [], [], [], []
        frames = []
        for b in messages:
            frames.append(8 + len(pickle.dumps(("step", (b, PREVIOUS), {}), protocol=5)))
            time.sleep(args.gap_ms / 1000)
            t0 = now_ns()
            channel.send(("step", (b, PREVIOUS), {}))  # what Runner.step sends before its step
            t1 = now_ns()
            recv_exact(sock, memoryview(answer))
            t2 = now_ns()
            start.append(t0)
            end.append(t1)
            back.append(t2)
            arrive.append(_ARRIVAL.unpack(answer)[0])
        checked = bytearray(1)
        recv_exact(sock, memoryview(checked))
        result["channel"] = {"start": start, "end": end, "back": back, "arrive": arrive, "frame_bytes": frames}
        result["messages_equal"] = checked == b"y"
        engine.channel = channel  # from now on each step is sent first, then run (Runner._mirror)
        result["tiny_ns"] = replay(engine.step, tiny)[args.tiny_warmup :]
        channel.send((STOP, (), {}))  # what StepChannel.finish sends; the follower's answer read below
        recv_exact(sock, memoryview(checked))  # the follower's last word: it is done
    else:
        got = []
        for _ in messages:
            message = channel.recv()
            t = now_ns()
            sock.sendall(_ARRIVAL.pack(t))
            got.append(message)
        equal = all(
            m[0] == "step" and m[1][1] == PREVIOUS and m[2] == {} and batches_equal(m[1][0], b)
            for m, b in zip(got, messages, strict=True)
        )
        sock.sendall(b"y" if equal else b"n")
        result["messages_equal"] = equal
        result["followed_steps"] = distributed.follow(engine, channel)
        sock.sendall(b"e")
    channel.close()
    jax.distributed.shutdown()
    return result


def run_worker(args: argparse.Namespace) -> int:
    die_with_parent(args.parent_pid)
    signal.alarm(args.timeout)  # the default SIGALRM action ends the process
    out = Path(args.result_file)
    work = {"smollm": worker_smollm, "tiny8": worker_tiny8, "mirror": worker_mirror}[args.worker]
    code = 0
    try:
        out.write_text(json.dumps(work(args, out)))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # at once: an interpreter exit can hang in JAX's distributed shutdown


# ---------------------------------------------------------------------------------------------
# The parent


def run_job(
    args: argparse.Namespace, folder: Path, name: str, workers: list[tuple[list[str], dict[str, str]]]
) -> list[dict[str, Any]]:
    """Start the job's workers (argv tail, extra environment), wait for them; their results.

    Raises:
        SystemExit: a worker failed or the job passed ``--timeout`` (the others stopped first).
    """
    base = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    base.pop("XLA_FLAGS", None)
    procs: list[subprocess.Popen] = []  # type: ignore[type-arg]
    files = [folder / f"{name}{i}" for i in range(len(workers))]
    try:
        for (argv, env), f in zip(workers, files, strict=True):
            cmd = [
                sys.executable, str(Path(__file__).resolve()), "--worker", name,
                "--parent-pid", str(os.getpid()), "--result-file", str(f.with_suffix(".json")),
                "--timeout", str(args.timeout), "--steps", str(args.steps), "--warmup", str(args.warmup),
                "--tiny-steps", str(args.tiny_steps), "--tiny-warmup", str(args.tiny_warmup),
                "--gap-ms", str(args.gap_ms), "--weights", args.weights, *argv,
            ]  # fmt: skip
            with open(f.with_suffix(".out"), "w") as o, open(f.with_suffix(".err"), "w") as e:
                procs.append(subprocess.Popen(cmd, env={**base, **env}, stdout=o, stderr=e, start_new_session=True))
        end = time.monotonic() + args.timeout + 15
        while True:
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                i = failed[0]
                rc = procs[i].returncode
                stop(procs)
                print(f"{PROG}: {name} worker {i} {ended(rc)}; its stderr:", file=sys.stderr)
                print(tail(files[i].with_suffix(".err")), file=sys.stderr)
                raise SystemExit(EXIT_NO_DISTRIBUTED if rc == EXIT_NO_DISTRIBUTED else 1)
            if all(p.returncode == 0 for p in procs):
                break
            if time.monotonic() > end:
                stop(procs)
                for i in range(len(procs)):
                    print(f"{PROG}: {name} timed out; worker {i}'s stderr:", file=sys.stderr)
                    print(tail(files[i].with_suffix(".err")), file=sys.stderr)
                raise SystemExit(1)
            time.sleep(0.05)
        return [json.loads(f.with_suffix(".json").read_text()) for f in files]
    finally:
        stop(procs)


def launch(args: argparse.Namespace) -> dict[str, Any]:
    """The three jobs in turn; their results and wall times."""
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` runs
    try:
        with tempfile.TemporaryDirectory(prefix="mirror-cost-") as tmp:
            folder = Path(tmp)
            walls = {}
            t = time.monotonic()
            (smollm,) = run_job(args, folder, "smollm", [([], {})])
            walls["smollm"] = time.monotonic() - t
            t = time.monotonic()
            eight = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
            (tiny8,) = run_job(args, folder, "tiny8", [([], eight)])
            walls["tiny8"] = time.monotonic() - t
            t = time.monotonic()
            four = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"}
            port = str(free_port())
            shared = [
                "--coordinator-port", port,
                "--messages", str(folder / "smollm0.batches.pkl"),
                "--tiny-batches", str(folder / "tiny80.batches.pkl"),
            ]  # fmt: skip
            mirror = run_job(args, folder, "mirror", [([*shared, "--process-id", str(i)], four) for i in range(2)])
            walls["mirror"] = time.monotonic() - t
    finally:
        signal.signal(signal.SIGTERM, previous)
    return {"smollm": smollm, "tiny8": tiny8, "mirror": mirror, "wall_s": walls}


def verdict(ms: float, step_ms: float) -> str:
    return "PASS" if ms <= TARGET_MS and ms <= TARGET_FRACTION * step_ms else "FAIL"


def summarize(args: argparse.Namespace, r: dict[str, Any]) -> dict[str, Any]:
    smollm, tiny8, (p0, p1) = r["smollm"], r["tiny8"], r["mirror"]
    ch = p0["channel"]
    w = args.warmup
    start, end, back, arrive = (ch[k][w:] for k in ("start", "end", "back", "arrive"))
    send = [b - a for a, b in zip(start, end, strict=True)]
    deliver = [b - a for a, b in zip(start, arrive, strict=True)]
    half_rtt = [(b - a) / 2 for a, b in zip(start, back, strict=True)]
    ordered = all(a <= t <= b for a, t, b in zip(ch["start"], ch["arrive"], ch["back"], strict=True))
    step = stats_ms(smollm["step_ns"])
    s, d, h = stats_ms(send), stats_ms(deliver), stats_ms([round(v) for v in half_rtt])
    step_ms = step["median_ms"]
    frames = ch["frame_bytes"][w:]
    tiny1, tinym = stats_ms(tiny8["step_ns"]), stats_ms(p0["tiny_ns"])
    return {
        "settings": {
            "steps": args.steps,
            "warmup": args.warmup,
            "tiny_steps": args.tiny_steps,
            "tiny_warmup": args.tiny_warmup,
            "gap_ms": args.gap_ms,
            "rows": ROWS,
            "prompt_len": PROMPT_LEN,
            "processes": 2,
            "local_devices": LOCAL_DEVICES,
            "tiny_layout": TINY_LAYOUT,
        },
        "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "smollm": {k: v for k, v in smollm.items() if k != "step_ns"} | {"steps": len(smollm["step_ns"])},
        "clocks": [p0["clocks"], p1["clocks"]],
        "arrivals_between_send_and_answer": ordered,
        "messages_equal": bool(p0["messages_equal"] and p1["messages_equal"]),
        "followed_steps": p1["followed_steps"],
        "frame_bytes": {"min": min(frames), "max": max(frames)},
        "step": step,
        "send": s,
        "deliver": d,
        "half_rtt": h,
        "send_fraction": s["median_ms"] / step_ms,
        "deliver_fraction": d["median_ms"] / step_ms,
        "send_verdict": verdict(s["median_ms"], step_ms),
        "deliver_verdict": verdict(d["median_ms"], step_ms),
        "tiny_one_process": tiny1 | {"steps": len(tiny8["step_ns"]), "devices": tiny8["devices"]},
        "tiny_mirrored": tinym | {"steps": len(p0["tiny_ns"])},
        "tiny_extra_ms": tinym["median_ms"] - tiny1["median_ms"],
        "target_ms": TARGET_MS,
        "target_fraction": TARGET_FRACTION,
        "wall_s": r["wall_s"],
    }


def table(m: dict[str, Any]) -> str:
    sm, st = m["smollm"], m["settings"]
    b = sm["batch"]
    lines = [
        f"SmolLM2-135M ({sm['model']}, weights {sm['weights']}, layout single, {sm['devices']} CPU device, "
        f"attention: {sm['attention']}); max_seq_len {sm['max_seq_len']}, "
        f"pages of {sm['page_size']}; {st['rows']} decoding rows at positions {sm['positions'][0]}-"
        f"{sm['positions'][1]}",
        f"message: ('step', (RaggedBatch, PREVIOUS), {{}}), tokens {b['tokens'][0]} {b['tokens'][1]}, "
        f"page_tables {b['page_tables'][0]} {b['page_tables'][1]}; frame {m['frame_bytes']['min']}-"
        f"{m['frame_bytes']['max']} B; {st['steps']} messages after {st['warmup']} of warm-up, "
        f"{st['gap_ms']} ms apart; 2 processes x {st['local_devices']} CPU devices",
        f"{'figure':<42}{'median':>9}{'p90':>9}{'min':>9}{'max':>9}{'steps':>7}",
    ]

    def row(name: str, s: dict[str, float], n: int) -> None:
        lines.append(f"{name:<42}{s['median_ms']:>9.3f}{s['p90_ms']:>9.3f}{s['min_ms']:>9.3f}{s['max_ms']:>9.3f}{n:>7}")

    row("send (channel.send of a step, process 0)", m["send"], st["steps"])
    row("deliver (send start -> follower unpickled)", m["deliver"], st["steps"])
    row("rtt/2 (send start -> answer on process 0)", m["half_rtt"], st["steps"])
    row("step: SmolLM2-135M B=8 decode, 1 process", m["step"], sm["steps"])
    row(f"tiny {st['tiny_layout']}, 1 process x 8 devices", m["tiny_one_process"], m["tiny_one_process"]["steps"])
    row(f"tiny {st['tiny_layout']}, mirrored, 2 processes x 4", m["tiny_mirrored"], m["tiny_mirrored"]["steps"])
    lines += [
        f"send / step    {100 * m['send_fraction']:6.2f} %   {m['send_verdict']} (<= {m['target_ms']} ms and "
        f"<= {100 * m['target_fraction']:.0f} % of the step)",
        f"deliver / step {100 * m['deliver_fraction']:6.2f} %   {m['deliver_verdict']}",
        f"tiny mirrored - 1 process: {m['tiny_extra_ms']:+.3f} ms a step (the send, the follower's start and the "
        "collectives across the processes)",
        f"checks: messages equal {m['messages_equal']}; every arrival between its send and the answer "
        f"{m['arrivals_between_send_and_answer']}; clocks {m['clocks'][0]['monotonic']}; follower ran "
        f"{m['followed_steps']} steps",
        "(ms)",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        description="The mirror's per-step cost (a step's message over the StepChannel) against a B=8 SmolLM2-135M step.",
    )
    parser.add_argument("--steps", type=positive_int, default=200, help="timed messages (%(default)s)")
    parser.add_argument(
        "--warmup", type=nonnegative_int, default=20, help="untimed messages and SmolLM2 steps first (%(default)s)"
    )
    parser.add_argument("--tiny-steps", type=positive_int, default=50, help="timed tiny-model steps (%(default)s)")
    parser.add_argument("--tiny-warmup", type=nonnegative_int, default=5, help="untimed tiny steps (%(default)s)")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="pause before each message (%(default)s)")
    parser.add_argument(
        "--weights",
        choices=("auto", "stored", "float32"),
        default="auto",
        help="SmolLM2's weights: as the server on one CPU device (auto), blocks as stored, float32",
    )
    parser.add_argument("--timeout", type=positive_int, default=300, help="seconds per job (%(default)s)")
    parser.add_argument("--json", help="write the results here")
    # a worker's own flags (the parent passes them)
    parser.add_argument("--worker", choices=("smollm", "tiny8", "mirror"), help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--messages", help=argparse.SUPPRESS)
    parser.add_argument("--tiny-batches", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return run_worker(args)
    if args.json:
        check_writable_file(args.json, PROG)
    summary = summarize(args, launch(args))
    print(table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    if not (summary["messages_equal"] and summary["arrivals_between_send_and_answer"]):
        print(f"{PROG}: a message arrived different, or an arrival outside its round trip", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
