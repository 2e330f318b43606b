"""The ``meshserve`` commands' help, output and errors: every flag of serve, health, generate,
chat and fetch has help text; fetch checks a local model; generate ends stdout with a newline;
serve on a taken port (gRPC or metrics) prints one line naming it and exits 1; a CPU-only serve
logs no "Unable to initialize backend"."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import held_port

from benchmarks.cli import build_parser as bench_parser
from service.server.cli import _end_line, build_parser, main

REPO = Path(__file__).resolve().parent.parent
COMMANDS = ("serve", "health", "generate", "chat", "fetch", "convert", "layouts")
BENCH_COMMANDS = ("roofline", "bench", "sweep")  # meshserve-bench's (benchmarks/cli.py)


def subcommands() -> dict[str, argparse.ArgumentParser]:
    out = {}
    for parser in (build_parser(), bench_parser()):
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        out.update(action.choices)
    return out


def test_the_help_test_covers_every_command() -> None:
    assert set(subcommands()) == set(COMMANDS + BENCH_COMMANDS)


@pytest.mark.parametrize("command", BENCH_COMMANDS)
def test_a_measurement_tool_named_to_meshserve_points_to_meshserve_bench(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, "--help"]) == 2
    assert f"run 'meshserve-bench {command}'" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS + BENCH_COMMANDS)
def test_every_flag_has_help_text(command: str) -> None:
    sub = subcommands()[command]
    flags = [a for a in sub._actions if not isinstance(a, argparse._HelpAction)]
    assert len(flags) >= 2
    missing = [a.option_strings or a.dest for a in flags if not a.help]
    assert missing == []


def test_serve_help_explains_host_port_and_max_queue(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--host HOST address to listen on" in out
    assert "--port PORT gRPC port (default 50051; 0 = any free port)" in out
    assert "--max-queue MAX_QUEUE most requests waiting for a slot" in out


def test_fetch_of_a_missing_file_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-file.gguf"
    assert main(["fetch", "--model", str(missing)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    names = "smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b-instruct, gemma-3-270m"
    assert err == f"meshserve fetch: error: model file or directory not found: {missing} (or name a model: {names})\n"


def test_fetch_of_a_file_that_is_not_gguf_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    assert main(["fetch", "--model", str(text)]) == 1
    out, err = capsys.readouterr()
    assert (
        out == ""
        and err == f"meshserve fetch: error: {text} is not a GGUF file (it does not start with the bytes b'GGUF')\n"
    )
    folder = tmp_path / "empty"
    folder.mkdir()
    assert main(["fetch", "--model", str(folder)]) == 1
    assert "a directory without config.json" in capsys.readouterr().err


def test_fetch_of_a_gguf_prints_its_path(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fetch", "--model", str(tiny_gguf)]) == 0
    assert capsys.readouterr().out == f"{tiny_gguf}\n"


def test_generate_ends_stdout_with_a_newline(tiny_server, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    from service.server.client import Client, make_request

    # At temperature 100 the tiny model's answer is random bytes; this seed's ends without a newline.
    req = make_request(chat=[("user", "hi")], max_tokens=6, temperature=100.0, seed=2)
    client = Client(tiny_server.address)
    try:
        text = client.generate(req, timeout_s=60).text
    finally:
        client.close()
    assert text and not text.endswith("\n")
    argv = ["generate", "--address", tiny_server.address, "--temperature", "100", "--seed", "2", "--max-tokens", "6"]
    assert main([*argv, "hi"]) == 0
    out, err = capsys.readouterr()
    assert out == text + "\n"
    assert err.startswith("[FINISH_REASON_LENGTH; ") and "+ 6 generated tokens" in err


def test_generate_passes_every_sampling_flag_and_prints_logprobs(
    tiny_server, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    """The penalties, min_p, min_tokens, ignore_eos and logprobs flags reach the request: the CLI's
    answer equals the client's for the same fields, and its logprob table lists the stream's."""
    from service.server.client import Client, make_request

    fields = dict(
        max_tokens=5, temperature=0.0, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.25,
        repetition_penalty=1.3, min_tokens=5, ignore_eos=True, logprobs=2,
    )  # fmt: skip
    client = Client(tiny_server.address)
    try:
        chunks = list(client.stream(make_request(chat=[("user", "hi")], **fields), timeout_s=60))
        plain = client.generate(make_request(chat=[("user", "hi")], max_tokens=5, temperature=0.0), timeout_s=60)
    finally:
        client.close()
    ids = [t for c in chunks for t in c.token_ids]
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert len(ids) == 5 and [lp.token_id for lp in logprobs] == ids
    assert ids != plain.token_ids  # the penalties changed the answer, so the flags are tested by it
    argv = ["generate", "--address", tiny_server.address, "--max-tokens", "5", "--temperature", "0",
            "--min-p", "0.05", "--presence-penalty", "0.5", "--frequency-penalty", "0.25",
            "--repetition-penalty", "1.3", "--min-tokens", "5", "--ignore-eos", "--logprobs", "2", "hi"]  # fmt: skip
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out == "".join(c.text for c in chunks) + "\n"
    table = err.splitlines()[2:]  # after the summary line and the table's header
    assert len(table) == 5, err
    for i, (line, lp) in enumerate(zip(table, logprobs, strict=True)):
        words = line.split()
        assert words[0] == str(i) and words[1] == str(lp.token_id), line
        assert f"{lp.logprob:.4f}" in words and len(lp.top) == 2, line
        assert words[-2:] == [f"{t.token_id}:{t.logprob:.4f}" for t in lp.top], line


def test_generate_refused_prints_only_the_error(tiny_server, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as info:
        main(["generate", "--address", tiny_server.address, "--top-p", "5", "hi"])
    assert str(info.value) == "meshserve: INVALID_ARGUMENT: top_p: must be in (0, 1], got 5.0"
    assert capsys.readouterr().out == ""  # nothing streamed, no empty line


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])  # a UTF-8 locale's stdin, a C locale's
def test_chat_asks_again_for_a_line_that_is_not_utf8(
    tiny_server, errors: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    """A line of undecodable bytes was a traceback that ended the conversation; it is refused
    and the next line is answered."""
    import io

    stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9\nhi\n"), encoding="utf-8", errors=errors)
    monkeypatch.setattr(sys, "stdin", stdin)
    assert main(["chat", "--address", tiny_server.address, "--max-tokens", "3", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert "that line is not valid UTF-8 (nothing was sent)" in err and "Traceback" not in err
    assert out.count("assistant> ") == 1  # "hi" was answered


def test_end_line_adds_a_newline_only_when_missing(capsys: pytest.CaptureFixture[str]) -> None:
    _end_line(["Paris", "."])
    _end_line(["line\n"])
    _end_line([])
    assert capsys.readouterr().out == "\n\n"


@pytest.fixture()
def taken_port() -> Iterator[int]:
    """A port another process-like listener holds (``helpers.held_port``)."""
    with held_port() as port:
        yield port


def serve(tiny_gguf: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "service.server.cli", "serve", "--model", str(tiny_gguf), *flags]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_serve_on_a_taken_port_is_one_clear_line(tiny_gguf: Path, taken_port: int) -> None:
    r = serve(tiny_gguf, "--port", str(taken_port), "--metrics-port", "0")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (
        f"meshserve serve: error: port {taken_port} on 127.0.0.1 is in use (another 'meshserve serve' or another "
        "program holds it); pick a free one with --port (0 = any free port)\n"
    )


def test_serve_on_a_taken_metrics_port_is_one_clear_line(tiny_gguf: Path, taken_port: int) -> None:
    r = serve(tiny_gguf, "--port", "0", "--metrics-port", str(taken_port))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (
        f"meshserve serve: error: metrics port {taken_port} on 127.0.0.1 is in use (a second server needs its own "
        "metrics port); pick a free one with --metrics-port, or --metrics-port 0 for no metrics\n"
    )


def test_a_cpu_only_start_logs_no_backend_it_could_not_start() -> None:
    """With JAX_PLATFORMS unset JAX probes every backend it knows; the ones absent (TPU here) are
    not logged, while the xla_bridge logger's warnings still are."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    code = (
        "import logging\n"
        "from service.server.cli import configure_serve_logging\n"
        "configure_serve_logging()\n"
        "import jax\n"
        "print(jax.devices()[0].platform)\n"
        "logging.getLogger('jax._src.xla_bridge').warning('a real problem')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "cpu\n"
    assert "Unable to initialize backend" not in r.stderr
    assert "WARNING jax._src.xla_bridge: a real problem" in r.stderr
    # Without the setting, the same start does log it (so the check above means something).
    plain = code.replace("configure_serve_logging()", "logging.basicConfig(level=logging.INFO)")
    r = subprocess.run([sys.executable, "-c", plain], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert "Unable to initialize backend 'tpu'" in r.stderr


def test_a_taken_admin_port_is_refused_before_the_model_loads(taken_port: int) -> None:
    import asyncio

    from service.server.app import PortInUse, start_server
    from service.server.config import ServerConfig

    cfg = ServerConfig(model="no-such-model.gguf", port=0, metrics_port=0, admin_token="t", admin_port=taken_port)
    with pytest.raises(PortInUse) as info:
        asyncio.run(start_server(cfg))  # the model path is never looked at
    assert str(info.value) == f"admin port {taken_port} on 127.0.0.1 is in use; pick a free one with --admin-port"


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "99999"],
        ["serve", "--metrics-port", "-1"],
        ["serve", "--admin-port", "70000"],
        ["serve", "--grace-period", "-1"],
        ["serve", "--stall-timeout", "0"],
        ["layouts", "--slots", "0"],
        ["serve", "--kv-cache-tokens", "0"],  # 0 once meant "unset": a typo served the default pool
        ["generate", "hi", "--wait", "-5"],
        ["health", "--wait", "-1"],
        ["chat", "--wait", "nan"],
    ],
)
def test_out_of_range_serve_and_layouts_flags_are_usage_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument " in err and next(a for a in argv[1:] if a.startswith("--")) in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--seed", str(2**64)], "must be in [-9223372036854775808, 18446744073709551615] (64 bits)"),
        (["--max-tokens", "-5"], "must be in [1, 4294967295] (uint32)"),
        (["--top-k", str(2**40)], "must be in [0, 2147483647] (int32)"),
    ],
)
def test_a_value_the_request_cannot_hold_is_a_usage_error_naming_the_flag(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Caught before anything is sent (no server listens on port 1); it was protobuf's "Value out
    of range: -5", which named no flag."""
    with pytest.raises(SystemExit) as done:
        main(["generate", "hi", "--address", "127.0.0.1:1", *flags])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flags[0]}: {says}" in err and "Traceback" not in err, err


def test_a_negative_seed_is_taken_modulo_2_64_as_over_http() -> None:
    args = build_parser().parse_args(["generate", "hi", "--seed", "-1"])
    assert args.seed == 2**64 - 1


def test_no_prefix_cache_sets_the_requests_field_and_its_absence_leaves_it_unset() -> None:
    from service.server.cli import _sampling
    from service.server.client import make_request

    opted_out = make_request(
        prompt="hi", **_sampling(build_parser().parse_args(["generate", "hi", "--no-prefix-cache"]))
    )
    assert opted_out.HasField("prefix_cache") and opted_out.prefix_cache is False
    default = make_request(prompt="hi", **_sampling(build_parser().parse_args(["generate", "hi"])))
    assert not default.HasField("prefix_cache")  # the server's default (true)


def test_an_empty_question_is_refused_before_it_is_sent(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["generate", "  ", "--address", "127.0.0.1:1"])
    assert done.value.code == 2
    assert capsys.readouterr().err == "meshserve: error: the question is empty\n"


def test_health_says_whether_anything_answered(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["health", "--address", "127.0.0.1:1"]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("meshserve: 127.0.0.1:1 not SERVING after 0 s; nothing answered: UNAVAILABLE")
        and err.count("\n") == 1
    ), err


def test_ctrl_c_in_a_client_ends_the_line_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import service.server.cli

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(service.server.cli, "_stream_to_terminal", interrupted)
    assert main(["generate", "hi", "--address", "127.0.0.1:1"]) == 130
    out, err = capsys.readouterr()
    assert out == "\n" and "Traceback" not in err


def test_generate_waiting_for_no_server_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["generate", "hi", "--address", "127.0.0.1:1", "--wait", "1"])
    assert done.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("meshserve: ") and "SERVING" in err and err.count("\n") == 1, err


def test_generate_constraint_flags_reach_the_request(tiny_server, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """--choice, --regex and --json-schema (a file) constrain the answer (the tiny model's random
    weights write nothing of the kind unconstrained); two of them at once is a usage error."""
    import json
    import re

    base = ["generate", "--address", tiny_server.address, "--temperature", "0", "--max-tokens", "40", "hi"]
    assert main([*base, "--choice", "yes", "--choice", "no"]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    assert main([*base, "--regex", "[0-9]{3}-[a-z]{2}"]) == 0
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", capsys.readouterr().out.strip())
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}))  # fmt: skip
    assert main([*base, "--json-schema", str(schema)]) == 0
    assert isinstance(json.loads(capsys.readouterr().out)["ok"], bool)
    with pytest.raises(SystemExit) as info:
        main([*base, "--regex", "a", "--choice", "b"])
    assert info.value.code == 2
