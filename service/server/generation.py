"""What both APIs share about one admitted request: its refusals, and its n sequences as one stream.

``Gateway.open`` (``service/server/gateway.py``) admits a request and returns a ``Generation``;
gRPC's ``Generate`` (``service/server/grpc_api.py``) and the OpenAI-compatible HTTP endpoints
(``service/server/http_api.py``) only translate: a ``Refused`` to a status code
(``grpc_api.GRPC_CODES``, ``http_api.HTTP_STATUS``), each ``(index, Chunk)`` to their response
shape, a ``StreamFailed`` to UNAVAILABLE / 503.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable

from service.engine.request import Chunk, Request


class Refusal(enum.Enum):
    """Why a request was refused before it reached an engine; the value is the
    ``meshserve_requests_rejected_total`` label."""

    INVALID_ARGUMENT = "invalid_argument"  # a bad field (the message names it)
    NOT_FOUND = "not_found"  # the HTTP API's model id names no pool
    RESOURCE_EXHAUSTED = "resource_exhausted"  # the waiting queue is full
    UNAVAILABLE = "unavailable"  # loading, shutting down, or the pool's engine loop died or stalled


class Refused(Exception):
    """A request refused before any of its sequences reached an engine.

    Attributes:
        code: the transport-neutral reason.
        message: one line for the client (for INVALID_ARGUMENT it starts with the field's name).
    """

    def __init__(self, code: Refusal, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class StreamFailed(Exception):
    """A sequence failed mid-stream: its pool's engine loop died or stalled, or the server shut
    down before it finished (gRPC UNAVAILABLE, HTTP 503 or an error event)."""


class Generation:
    """The n sequences of one admitted request, read as one async stream of ``(index, Chunk)``.

    The chunks of the sequences interleave in the order the engine produced them; a sequence's
    last chunk has ``finish_reason`` set, and the iteration ends once all n have finished. A
    chunk with ``error`` set ends the iteration with ``StreamFailed`` instead. ``close()`` (also
    at the end of ``async with``) cancels every sequence still running: the engine frees their
    slots within one step, as for a client that went away. Use it on the event loop's thread.

    Args:
        request_id: the request's id (logs, response ids).
        pool: the name of the pool that serves it.
        requests: the sequences' engine requests, by index; already submitted.
        chunks: where their ``emit`` callbacks put ``(index, Chunk)`` (on the event loop).
        on_close: called once by ``close()`` (the server's in-flight bookkeeping).
    """

    def __init__(
        self,
        request_id: str,
        pool: str,
        requests: list[Request],
        chunks: asyncio.Queue[tuple[int, Chunk]],
        on_close: Callable[[Generation], None],
    ):
        self.request_id = request_id
        self.pool = pool
        self.requests = requests
        self._chunks = chunks
        self._running = len(requests)
        self._on_close = on_close
        self._closed = False

    @property
    def n(self) -> int:
        return len(self.requests)

    @property
    def prompt_tokens(self) -> int:
        return self.requests[0].prompt_len

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> tuple[int, Chunk]:
        if self._running == 0:
            raise StopAsyncIteration
        index, chunk = await self._chunks.get()
        if chunk.error is not None:
            self._running = 0
            raise StreamFailed(chunk.error)
        if chunk.finish_reason is not None:
            self._running -= 1
        return index, chunk

    def close(self) -> None:
        """Cancel every sequence (a no-op for finished ones) and drop them from the in-flight set;
        idempotent."""
        if self._closed:
            return
        self._closed = True
        for req in self.requests:
            req.cancel()
        self._on_close(self)

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
