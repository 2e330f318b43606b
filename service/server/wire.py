"""Request bytes that do not parse are INVALID_ARGUMENT, on every RPC.

protobuf checks that a ``string`` field holds UTF-8 when it parses a message; a request whose
bytes fail that (or are otherwise malformed) raises ``DecodeError`` inside gRPC's request
deserializer, which gRPC answers with UNKNOWN before any servicer code runs. ``add_servicer``
registers a generated servicer with a deserializer that catches the error instead, and a
handler that answers such a call with INVALID_ARGUMENT naming the message type.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from service.server.logs import log


@dataclasses.dataclass(frozen=True)
class Undecodable:
    """Stands in for a request whose bytes did not parse."""

    message: str


def _deserializer(deserialize: Callable[[bytes], Any], type_name: str) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as exc:
            # protobuf says why after its own prefix ("String field had bad UTF-8", "Wire format
            # was corrupt"); the message names the type once.
            why = str(exc).split(f"type '{type_name}': ", 1)[-1]
            return Undecodable(f"request: cannot parse {type_name}: {why}")

    return parse


async def _refuse(
    request: Undecodable,
    context: grpc.aio.ServicerContext,
    method: str,
    on_undecodable: Callable[[str], None] | None,
) -> None:
    """End the call with INVALID_ARGUMENT (``context.abort`` raises)."""
    log.info("%s: rejected, INVALID_ARGUMENT: %s", method, request.message)
    if on_undecodable is not None:
        on_undecodable(method)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def _checked_unary(behavior: Callable, method: str, on_undecodable: Callable[[str], None] | None) -> Callable:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await _refuse(request, context, method, on_undecodable)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return handle


def _checked_stream(behavior: Callable, method: str, on_undecodable: Callable[[str], None] | None) -> Callable:
    if not inspect.isasyncgenfunction(behavior):
        # A coroutine that streams with context.write() (grpc_health's Watch) keeps that shape.
        return _checked_unary(behavior, method, on_undecodable)

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await _refuse(request, context, method, on_undecodable)
        result = behavior(request, context)
        try:
            async for item in result:
                yield item
        finally:
            await result.aclose()  # runs the servicer's own cleanup now when the client went away

    return handle


class _Recorder:
    """Collects what a generated ``add_*Servicer_to_server`` registers."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers arrive through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.services[service] = handlers


def add_servicer(
    add_to_server: Callable[[Any, Any], None],
    servicer: Any,
    server: grpc.aio.Server,
    on_undecodable: Callable[[str], None] | None = None,
) -> None:
    """``add_to_server(servicer, server)`` (a generated ``add_*Servicer_to_server``), with every
    unary-request method answering undecodable request bytes with INVALID_ARGUMENT.
    ``on_undecodable(method)`` is called for each such call (e.g. for metrics).

    Streaming-request methods are registered unchanged (this project has none).
    """
    recorder = _Recorder()
    add_to_server(servicer, recorder)
    for service, handlers in recorder.services.items():
        checked: dict[str, grpc.RpcMethodHandler] = {}
        for name, h in handlers.items():
            method = f"/{service}/{name}"
            if h.request_streaming or h.request_deserializer is None:
                checked[name] = h
                continue
            descriptor = getattr(getattr(h.request_deserializer, "__self__", None), "DESCRIPTOR", None)
            type_name = descriptor.full_name if descriptor is not None else "the request"
            parse = _deserializer(h.request_deserializer, type_name)
            if h.response_streaming:
                checked[name] = h._replace(
                    request_deserializer=parse, unary_stream=_checked_stream(h.unary_stream, method, on_undecodable)
                )
            else:
                checked[name] = h._replace(
                    request_deserializer=parse, unary_unary=_checked_unary(h.unary_unary, method, on_undecodable)
                )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, checked),))
        server.add_registered_method_handlers(service, checked)
