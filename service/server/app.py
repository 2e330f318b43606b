"""The server's composition root: bind the ports (gRPC with health and reflection, Prometheus
metrics, the OpenAI-compatible HTTP API), load the model into the gateway, watch the engine
loops, and drain on SIGTERM (``start_server``, ``serve_forever``, ``ServerThread``). A follower
of a job over several processes serves no port (``follow_job``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import jax
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from protos.meshserve.v1 import meshserve_pb2_grpc as pb_grpc
from service.server.admin import start_admin_server
from service.server.config import ServerConfig
from service.server.gateway import Gateway
from service.server.grpc_api import SERVICE_NAME, GenerationServicer
from service.server.http_api import HttpServer, bind
from service.server.logs import log
from service.server.startup import Job, join_job, load
from service.server.wire import add_servicer

# gRPC sets SO_REUSEPORT by default, so a second server could bind a port that a running one
# holds and split its traffic; without it a busy port is a clear startup error.
NO_PORT_SHARING = [("grpc.so_reuseport", 0)]
# After the grace period, how long the streams failed with UNAVAILABLE get to write that ending
# before the servers stop: writing an event or a status takes milliseconds for a reading client.
FLUSH_S = 2.0


class RunningServer:
    """A started server: its bound ports, its gateway, and how to stop it."""

    def __init__(self, server: grpc.aio.Server, gateway: Gateway, health: health_aio.HealthServicer, port: int):
        self.server = server
        self.gateway = gateway
        self.job: Job | None = None  # this process's part in a job over several processes
        self.health = health
        self.port = port
        self._watchdog: asyncio.Task | None = None
        self._stopped = False
        self.admin_server: grpc.aio.Server | None = None
        self.admin_port: int | None = None
        self.metrics_httpd: Any = None  # the Prometheus HTTP server (None when metrics_port is 0)
        self.metrics_port: int | None = None
        self.http: HttpServer | None = None  # the OpenAI-compatible API (None when http_port is 0)
        self.http_port: int | None = None

    async def set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)
        self.gateway.serving = serving
        self.gateway.metrics.serving.set(1 if serving else 0)

    async def watch(self, interval_s: float | None = None) -> None:
        """The watchdog: keep health in step with the engine loops (dead or stalled ->
        NOT_SERVING) and fail the in-flight requests of a broken pool with UNAVAILABLE (its loop
        thread cannot: it is dead or stuck). Checks every ``watchdog_interval_s``."""
        gateway = self.gateway
        interval_s = gateway.cfg.watchdog_interval_s if interval_s is None else interval_s
        last: bool | None = None
        reported: dict[str, str | None] = {}
        while True:
            try:
                for pool in gateway.pools:
                    problem = gateway.pool_problem(pool)
                    if problem != reported.get(pool.name):
                        if problem is None:
                            log.warning("pool %s: the engine loop is making progress again", pool.name)
                        else:
                            log.error("pool %s: %s", pool.name, problem)
                        reported[pool.name] = problem
                    if problem is not None:
                        n = gateway.fail_inflight(pool.name, f"pool {pool.name}: {problem}")
                        if n:
                            log.error("pool %s: failed %d in-flight request(s) with UNAVAILABLE", pool.name, n)
                now = gateway.healthy() and gateway.accepting
                if now != last:
                    await self.set_health(now)
                    if last is not None:
                        log.warning("health: %s", "SERVING" if now else "NOT_SERVING")
                    last = now
            except Exception:
                log.exception("watchdog check failed")
            await asyncio.sleep(interval_s)

    async def shutdown(self, grace_s: float) -> None:
        """Stop admitting (UNAVAILABLE, health NOT_SERVING), let in-flight streams finish for up
        to ``grace_s`` seconds, then fail the rest with UNAVAILABLE (gRPC's status; an error
        event before ``[DONE]`` on HTTP), give their transports up to ``FLUSH_S`` seconds to
        write that ending, and stop. A request is in flight until its response's last byte is
        handed to its connection (``Gateway.inflight``), so a stream is never cut between its
        last token and its end. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        gateway = self.gateway
        gateway.accepting = False
        await self.set_health(False)
        if left := await self._inflight_after(grace_s):
            log.warning("grace period over: ending %d in-flight stream(s) with UNAVAILABLE", left)
        for pool in gateway.pools:
            await asyncio.to_thread(pool.loop.stop, 5.0)  # fails what is left with UNAVAILABLE
        gateway.fail_inflight(None, "the server is shutting down")  # whatever a stuck loop still holds
        if left := await self._inflight_after(FLUSH_S):
            log.warning("%d stream(s) not written to their end in %.0f s: their clients do not read", left, FLUSH_S)
        if self.job is not None:
            self.job.release_followers()
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.admin_server is not None:
            await self.admin_server.stop(1.0)
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(1.0)
        if self.metrics_httpd is not None:
            await asyncio.to_thread(self.metrics_httpd.shutdown)
            self.metrics_httpd.server_close()

    async def _inflight_after(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` seconds for no request to be in flight; how many still are."""
        inflight = self.gateway.inflight
        deadline = time.monotonic() + timeout_s
        while any(inflight.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return sum(len(r) for r in inflight.values())


class PortInUse(RuntimeError):
    """A port ``serve`` needs is held by another process; the message says which flag to change."""


def port_in_use(host: str, port: int) -> bool:
    """Whether another socket listens on ``host:port`` (bound as gRPC binds: SO_REUSEADDR, no
    SO_REUSEPORT). False for port 0 and for hosts this cannot resolve (gRPC's bind decides)."""
    if port == 0:
        return False
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False


def grpc_port_message(host: str, port: int) -> str:
    return (
        f"port {port} on {host} is in use (another 'meshserve serve' or another program holds it); "
        "pick a free one with --port (0 = any free port)"
    )


def http_port_message(host: str, port: int) -> str:
    return (
        f"HTTP port {port} on {host} is in use (a second server needs its own HTTP port); "
        "pick a free one with --http-port, or --http-port 0 for no HTTP API"
    )


def metrics_port_message(host: str, port: int) -> str:
    return (
        f"metrics port {port} on {host} is in use (a second server needs its own metrics port); "
        "pick a free one with --metrics-port, or --metrics-port 0 for no metrics"
    )


async def start_server(cfg: ServerConfig, on_admit: Callable[[], None] | None = None) -> RunningServer:
    """Bind and start the gRPC server (health NOT_SERVING), the metrics endpoint and the HTTP API
    at once, then load the model and compile; health turns SERVING when warm-up is done (until
    then Generate is UNAVAILABLE and the HTTP API answers 503).

    Raises:
        PortInUse: the gRPC, metrics, HTTP or Admin port is held by another process (checked
            before gRPC binds, so no gRPC error is logged).
        RuntimeError: a port could not be bound; any load/compile error of ``startup.load``.
    """
    if port_in_use(cfg.host, cfg.port):
        raise PortInUse(grpc_port_message(cfg.host, cfg.port))
    if cfg.metrics_port and port_in_use(cfg.host, cfg.metrics_port):
        raise PortInUse(metrics_port_message(cfg.host, cfg.metrics_port))
    if cfg.http_port and port_in_use(cfg.host, cfg.http_port):
        raise PortInUse(http_port_message(cfg.host, cfg.http_port))
    if cfg.admin_token and port_in_use(cfg.admin_host, cfg.admin_port):  # bound after loading: check now
        raise PortInUse(f"admin port {cfg.admin_port} on {cfg.admin_host} is in use; pick a free one with --admin-port")
    server = grpc.aio.server(options=NO_PORT_SHARING)
    gateway = Gateway(cfg)
    gateway.on_admit = on_admit
    servicer = GenerationServicer(gateway)
    add_servicer(pb_grpc.add_GenerationServicer_to_server, servicer, server, on_undecodable=servicer.count_undecodable)
    health = health_aio.HealthServicer()
    add_servicer(health_pb2_grpc.add_HealthServicer_to_server, health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    try:
        port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    except RuntimeError as exc:  # grpcio raises where it does not return 0
        raise RuntimeError(f"could not bind {cfg.host}:{cfg.port}: {exc}; pick another --port") from exc
    if port == 0:
        raise RuntimeError(f"could not bind {cfg.host}:{cfg.port}; pick another --port")
    running = RunningServer(server, gateway, health, port)
    if cfg.metrics_port:
        try:
            running.metrics_httpd, _ = start_http_server(
                cfg.metrics_port, addr=cfg.host, registry=gateway.metrics.registry
            )
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(metrics_port_message(cfg.host, cfg.metrics_port)) from exc
            raise RuntimeError(f"could not bind the metrics port {cfg.host}:{cfg.metrics_port}: {exc}") from exc
        running.metrics_port = running.metrics_httpd.server_port
        log.info("Prometheus metrics on http://%s:%d/metrics", cfg.host, running.metrics_port)
    await running.set_health(False)
    await server.start()
    log.info("listening on %s:%d (NOT_SERVING until warm-up is done)", cfg.host, port)
    try:
        if cfg.http_port:
            running.http = await start_openai_api(gateway, cfg.host, cfg.http_port)
            running.http_port = running.http.port
            log.info(
                "OpenAI-compatible API on http://%s:%d/v1 (uvicorn, %s)",
                cfg.host,
                running.http_port,
                running.http.parser,
            )
        running.job = await asyncio.to_thread(_join_and_load, gateway)
        if cfg.admin_token:
            running.admin_server, running.admin_port = await start_admin_server(gateway, cfg)
    except BaseException:
        await server.stop(0)
        if running.http is not None:
            await running.http.stop()
        if running.metrics_httpd is not None:
            running.metrics_httpd.shutdown()
            running.metrics_httpd.server_close()
        raise
    running._watchdog = asyncio.create_task(running.watch())
    log.info("SERVING on %s:%d", cfg.host, port)
    return running


def _join_and_load(gateway: Gateway) -> Job | None:
    """Process 0 of a job over several processes joins it first (``join_job``); then the model is
    loaded into ``gateway``. Returns the job, or None on one process."""
    job = join_job(gateway.cfg)[0] if jax.process_count() > 1 else None
    load(gateway, job)
    return job


async def start_openai_api(gateway: Gateway, host: str, port: int) -> HttpServer:
    """Bind ``host:port`` and serve the OpenAI-compatible API on it (``service/server/http_api.py``).

    Raises:
        PortInUse: the port is held.
        RuntimeError: it cannot be bound otherwise, or uvicorn failed to start.
    """
    try:
        sock = bind(host, port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(http_port_message(host, port)) from exc
        raise RuntimeError(f"could not bind the HTTP port {host}:{port}: {exc}") from exc
    http = HttpServer(gateway, sock)
    try:
        await http.start()
    except BaseException:
        sock.close()
        raise
    return http


def _end_startup(sig: signal.Signals) -> None:
    """SIGTERM or SIGINT before SERVING: end the process now, by the signal's default action.
    Loading and compiling run in a thread that cannot be interrupted (minutes for a large model
    on a small machine), no request is in flight to drain, and the OS frees the bound ports; so
    an orchestrator's stop is obeyed at once instead of after the warm-up (its grace period
    would otherwise run out into a SIGKILL)."""
    log.warning("%s before the server was SERVING: exiting without serving", sig.name)
    for handler in logging.getLogger().handlers:
        handler.flush()
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)


async def serve_forever(cfg: ServerConfig) -> int:
    """Run until SIGTERM/SIGINT, then shut down gracefully; returns the exit code (0). A signal
    during start-up (loading, compiling) ends the process at once (``_end_startup``), until the
    first request is admitted (which can be just before SERVING) or start-up ends."""
    stop = asyncio.Event()
    aloop = asyncio.get_running_loop()
    graceful = False

    def drain_on_signal() -> None:  # on the event loop, before a request is submitted
        nonlocal graceful
        if not graceful:
            graceful = True
            for sig in (signal.SIGTERM, signal.SIGINT):
                aloop.add_signal_handler(sig, stop.set)

    for sig in (signal.SIGTERM, signal.SIGINT):
        aloop.add_signal_handler(sig, _end_startup, sig)
    running = await start_server(cfg, on_admit=drain_on_signal)
    drain_on_signal()  # no await since start_server returned: no signal is lost
    await stop.wait()
    log.info("signal received: draining for up to %.0f s", cfg.grace_period_s)
    await running.shutdown(cfg.grace_period_s)
    return 0


def follow_job(cfg: ServerConfig) -> int:
    """A follower's ``serve`` in a job over several processes (``jax.process_index() > 0``):
    build process 0's runner from process 0's config and replay its calls until it sends
    ``STOP`` (its SIGTERM drain is over); returns the exit code (0). No port is opened here.

    Raises: what ``startup.load`` raises; ``ConnectionError`` when process 0 went away without
    ``STOP``.
    """
    job, cfg = join_job(cfg)
    steps = load(Gateway(cfg), job)
    log.info("process %d: process 0 ended the job after %d steps", jax.process_index(), steps)
    if job.heartbeat is not None:
        job.heartbeat.stop()  # before the channel closes: a beat that cannot be sent ends the process
    job.channel.close()
    return 0


class ServerThread:
    """Run a server on a background thread with its own event loop (tests, benchmarks).

    ``start()`` blocks until the server is SERVING (or raises what startup raised).
    """

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.running: RunningServer | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpc-server", daemon=True)

    def start(self) -> ServerThread:
        self._thread.start()
        self.running = asyncio.run_coroutine_threadsafe(start_server(self.cfg), self._loop).result()
        return self

    @property
    def address(self) -> str:
        assert self.running is not None
        return f"{self.cfg.host}:{self.running.port}"

    def stop(self, grace_s: float = 0.0) -> None:
        """Drain (``RunningServer.shutdown``) and stop the thread's event loop; idempotent."""
        if not self._thread.is_alive():
            return
        if self.running is not None:
            asyncio.run_coroutine_threadsafe(self.running.shutdown(grace_s), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
