"""Several JAX processes serving one model (jax.distributed, multi-controller SPMD): process 0
schedules, and every process runs the same engine calls in the same order on the global mesh.

* ``initialize``: JAX's CPU collectives (gloo) and ``jax.distributed.initialize``; call it before
  any other JAX use (the CPU backend takes its collectives from the distributed client when it
  is first made).
* ``StepChannel``: one TCP connection from process 0 to each other process, opened once (process
  0 publishes its listening address in the distributed runtime's key-value store), carrying
  length-prefixed pickled messages (cheaper per step than the key-value store or
  ``broadcast_one_to_all``: docs/multiprocess.md has the figures). Pickle runs whatever the peer
  sends: the channel is for the processes of one job, on a trusted network.
* Mirroring (``Runner.channel`` on process 0, ``follow`` on the others): each runner call that
  launches JAX work (``service.engine.runner.MIRRORED``: the step, warm-up and a live switch's
  calls) is first sent to the followers, which make the same call on their own runner, so every
  process dispatches the same programs in the same order. A step carries everything it needs in
  its batch; its ``prev`` (the previous step's output, a device array) travels as
  ``runner.PREVIOUS``: each follower passes its own previous output. A draft model's runner
  (speculative decoding) mirrors its calls over the same channel, tagged (``DraftChannel``), to
  each follower's own draft runner.
* Faults: each follower sends a heartbeat byte every ``HEARTBEAT_S`` on its connection
  (``Heartbeat``); process 0's ``StepChannel.watch`` marks the channel lost (``fault``) when a
  connection closes (the process exited) or stays silent for ``timeout_s`` (it hangs), then
  closes every connection, so the other followers, whose heartbeat can no longer be sent, exit.
* The runner's own part (``service.engine.runner.global_array``): a step's host inputs become
  ``jax.Array``s on a sharding that spans the processes, each process placing its own shards.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import socket
import struct
import threading
import time
from typing import Any

import jax

from service.engine.output import StepOutput
from service.engine.runner import MIRRORED, PREVIOUS, STOP, Runner
from sharding.layouts import Layout

log = logging.getLogger(__name__)

CPU_COLLECTIVES = "gloo"
ADDRESS_KEY = "meshserve/step_channel"
CONFIG = "config"  # process 0's first message to a serving follower: the ServerConfig to build from
DRAFT = "draft"  # a draft model runner's mirrored call, wrapped (``DraftChannel``)
HEARTBEAT_S = 1.0  # a follower's heartbeat period, seconds
EXIT_LEADER_LOST = 3  # a follower's exit status when process 0 went away
# How long JAX's shutdown barrier waits for every process (its default, 300 s, would hold a
# stopping process that long when another already died).
SHUTDOWN_TIMEOUT_S = 30
_HEADER = struct.Struct("<Q")
# Why this process's job broke (a process lost, seen by ``StepChannel.watch``), or None; read by
# ``serve``'s exit (a broken job skips JAX's distributed shutdown, which would wait for the lost).
lost: str | None = None


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None) -> None:
    """Join the job: gloo CPU collectives, then ``jax.distributed.initialize`` (process 0 also
    runs the coordinator service at ``coordinator``, HOST:PORT). What is None JAX fills in: the
    address from ``JAX_COORDINATOR_ADDRESS``, and all three from the cluster it detects (Cloud
    TPU slices, SLURM, Open MPI, GKE; ``jax/_src/clusters``). JAX's heartbeat timeout (100 s)
    is kept: it is what ends the processes of a broken job that nothing else ends. Before any
    other JAX use.

    Raises:
        RuntimeError / ValueError: JAX could not join (no address to use, a coordinator that
            does not answer within JAX's ``initialization_timeout``, 300 s).
    """
    jax.config.update("jax_cpu_collectives_implementation", CPU_COLLECTIVES)
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
        shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S,
    )  # fmt: skip


def coordinator_host() -> str:
    """The host part of the job's coordinator address (process 0's host, which every process
    reaches by definition), after ``initialize``."""
    from jax._src import distributed  # the address JAX resolved is private in jax 0.10.2

    address = distributed.global_state.coordinator_address or "127.0.0.1:0"
    return address.rsplit(":", 1)[0].strip("[]")


def job_layout_problem(layout: Layout) -> str | None:
    """Why a job over several processes cannot serve on ``layout`` (a mesh without devices of
    every process: the others could not run its steps, nor process 0 read what runs only on
    theirs), or None. A layout must use all the job's devices."""
    if jax.process_count() > 1 and layout.num_devices != jax.device_count():
        return (
            f"layout {layout.name!r} uses {layout.num_devices} devices; a job over {jax.process_count()} processes "
            f"serves on all of its {jax.device_count()} (e.g. --layout 1x{jax.device_count()})"
        )
    return None


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    while view:
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionError("the peer closed the step channel")
        view = view[got:]
    return bytes(buf)


class StepChannel:
    """Process 0's connections to the followers (``peers``), or a follower's one to process 0.

    ``send`` (process 0) writes one message to every follower; ``recv`` (a follower) reads one.
    A message is an 8-byte little-endian length and a pickle (protocol 5) of any picklable
    object: numpy arrays, dataclasses such as ``RaggedBatch``, small Python values.
    """

    def __init__(self, peers: list[socket.socket], process_id: int):
        self.peers = peers
        self.process_id = process_id
        self.fault: str | None = None  # process 0: why a follower is lost (``watch``), else None
        self._closed = False
        self._finishing = False  # process 0 sent its last message: a follower closing is expected

    @classmethod
    def open(cls, host: str = "127.0.0.1", timeout_s: float = 120.0, bind: str | None = None) -> StepChannel:
        """Connect this process of the job (after ``initialize``): process 0 listens on an
        ephemeral port of ``bind`` (default ``host``; "" = every interface), publishes
        HOST:PORT under ``ADDRESS_KEY`` in the key-value store and accepts one connection from
        each other process (each says its process id); the others read the address and connect.
        Process 0 never unpickles what a follower sends (ids and heartbeat bytes only).

        Raises:
            TimeoutError / ConnectionError: a process did not connect within ``timeout_s``.
        """
        from jax._src import distributed  # the key-value store is private in jax 0.10.2

        client = distributed.global_state.client
        if client is None:
            raise RuntimeError("StepChannel.open needs jax.distributed to be initialized first")
        me, count = jax.process_index(), jax.process_count()
        if me == 0:
            with socket.create_server((host if bind is None else bind, 0)) as server:
                server.settimeout(timeout_s)
                client.key_value_set(ADDRESS_KEY, f"{host}:{server.getsockname()[1]}")
                by_id: dict[int, socket.socket] = {}
                end = time.monotonic() + timeout_s
                while len(by_id) < count - 1:
                    server.settimeout(max(0.1, end - time.monotonic()))
                    conn, _ = server.accept()
                    conn.settimeout(None)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    (peer,) = struct.unpack("<I", _recv_exact(conn, 4))
                    by_id[peer] = conn
            return cls([by_id[i] for i in sorted(by_id)], me)
        address = client.blocking_key_value_get(ADDRESS_KEY, int(timeout_s * 1000))
        where, port = address.rsplit(":", 1)
        sock = socket.create_connection((where, int(port)), timeout=timeout_s)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(struct.pack("<I", me))
        return cls([sock], me)

    def send(self, message: Any) -> None:
        """Process 0: ``message`` to every follower."""
        blob = pickle.dumps(message, protocol=5)
        frame = _HEADER.pack(len(blob)) + blob
        for peer in self.peers:
            peer.sendall(frame)

    def recv(self) -> Any:
        """A follower: the next message from process 0 (blocks).

        Raises:
            ConnectionError: process 0 closed the channel.
        """
        (size,) = _HEADER.unpack(_recv_exact(self.peers[0], _HEADER.size))
        return pickle.loads(_recv_exact(self.peers[0], size))

    def close(self) -> None:
        self._closed = True
        for peer in self.peers:
            with contextlib.suppress(OSError):
                peer.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it
            with contextlib.suppress(OSError):
                peer.close()

    def watch(self, timeout_s: float) -> threading.Thread:
        """Process 0: a daemon thread that reads the followers' heartbeats and sets ``fault``
        when a follower's connection closes (it exited or was killed: seen at once) or carries
        nothing for ``timeout_s`` seconds (it hangs, or its host is gone), then closes every
        connection (the other followers then exit: ``Heartbeat``). Returns the started thread."""

        def run() -> None:
            last = {sock: time.monotonic() for sock in self.peers}
            ids = {sock: i + 1 for i, sock in enumerate(self.peers)}  # peers are sorted by process id
            while not (self._closed or self._finishing):
                try:
                    ready, _, _ = select.select(list(last), [], [], min(1.0, timeout_s))
                except (OSError, ValueError):  # closed under us
                    return
                now = time.monotonic()
                for sock in ready:
                    try:
                        got = sock.recv(4096)
                    except OSError:
                        got = b""
                    if not got:
                        if self._finishing:
                            return
                        self._lose(f"process {ids[sock]} closed its step channel (it exited or was killed)")
                        return
                    last[sock] = now
                for sock, seen in last.items():
                    if now - seen > timeout_s and not self._finishing:
                        self._lose(f"process {ids[sock]} sent no heartbeat for {now - seen:.1f} s (it hangs)")
                        return

        thread = threading.Thread(target=run, name="step-channel-watch", daemon=True)
        thread.start()
        return thread

    def finish(self, timeout_s: float = 30.0) -> bool:
        """Process 0's last word: send ``STOP``, wait up to
        ``timeout_s`` for each follower to close its end (it got it and is leaving), then close.
        Returns whether every follower closed in time (a lost one never does)."""
        self._finishing = True
        with contextlib.suppress(OSError):
            self.send((STOP, (), {}))
        end = time.monotonic() + timeout_s
        closed = 0
        for sock in self.peers:
            with contextlib.suppress(OSError, ValueError):
                while (left := end - time.monotonic()) > 0:
                    ready, _, _ = select.select([sock], [], [], left)
                    if ready and not sock.recv(4096):
                        closed += 1
                        break
        self.close()
        return closed == len(self.peers)

    def _lose(self, why: str) -> None:
        global lost
        if self._closed:
            return
        self.fault = lost = why
        log.error("multi-process job broken: %s; closing the step channel", why)
        self.close()


class Heartbeat:
    """A follower's heartbeat to process 0: a byte every ``interval_s`` seconds on its step
    channel connection, from a daemon thread. When the byte cannot be sent (process 0 exited, or
    closed the channel after losing another follower) the process ends at once with
    ``EXIT_LEADER_LOST`` (``os._exit``: its main thread may be blocked in a collective that will
    never complete, and an interpreter exit could wait in JAX's distributed shutdown)."""

    def __init__(self, channel: StepChannel, interval_s: float = HEARTBEAT_S):
        self._sock = channel.peers[0]
        self._interval_s = interval_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self._interval_s):
            try:
                self._sock.sendall(b"\x01")
            except OSError as exc:
                if self._done.is_set():
                    return
                log.error("process 0 is gone (%s): exiting", exc)
                logging.shutdown()
                os._exit(EXIT_LEADER_LOST)

    def stop(self) -> None:
        """Stop beating (a clean ``STOP``: the channel closes next)."""
        self._done.set()


class DraftChannel:
    """The channel a draft model's runner mirrors its calls over (process 0 of a job speculating
    with ``--speculative draft:MODEL``): each call travels as ``(DRAFT, (call,), {})`` on the
    target's channel, in order with the target's calls, so a follower makes it on its own draft
    runner (``follow``)."""

    def __init__(self, channel: StepChannel):
        self.channel = channel

    def send(self, message: Any) -> None:
        self.channel.send((DRAFT, (message,), {}))


class _Replay:
    """A follower's copy of one of process 0's runners: its calls made in order, a step's
    ``PREVIOUS`` marker replaced by this runner's own last output."""

    def __init__(self, runner: Runner):
        self.runner = runner
        self.last: StepOutput | None = None
        self.pending: Runner | None = None  # a live switch's new runner, until it adopts the old one's state
        self.steps = 0

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if name not in MIRRORED:
            raise ValueError(f"a follower got {name!r}, not one of {MIRRORED}")
        if name == "step":
            batch, prev = args
            if prev == PREVIOUS and self.last is None:
                raise ValueError("a step reads the previous step's output, but this follower ran none")
            self.last = self.runner.dispatch(batch, self.last if prev == PREVIOUS else None)
            self.steps += 1
        elif name == "relayout":
            layout, ids = args
            by_id = {d.id: d for d in jax.devices()}
            self.pending = self.runner.relayout(layout, [by_id[i] for i in ids])
        elif name in ("warmup_to_replace", "adopt_state"):
            if self.pending is None:
                raise ValueError(f"a follower got {name!r} with no relayout before it")
            getattr(self.pending, name)(self.runner)
            if name == "adopt_state":
                self.runner, self.pending, self.last = self.pending, None, None
        else:
            getattr(self.runner, name)(*args, **kwargs)


def follow(runner: Runner, channel: StepChannel, draft: Runner | None = None) -> int:
    """A follower's loop: make each call process 0's runner sends, in order, on ``runner`` (a
    call tagged ``DRAFT`` on ``draft``, the draft model's runner), until ``STOP``; then wait
    for the last steps to finish. Returns the target's steps run.

    A live switch arrives as ``relayout`` (the new runner is built beside the old one),
    ``warmup_to_replace`` and ``adopt_state`` (the new one takes over and the old is dropped).

    Raises:
        ValueError: a message that is not one of ``MIRRORED``, out of order, or a draft
            runner's call without ``draft``.
        ConnectionError: process 0 went away without ``STOP``.
    """
    target = _Replay(runner)
    drafter = _Replay(draft) if draft is not None else None
    while True:
        name, args, kwargs = channel.recv()
        if name == STOP:
            break
        if name == DRAFT:
            if drafter is None:
                raise ValueError("a follower without a draft model got a draft model's call")
            ((name, args, kwargs),) = args
            drafter.call(name, args, kwargs)
        else:
            target.call(name, args, kwargs)
    for replay in (target, drafter):
        if replay is not None and replay.last is not None:
            replay.last.packed.block_until_ready()
    return target.steps
