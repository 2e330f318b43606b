"""Request bytes that do not parse (a ``string`` field holding invalid UTF-8) are INVALID_ARGUMENT
with a message naming the message type, on every RPC of the tiny session server: Generation,
health and Admin. The bytes are built by hand and sent through generic channel calls."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2
from helpers import scrape, value

from protos.meshserve.v1 import admin_pb2 as apb
from protos.meshserve.v1 import meshserve_pb2 as pb

BAD = b"\xff\xfe"  # never valid UTF-8


def field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (wire type 2); lengths here are < 128 (one byte)."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def chat(role: bytes, content: bytes) -> bytes:
    message = field(1, role) + field(2, content)  # ChatMessage
    return field(2, field(1, message))  # GenerateRequest.chat.messages[0]


GENERATE_CASES = {
    "prompt": field(1, BAD),
    "chat.messages.role": chat(BAD, b"hi"),
    "chat.messages.content": chat(b"user", BAD),
    "stop": field(1, b"hi") + field(9, BAD),
    "request_id": field(1, b"hi") + field(10, BAD),
    "layout": field(1, b"hi") + field(11, BAD),
}


def call(address: str, method: str, data: bytes, streaming: bool) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(address) as channel:
        try:
            if streaming:
                list(channel.unary_stream(method)(data, timeout=30))
            else:
                channel.unary_unary(method)(data, timeout=30)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def test_the_hand_built_bytes_are_what_they_claim() -> None:
    good = field(1, b"hi") + field(9, b"ok") + field(10, b"r1") + field(11, b"")
    req = pb.GenerateRequest.FromString(good)
    assert (req.prompt, list(req.stop), req.request_id) == ("hi", ["ok"], "r1")
    req = pb.GenerateRequest.FromString(chat(b"user", b"hello"))
    assert [(m.role, m.content) for m in req.chat.messages] == [("user", "hello")]
    for data in GENERATE_CASES.values():
        with pytest.raises(Exception, match="UTF-8"):
            pb.GenerateRequest.FromString(data)


@pytest.mark.parametrize("name", list(GENERATE_CASES))
def test_generate_with_invalid_utf8_is_invalid_argument(tiny_server, name: str) -> None:  # type: ignore[no-untyped-def]
    port = tiny_server.running.metrics_port
    before = value(scrape(port), "meshserve_requests_rejected_total", pool="", code="invalid_argument")
    code, details = call(tiny_server.address, "/meshserve.v1.Generation/Generate", GENERATE_CASES[name], True)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith("request: cannot parse meshserve.v1.GenerateRequest") and "UTF-8" in details
    after = value(scrape(port), "meshserve_requests_rejected_total", pool="", code="invalid_argument")
    assert after == before + 1
    # The server still answers a good request afterwards.
    good = pb.GenerateRequest(prompt="hi", max_tokens=2).SerializeToString()
    assert call(tiny_server.address, "/meshserve.v1.Generation/Generate", good, True) == (grpc.StatusCode.OK, "")


def test_corrupt_bytes_are_invalid_argument_and_not_blamed_on_utf8(tiny_server) -> None:  # type: ignore[no-untyped-def]
    code, details = call(tiny_server.address, "/meshserve.v1.Generation/Generate", b"\xff\xff\xff", True)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith("request: cannot parse meshserve.v1.GenerateRequest: "), details
    assert "UTF-8" not in details and details.count("GenerateRequest") == 1, details  # upb: "Wire format was corrupt"
    good = pb.GenerateRequest(prompt="hi", max_tokens=2).SerializeToString()
    assert call(tiny_server.address, "/meshserve.v1.Generation/Generate", good, True) == (grpc.StatusCode.OK, "")


@pytest.mark.parametrize(
    ("method", "type_name"),
    [
        ("/meshserve.v1.Generation/GetModelInfo", "meshserve.v1.GetModelInfoRequest"),
        ("/grpc.health.v1.Health/Check", "grpc.health.v1.HealthCheckRequest"),
    ],
)
def test_unary_rpcs_with_invalid_utf8_are_invalid_argument(tiny_server, method: str, type_name: str) -> None:  # type: ignore[no-untyped-def]
    code, details = call(tiny_server.address, method, field(1, BAD), False)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith(f"request: cannot parse {type_name}") and "UTF-8" in details
    assert call(tiny_server.address, method, field(1, b""), False)[0] == grpc.StatusCode.OK


def test_health_watch_with_invalid_utf8_is_invalid_argument(tiny_server) -> None:  # type: ignore[no-untyped-def]
    code, details = call(tiny_server.address, "/grpc.health.v1.Health/Watch", field(1, BAD), True)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "grpc.health.v1.HealthCheckRequest" in details
    # A good Watch (a coroutine that streams with context.write) still streams.
    with grpc.insecure_channel(tiny_server.address) as channel:
        watch = channel.unary_stream(
            "/grpc.health.v1.Health/Watch", response_deserializer=health_pb2.HealthCheckResponse.FromString
        )(health_pb2.HealthCheckRequest(service="meshserve.v1.Generation").SerializeToString(), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


@pytest.mark.parametrize(
    ("method", "data", "type_name"),
    [
        ("/meshserve.v1.Admin/GetLayout", field(1, BAD), "meshserve.v1.GetLayoutRequest"),
        ("/meshserve.v1.Admin/SetLayout", field(1, b"default") + field(2, BAD), "meshserve.v1.SetLayoutRequest"),
    ],
)
def test_admin_rpcs_with_invalid_utf8_are_invalid_argument(
    tiny_server, method: str, data: bytes, type_name: str
) -> None:  # type: ignore[no-untyped-def]
    address = f"127.0.0.1:{tiny_server.running.admin_port}"
    code, details = call(address, method, data, False)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith(f"request: cannot parse {type_name}") and "UTF-8" in details
    # A parsable request reaches the servicer (which then asks for the token).
    ok = apb.GetLayoutRequest(pool="default").SerializeToString()
    assert call(address, "/meshserve.v1.Admin/GetLayout", ok, False)[0] == grpc.StatusCode.UNAUTHENTICATED
