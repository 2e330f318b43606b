"""A small synchronous gRPC client for meshserve (used by the CLI, tests and benchmarks)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.meshserve.v1 import meshserve_pb2 as pb
from protos.meshserve.v1 import meshserve_pb2_grpc as pb_grpc


@dataclasses.dataclass
class StreamResult:
    """A finished stream: every chunk's text and ids, plus timings.

    Attributes:
        texts: text delta of each chunk, in order.
        token_ids: all generated ids, concatenated.
        finish_reason: name, e.g. "FINISH_REASON_EOS".
        ttft_s: seconds from sending the request to the first chunk with a token.
        total_s: seconds from sending the request to the last chunk.
    """

    texts: list[str]
    token_ids: list[int]
    chunk_ids: list[list[int]]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    total_s: float

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens after the first, divided by the time after the first (tokens/s)."""
        n = len(self.token_ids) - 1
        dt = self.total_s - self.ttft_s
        return n / dt if n > 0 and dt > 0 else 0.0


def make_request(
    prompt: str | None = None,
    chat: Sequence[tuple[str, str]] | None = None,
    token_ids: Sequence[int] | None = None,
    **params: Any,
) -> pb.GenerateRequest:
    """Build a GenerateRequest; ``params`` are GenerateRequest fields (max_tokens, temperature,
    top_p, top_k, seed, stop); a None value leaves the field unset (server default)."""
    req = pb.GenerateRequest(**{k: v for k, v in params.items() if v is not None})
    if chat is not None:
        req.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in chat)
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    elif prompt is not None:
        req.prompt = prompt
    return req


class Client:
    """Blocking client. ``address`` is "host:port"."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def wait_serving(self, timeout_s: float = 300.0) -> None:
        """Poll grpc.health.v1 until SERVING. Raises TimeoutError after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                status = self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not SERVING after {timeout_s:.0f} s")

    def stream(self, request: pb.GenerateRequest, timeout_s: float | None = None) -> Iterator[pb.GenerateResponse]:
        """The raw response stream (raises grpc.RpcError on a non-OK status)."""
        return self.stub.Generate(request, timeout=timeout_s)

    def generate(self, request: pb.GenerateRequest, timeout_s: float | None = None) -> StreamResult:
        """Run a request to completion and collect the chunks."""
        t0 = time.perf_counter()
        texts, ids, chunk_ids = [], [], []
        ttft = None
        last = pb.GenerateResponse()
        for resp in self.stream(request, timeout_s):
            if ttft is None and resp.token_ids:
                ttft = time.perf_counter() - t0
            texts.append(resp.text)
            ids.extend(resp.token_ids)
            chunk_ids.append(list(resp.token_ids))
            last = resp
        total = time.perf_counter() - t0
        return StreamResult(
            texts=texts,
            token_ids=ids,
            chunk_ids=chunk_ids,
            finish_reason=pb.FinishReason.Name(last.finish_reason),
            prompt_tokens=last.usage.prompt_tokens,
            completion_tokens=last.usage.completion_tokens,
            ttft_s=ttft if ttft is not None else total,
            total_s=total,
        )

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
