"""The real SmolLM2-135M server through real gRPC (the session ``server`` fixture: 4 slots x 1024
tokens). Generations are short: the CPU decodes about 10-20 tokens/s."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers import status_of

from model.text.tokenizer import Tokenizer
from model.weights.gguf_file import field_value, open_gguf
from protos.meshserve.v1 import meshserve_pb2 as pb
from service.server.client import Client, StreamResult, make_request

pytestmark = pytest.mark.slow

TIMEOUT_S = 120.0  # per request: generous for a loaded 2-core CPU, but no test can hang
SPECIAL_TEXTS = ("<|im_end|>", "<|im_start|>", "<|endoftext|>")
FRANCE = [("user", "What is the capital of France?")]
ALPHABET = [("user", "Write the English alphabet in capitals with no spaces.")]
UNICODE = [("user", "Repeat exactly, nothing else: 你好，世界！🙂👍🏽 café")]


def gen(client: Client, **kwargs: object) -> StreamResult:
    return client.generate(make_request(**kwargs), timeout_s=TIMEOUT_S)


def assert_well_formed(r: StreamResult, tokenizer: Tokenizer, max_tokens: int) -> None:
    """Usage matches the chunks, the text is the decoded ids, and no special token leaks."""
    assert r.finish_reason != "FINISH_REASON_UNSPECIFIED"
    assert r.completion_tokens == len(r.token_ids) == sum(len(c) for c in r.chunk_ids)
    assert len(r.token_ids) <= max_tokens
    assert all(len(c) <= 1 for c in r.chunk_ids)
    assert r.text == tokenizer.decode(r.token_ids)
    for chunk in r.texts:
        for special in SPECIAL_TEXTS:
            assert special not in chunk


def assert_prefix_closed(texts: list[str], final: str) -> None:
    running = ""
    for t in texts:
        running += t
        assert final.startswith(running), f"sent {running!r}, not a prefix of the final {final!r}"
    assert running == final


# ---- health, reflection, model info -------------------------------------------------------------------


def test_health_is_serving(client: Client) -> None:
    for service in ("", "meshserve.v1.Generation"):
        resp = client.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING, service


def test_reflection_lists_the_generation_service(client: Client) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert "meshserve.v1.Generation" in names
    assert "grpc.health.v1.Health" in names


def test_model_info_matches_the_gguf(client: Client, smollm2_gguf: Path) -> None:
    info = client.model_info()
    reader = open_gguf(smollm2_gguf)
    assert info.num_layers == field_value(reader, "llama.block_count") == 30
    assert info.num_heads == field_value(reader, "llama.attention.head_count") == 9
    assert info.num_kv_heads == field_value(reader, "llama.attention.head_count_kv") == 3
    assert info.hidden_size == field_value(reader, "llama.embedding_length") == 576
    assert info.intermediate_size == field_value(reader, "llama.feed_forward_length") == 1536
    assert info.head_dim == 576 // 9 == 64
    assert info.vocab_size == len(field_value(reader, "tokenizer.ggml.tokens")) == 49152
    assert list(info.eos_token_ids) == [field_value(reader, "tokenizer.ggml.eos_token_id")] == [2]
    assert info.context_length == field_value(reader, "llama.context_length")
    assert info.max_seq_len == 1024
    assert info.num_slots == 4
    assert info.architecture == "llama"  # the family (model.families), not a constant
    assert info.num_parameters > 100_000_000
    # The default pool's layout, as sharding/plan.py resolves it (the roofline's input for bench).
    assert info.tie_word_embeddings and info.platform == "cpu" and info.device_kind
    assert info.pool and info.layout and info.layout_data >= 1 and info.layout_model >= 1
    assert info.attention in ("heads", "replicated")
    same = client.stub.GetModelInfo(pb.GetModelInfoRequest(layout=info.pool), timeout=10)
    assert (same.pool, same.layout_data, same.layout_model) == (info.pool, info.layout_data, info.layout_model)
    with pytest.raises(grpc.RpcError) as err:
        client.stub.GetModelInfo(pb.GetModelInfoRequest(layout="no-such-pool"), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ---- generation -------------------------------------------------------------------------------------


def test_chat_answer_paris_ends_with_eos(client: Client, tokenizer: Tokenizer) -> None:
    r = gen(client, chat=FRANCE, temperature=0.0, max_tokens=64)
    assert "Paris" in r.text
    assert r.finish_reason == "FINISH_REASON_EOS"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": FRANCE[0][1]}], add_generation_prompt=True)
    assert r.prompt_tokens == len(tokenizer.encode(rendered))
    assert_well_formed(r, tokenizer, 64)
    assert len(r.token_ids) < 64
    assert 2 not in r.token_ids  # EOS is excluded from the output ids
    assert r.chunk_ids[-1] == []  # the EOS chunk carries no id
    assert all(len(c) == 1 for c in r.chunk_ids[:-1])
    assert "".join(r.texts) == tokenizer.decode(r.token_ids)


def test_four_concurrent_greedy_streams_match_their_solo_runs(client: Client, tokenizer: Tokenizer) -> None:
    requests = [
        make_request(prompt="The quick brown fox", temperature=0.0, max_tokens=24),
        make_request(chat=FRANCE, temperature=0.0, max_tokens=24),
        make_request(prompt="def fibonacci(n):", temperature=0.0, max_tokens=24),
        make_request(
            prompt="Once upon a time, in a small village at the edge of a great forest, there lived",
            temperature=0.0,
            max_tokens=24,
        ),
    ]
    solo = [client.generate(req, timeout_s=TIMEOUT_S) for req in requests]
    barrier = threading.Barrier(len(requests))

    def run(req: pb.GenerateRequest) -> tuple[StreamResult, float, float]:
        barrier.wait(30)
        t0 = time.monotonic()
        res = client.generate(req, timeout_s=TIMEOUT_S)
        return res, t0, time.monotonic()

    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(run, requests))
    # They really overlapped: every stream started before any finished.
    assert max(t0 for _, t0, _ in together) < min(t1 for _, _, t1 in together)
    for alone, (res, _, _) in zip(solo, together, strict=True):
        assert res.token_ids == alone.token_ids
        assert res.text == alone.text
        assert res.finish_reason == alone.finish_reason
        assert_well_formed(res, tokenizer, 24)


def test_c01_multibyte_text_has_no_replacement_characters(client: Client, tokenizer: Tokenizer) -> None:
    r = gen(client, chat=UNICODE, temperature=0.0, max_tokens=64)
    assert "\ufffd" not in r.text
    assert all("\ufffd" not in t for t in r.texts)
    assert r.text == tokenizer.decode(r.token_ids)
    assert_well_formed(r, tokenizer, 64)


def test_c06_max_tokens_is_exact(client: Client) -> None:
    base = gen(client, prompt="Hello", temperature=0.0, max_tokens=16)
    assert len(base.token_ids) >= 1
    for k in (1, 2, 3):
        r = gen(client, prompt="Hello", temperature=0.0, max_tokens=k)
        if len(base.token_ids) >= k:
            assert r.token_ids == base.token_ids[:k]
            assert r.completion_tokens == k
            assert r.finish_reason == "FINISH_REASON_LENGTH"
        else:  # EOS came first
            assert r.token_ids == base.token_ids
            assert r.finish_reason == "FINISH_REASON_EOS"
    code, details = status_of(client, make_request(prompt="Hello", temperature=0.0, max_tokens=0))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in details


def _char_boundaries(tokenizer: Tokenizer, ids: list[int], text: str) -> list[int]:
    """b[k] = length of the text of ids[:k] (checked to be a prefix of ``text``)."""
    bounds = []
    for k in range(len(ids) + 1):
        prefix = tokenizer.decode(ids[:k])
        assert text.startswith(prefix)
        bounds.append(len(prefix))
    return bounds


def test_c04_stop_strings_through_the_server(client: Client, tokenizer: Tokenizer) -> None:
    plain = gen(client, chat=ALPHABET, temperature=0.0, max_tokens=40)
    out, ids = plain.text, plain.token_ids
    assert out == tokenizer.decode(ids) and len(ids) >= 4
    b = _char_boundaries(tokenizer, ids, out)
    # stop_s starts inside token i (after its first character) and ends with token i + 2.
    choice = None
    for i in range(len(ids) - 2):
        if b[i + 1] - b[i] >= 2 and b[i + 1] < b[i + 2] < b[i + 3]:
            start, end = b[i] + 1, b[i + 3]
            if out.find(out[start:end]) == start:
                choice = (i, start, end)
                break
    assert choice is not None, f"no stop string candidate in {out!r}"
    i, start, end = choice
    stop_s = out[start:end]

    stopped = gen(client, chat=ALPHABET, temperature=0.0, max_tokens=40, stop=[stop_s])
    assert stopped.finish_reason == "FINISH_REASON_STOP_STRING"
    assert_prefix_closed(stopped.texts, stopped.text)
    assert stopped.text == out[: out.index(stop_s)]
    assert stopped.token_ids == ids[: i + 3]  # generation ended with the token completing stop_s
    assert stopped.completion_tokens == i + 3

    # A stop string that starts in the last characters but never completes: the held tail is sent.
    never = gen(client, chat=ALPHABET, temperature=0.0, max_tokens=40, stop=[out[-4:] + "QZXV"])
    assert never.text == out
    assert never.token_ids == ids
    assert never.finish_reason == plain.finish_reason
    assert_prefix_closed(never.texts, out)


def test_c08_odd_prompts_do_not_break_the_server(client: Client) -> None:
    before = gen(client, prompt="Hello", temperature=0.0, max_tokens=8)
    odd = [
        make_request(prompt="", max_tokens=16),
        make_request(prompt="   ", max_tokens=16),
        make_request(prompt="", max_tokens=0),
    ]
    for req in odd:
        try:
            r = client.generate(req, timeout_s=30)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (req, exc.code(), exc.details())
        else:
            assert r.finish_reason != "FINISH_REASON_UNSPECIFIED"
            assert r.completion_tokens == len(r.token_ids) <= 16
        serving = client.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        assert serving == health_pb2.HealthCheckResponse.SERVING, req
    after = gen(client, prompt="Hello", temperature=0.0, max_tokens=8)
    assert after.token_ids == before.token_ids
    assert after.finish_reason == before.finish_reason


def test_c09_overlong_prompt_rejected_while_another_stream_runs(client: Client, tokenizer: Tokenizer) -> None:
    # ignore_eos: the model ends this answer after 11 tokens; the stream must still be running.
    normal = make_request(prompt="Count to 500.", temperature=0.0, max_tokens=60, ignore_eos=True)
    solo = client.generate(normal, timeout_s=TIMEOUT_S)
    first_chunk = threading.Event()
    done_at: list[float] = []

    def run() -> list[int]:
        ids: list[int] = []
        for resp in client.stream(normal, timeout_s=TIMEOUT_S):
            ids.extend(resp.token_ids)
            first_chunk.set()
            if resp.finish_reason:
                done_at.append(time.monotonic())
        return ids

    big = "hello " * (1024 + 100)
    n = len(tokenizer.encode(big))
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run)
        assert first_chunk.wait(60)
        code, details = status_of(client, make_request(prompt=big, max_tokens=8), timeout_s=30)
        rejected_at = time.monotonic()
        ids = running.result(TIMEOUT_S)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(n) in details and "1024" in details
    assert done_at and rejected_at < done_at[0]  # rejected while the stream was still running
    assert ids == solo.token_ids and len(ids) == 60
    assert client.generate(normal, timeout_s=TIMEOUT_S).token_ids == solo.token_ids  # and it serves on


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_values_are_invalid_argument(client: Client, params: dict, field: str) -> None:
    code, details = status_of(client, make_request(prompt="Hello", max_tokens=4, **params))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(field)


def test_out_of_vocab_token_id_is_invalid_argument(client: Client) -> None:
    code, details = status_of(client, make_request(token_ids=[1, 10**6], max_tokens=4))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("token_ids") and str(10**6) in details


def test_seeded_sampling_is_reproducible_and_seeds_differ(client: Client) -> None:
    a = gen(client, prompt="Once upon a time", temperature=0.8, seed=7, max_tokens=12)
    b = gen(client, prompt="Once upon a time", temperature=0.8, seed=7, max_tokens=12)
    assert a.token_ids == b.token_ids and a.text == b.text
    # Sampled decoding is slow on the CPU: run the 8 seeds 4 at a time (one per slot).
    with ThreadPoolExecutor(4) as pool:
        runs = list(
            pool.map(
                lambda s: gen(client, prompt="Once upon a time", temperature=1.0, seed=s, max_tokens=6), range(1, 9)
            )
        )
    assert all(len(r.token_ids) == r.completion_tokens >= 1 for r in runs)
    assert len({tuple(r.token_ids) for r in runs}) >= 2


def test_cancelled_stream_frees_its_slot(server, client: Client) -> None:
    scheduler = server.running.gateway.pools[0].loop.scheduler
    call = client.stream(make_request(prompt="1, 2, 3, 4, 5,", temperature=0.0, max_tokens=400), timeout_s=TIMEOUT_S)
    first = next(call)
    assert len(first.token_ids) == 1 and not first.finish_reason
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.CANCELLED
    deadline = time.monotonic() + 5.0
    while scheduler.active_slots != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scheduler.active_slots == 0
    assert scheduler.queue_depth == 0
    follow = gen(client, prompt="Hello", temperature=0.0, max_tokens=4)
    assert follow.finish_reason == "FINISH_REASON_LENGTH" and len(follow.token_ids) == 4


def test_logprobs_of_each_token_and_top_alternatives(client) -> None:  # type: ignore[no-untyped-def]
    """Greedy ids are the most likely alternative; log-probabilities are sorted and <= 0."""
    req = make_request(prompt="The capital of France is", temperature=0.0, max_tokens=6, logprobs=3)
    ids, records = [], []
    for resp in client.stream(req, timeout_s=120):
        ids.extend(resp.token_ids)
        records.extend(resp.logprobs)
    assert len(records) == len(ids) == 6
    for token, rec in zip(ids, records, strict=True):
        assert rec.token_id == token
        assert len(rec.top) == 3
        assert rec.top[0].token_id == token  # greedy picks the argmax
        assert rec.logprob == pytest.approx(rec.top[0].logprob, abs=1e-6)
        values = [t.logprob for t in rec.top]
        assert values == sorted(values, reverse=True) and values[0] <= 0.0
    plain = client.generate(make_request(prompt="The capital of France is", temperature=0.0, max_tokens=6))
    assert plain.token_ids == ids


def test_logprobs_over_the_limit_is_invalid(client) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        client.generate(make_request(prompt="Hi", max_tokens=2, logprobs=21), timeout_s=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logprobs" in err.value.details()
