"""The Admin gRPC service: list layouts, read a pool's layout, switch it live.

Off unless an admin token is configured; then it listens on its own port (loopback by
default) and every call must carry ``authorization: Bearer <token>`` (UNAUTHENTICATED
otherwise). A switch builds the new runner (weights moved device to device) and compiles what
the traffic so far needs on a worker thread while the old runner keeps serving, then the engine
loop moves the live KV pool across at a step boundary (``EngineLoop.switch_runner``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import TYPE_CHECKING

import grpc

from model.config import ITEMSIZE
from model.kernels import choose
from model.weights.packed_weights import packed_head_bytes
from protos.meshserve.v1 import admin_pb2 as apb
from protos.meshserve.v1 import admin_pb2_grpc as apb_grpc
from service.engine import kv_pool
from service.engine.config import resolve_kv_dtype
from service.engine.distributed import job_layout_problem
from service.server.validation import InvalidRequest
from service.server.wire import add_servicer
from sharding.layouts import Layout, LayoutError, load_layout, preset_names
from sharding.plan import make_plan

if TYPE_CHECKING:
    from service.server.config import ServerConfig
    from service.server.gateway import Gateway
    from service.server.pools import Pool

log = logging.getLogger("meshserve.admin")


def layout_info(gateway: Gateway, layout: Layout, pool: Pool | None = None) -> apb.LayoutInfo:
    """Predictions for ``layout`` on the served model (raises LayoutError if it cannot work):
    the weight bytes as the gateway's model holds them (its blocks, ``ModelFacts.formats``, split
    as ``sharding.rules`` splits them on ``layout``; the rest in the engine's dtype: a live
    switch moves the blocks as they are), and the KV pool's bytes (each device holds its data
    replica's share)."""
    facts, ecfg = gateway.facts, gateway.cfg.engine
    assert facts is not None, "admin calls are served only after the model is loaded"
    plan = make_plan(layout, facts.cfg, ecfg.num_slots)
    itemsize, kv_dtype = ITEMSIZE[ecfg.dtype], resolve_kv_dtype(ecfg.kv_dtype, ecfg.dtype)
    pool_tokens = kv_pool.whole_pages(ecfg.num_pages * ecfg.page_size, ecfg.page_size, layout.data)
    info = apb.LayoutInfo(
        name=layout.name,
        data=layout.data,
        model=layout.model,
        attention=plan.attention,
        weight_bytes_per_device=plan.weight_bytes_per_device(facts.cfg, itemsize, facts.formats),
        kv_cache_bytes_per_device=plan.kv_bytes_per_device(facts.cfg, pool_tokens, kv_dtype),
        all_reduces_per_layer=plan.all_reduces_per_layer,
        description=layout.description,
    )
    if pool is not None:
        info.pool = pool.name
        info.device_ids.extend(d.id for d in pool.loop.runner.mesh.devices.flat)
    return info


class AdminService(apb_grpc.AdminServicer):
    """Admin RPCs over the pools of one gateway."""

    def __init__(self, gateway: Gateway, token: str):
        self.gateway = gateway
        self._token = token
        self._switch_lock = asyncio.Lock()

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        metadata = dict(context.invocation_metadata() or ())
        sent = metadata.get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {self._token}".encode()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "admin calls need 'authorization: Bearer <token>'")

    async def _pool(self, name: str, context: grpc.aio.ServicerContext) -> Pool:
        try:
            return self.gateway.find_pool(name)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise

    async def ListLayouts(
        self, request: apb.ListLayoutsRequest, context: grpc.aio.ServicerContext
    ) -> apb.ListLayoutsResponse:
        await self._authorize(context)
        resp = apb.ListLayoutsResponse()
        for name in preset_names():
            layout = load_layout(name)
            try:
                resp.presets.append(layout_info(self.gateway, layout))
            except LayoutError as exc:  # listed all the same, saying why, as `meshserve layouts` does
                resp.presets.append(
                    apb.LayoutInfo(
                        name=layout.name, data=layout.data, model=layout.model, description=layout.description,
                        unusable=str(exc),
                    )
                )  # fmt: skip
        for pool in self.gateway.pools:
            resp.pools.append(
                apb.PoolInfo(
                    name=pool.name,
                    layout=layout_info(self.gateway, pool.layout, pool),
                    device_ids=pool.device_ids,
                    is_default=pool.is_default,
                )
            )
        return resp

    async def GetLayout(self, request: apb.GetLayoutRequest, context: grpc.aio.ServicerContext) -> apb.LayoutInfo:
        await self._authorize(context)
        pool = await self._pool(request.pool, context)
        return layout_info(self.gateway, pool.layout, pool)

    async def SetLayout(self, request: apb.SetLayoutRequest, context: grpc.aio.ServicerContext) -> apb.LayoutInfo:
        await self._authorize(context)
        pool = await self._pool(request.pool, context)
        try:
            layout = load_layout(request.layout)
            assert self.gateway.facts is not None
            make_plan(layout, self.gateway.facts.cfg, self.gateway.cfg.engine.num_slots)
            if (problem := job_layout_problem(layout)) is not None:
                raise LayoutError(problem)
            if layout.num_devices > len(pool.devices):
                raise LayoutError(
                    f"layout {layout.name!r} needs {layout.num_devices} devices; pool {pool.name!r} owns {len(pool.devices)}"
                )
        except LayoutError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        ecfg = self.gateway.cfg.engine
        # Each data replica has its own share of the pool; a request admitted now must still fit one.
        per_replica = kv_pool.whole_pages(ecfg.num_pages * ecfg.page_size, ecfg.page_size, layout.data) // layout.data
        if min(ecfg.max_seq_len, per_replica) < self.gateway.max_request_tokens:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"layout {layout.name!r}: each of its {layout.data} data replicas holds {per_replica} of the "
                f"pool's {ecfg.num_pages * ecfg.page_size} tokens, fewer than the {self.gateway.max_request_tokens} "
                "one request may hold now; serve with a bigger --kv-cache-tokens to switch to it",
            )
        # The new runner is built beside the serving one: refuse what cannot fit before building.
        predicted = layout_info(self.gateway, layout)
        devices = pool.devices[: layout.num_devices]
        facts = self.gateway.facts
        assert facts is not None
        # A runner on one CPU device packs its float32 weights in place; a tied head is packed beside its table.
        kernels = choose(
            devices, facts.cfg, ecfg.dtype, resolve_kv_dtype(ecfg.kv_dtype, ecfg.dtype), matmul=ecfg.matmul
        )
        head = packed_head_bytes(facts.cfg, facts.formats, kernels.panels)
        need = predicted.weight_bytes_per_device + predicted.kv_cache_bytes_per_device + head
        if (problem := kv_pool.switch_problem(devices, need)) is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"layout {layout.name!r}: {problem}")
        async with self._switch_lock:
            t0 = time.perf_counter()
            old = pool.loop.runner

            def build(old=old):  # type: ignore[no-untyped-def]
                runner = old.relayout(layout, pool.devices, self.gateway.restore(layout, pool.devices))
                runner.warmup_to_replace(old)
                return runner

            if self.gateway.channel is None:
                try:
                    new_runner = await asyncio.to_thread(build)
                except Exception as exc:  # nothing was swapped: the old runner keeps serving
                    out_of_memory = isinstance(exc, MemoryError) or "RESOURCE_EXHAUSTED" in str(exc)
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED if out_of_memory else grpc.StatusCode.INTERNAL,
                        f"layout {layout.name!r}: building the new engine failed ({type(exc).__name__}: {exc}); "
                        f"pool {pool.name!r} keeps serving on {old.layout.name!r}",
                    )
                t_build = time.perf_counter() - t0
                await asyncio.to_thread(pool.loop.switch_runner, new_runner)
            else:
                # A job over several processes: every process makes the switch's JAX calls in
                # the steps' order, so the loop thread builds between two steps (streams pause).
                await asyncio.to_thread(pool.loop.switch_runner, build)
                t_build = time.perf_counter() - t0
            self.gateway.publish_layout(pool)
            log.info(
                "pool %s: %s -> %s (built and compiled in %.1f s, total %.1f s)",
                pool.name, old.layout.name, layout.name, t_build, time.perf_counter() - t0,
            )  # fmt: skip
        return layout_info(self.gateway, pool.layout, pool)


async def start_admin_server(gateway: Gateway, cfg: ServerConfig) -> tuple[grpc.aio.Server, int]:
    """Start the Admin service on ``cfg.admin_host:cfg.admin_port``; returns (server, bound port).

    Raises:
        RuntimeError: the port could not be bound.
    """
    assert cfg.admin_token
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])  # a busy port is an error
    add_servicer(apb_grpc.add_AdminServicer_to_server, AdminService(gateway, cfg.admin_token), server)
    port = server.add_insecure_port(f"{cfg.admin_host}:{cfg.admin_port}")
    if port == 0:
        raise RuntimeError(f"could not bind the admin port {cfg.admin_host}:{cfg.admin_port}")
    await server.start()
    log.info("admin service on %s:%d", cfg.admin_host, port)
    return server, port
