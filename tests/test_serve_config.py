"""``meshserve serve --config FILE``: YAML keys = ServerConfig fields (the engine's under
``engine:``, or flat), flags override, and a bad file is a one-line error, not a traceback."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.engine.config import EngineConfig
from service.server.cli import _serve_config, build_parser, main
from service.server.config import ConfigError, ServerConfig, read_server_config, server_config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "configs" / "serve.yaml"


def serve_config(*argv: str) -> ServerConfig:
    return _serve_config(build_parser().parse_args(["serve", *argv]))


def error_of(tmp_path: Path, text: str) -> str:
    """The message ``meshserve serve --config`` exits with for a file holding ``text``."""
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--config", str(path)])
    message = str(exc.value.code)
    assert message.startswith(f"meshserve serve: error: {path}: ") and "\n" not in message
    return message


def test_the_example_file_holds_every_key_at_its_default() -> None:
    data = read_server_config(EXAMPLE)
    fields = {f.name for f in dataclasses.fields(ServerConfig)}
    assert set(data) == fields
    assert set(data["engine"]) == {f.name for f in dataclasses.fields(EngineConfig)}
    assert server_config(data, where=str(EXAMPLE)) == ServerConfig()
    assert serve_config("--config", str(EXAMPLE)) == ServerConfig()


def test_engine_mapping_flat_keys_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("port: 6000\nmax_queue: 3\nstall_timeout_s: 30\nengine:\n  num_slots: 8\n  kv_dtype: bfloat16\n")
    cfg = serve_config("--config", str(path))
    assert (cfg.port, cfg.max_queue, cfg.stall_timeout_s) == (6000, 3, 30.0)
    assert cfg.engine == EngineConfig(num_slots=8, kv_dtype="bfloat16")
    path.write_text("num_slots: 2\nmax_seq_len: 128\nlayout: 1x2\n")  # flat engine keys
    assert serve_config("--config", str(path)).engine == EngineConfig(num_slots=2, max_seq_len=128)
    cfg = serve_config("--config", str(path), "--num-slots", "6", "--port", "7000", "--matmul", "xla")
    assert (cfg.port, cfg.layout) == (7000, "1x2")
    assert cfg.engine == EngineConfig(num_slots=6, max_seq_len=128, matmul="xla")
    assert serve_config("--slots", "3").engine.num_slots == 3  # no file: the flags alone
    assert serve_config("--kv-cache-memory", "2GiB").engine.kv_cache_memory == 2 * 2**30
    with pytest.raises(SystemExit):  # both sizes: the engine's config refuses it, one line
        serve_config("--kv-cache-memory", "2GiB", "--kv-cache-tokens", "4096")


def test_empty_file_is_the_defaults(tmp_path: Path) -> None:
    (tmp_path / "empty.yaml").write_text("# nothing set\n")
    assert serve_config("--config", str(tmp_path / "empty.yaml")) == ServerConfig()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("port: [1\n", "not valid YAML at line 2, column 1: expected ',' or ']', but got '<stream end>'"),
        ("portt: 1\n", "unknown key 'portt' (did you mean 'port'?); known: admin_host, "),
        ("grace_period: 5\n", "unknown key 'grace_period' (did you mean 'grace_period_s'?); known: "),
        ("xyzzy: 1\n", "unknown key 'xyzzy'; known: admin_host, "),
        (
            "engine:\n  slots: 2\n",
            "unknown key 'engine.slots' (did you mean 'engine.num_slots'?); known: engine.attention, engine.chunk_size, ",
        ),
        ("port: abc\n", "port must be int, got 'abc'"),
        ("port: true\n", "port must be int, got True"),
        ("warmup_full: 1\n", "warmup_full must be bool, got 1"),
        ("pools: fast=1x4\n", "pools must be a list of strings, got 'fast=1x4'"),
        ("engine:\n  num_slots: 2.5\n", "num_slots must be int, got 2.5"),
        ("engine: 4\n", "engine must be a mapping of num_slots, "),
        ("engine:\n  num_slots: 0\n", "num_slots must be >= 1, got 0"),
        ("engine:\n  dtype: float16\n", "dtype must be one of float32, bfloat16, got 'float16'"),
        ("num_slots: 2\nengine:\n  num_slots: 4\n", "num_slots is given twice, at the top level and under engine"),
        ("- port: 1\n", "expected a mapping of ServerConfig keys, got list"),
    ],
)
def test_a_bad_file_is_a_one_line_error(tmp_path: Path, text: str, message: str) -> None:
    assert message in error_of(tmp_path, text)


def test_missing_or_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--config", str(tmp_path / "absent.yaml")])
    assert exc.value.code == f"meshserve serve: error: {tmp_path / 'absent.yaml'}: no such config file"
    with pytest.raises(ConfigError, match="cannot read the config file"):
        read_server_config(tmp_path)  # a directory
    (tmp_path / "latin1.yaml").write_bytes(b"model: caf\xe9\n")
    with pytest.raises(ConfigError, match="cannot read the config file"):
        read_server_config(tmp_path / "latin1.yaml")


def test_the_command_exits_1_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("port: abc\n")
    for path in (tmp_path / "absent.yaml", tmp_path / "bad.yaml"):
        run = subprocess.run(
            [sys.executable, "-m", "service.server.cli", "serve", "--config", str(path)],
            cwd=ROOT,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 1, run.stderr
        assert run.stderr.count("\n") == 1 and run.stderr.startswith(f"meshserve serve: error: {path}: "), run.stderr
        assert "Traceback" not in run.stderr


def test_bad_flag_values_are_one_line_errors_too() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--num-slots", "0"])
    assert exc.value.code == "meshserve serve: error: flags: num_slots must be >= 1, got 0"
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--num-slots", "2", "--max-num-batched-tokens", "0"])
    assert exc.value.code == "meshserve serve: error: flags: max_num_batched_tokens must be >= 1, got 0"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--layers", "unrolled"], "--layers was removed: the per-slot engine and its per-layer weights are gone"),
        (["--kv-cache", "slots"], "--kv-cache was removed: the KV cache is always paged now"),
        (["--kv-cache"], "--kv-cache was removed"),
        (["--matmul", "bf16x3"], "bf16x3 was removed with the per-slot engine"),
        (["--matmul", "amx"], "invalid choice 'amx' (choose from auto, xla)"),
    ],
)
def test_flags_of_the_removed_engine_are_usage_errors_saying_what_replaced_them(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", *argv])
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_the_old_engine_keys_in_a_config_file_name_their_replacements(tmp_path: Path) -> None:
    assert "unknown key 'engine.decode_attention' (did you mean 'engine.attention'?)" in error_of(
        tmp_path, "engine:\n  decode_attention: xla\n"
    )
    assert "unknown key 'engine.layers' (did you mean 'engine.layer_loop'?)" in error_of(
        tmp_path, "engine:\n  layers: scan\n"
    )


@pytest.mark.parametrize("flag, key", [("--max-queue", "max_queue"), ("--default-max-tokens", "default_max_tokens")])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_queue_or_default_max_tokens_below_one_is_refused_at_start_up(
    tmp_path: Path, flag: str, key: str, value: str
) -> None:
    """Accepted, they made a server that refused every request (a queue of 0) or answered
    requests without max_tokens with 1 token or an error blaming the client's min_tokens."""
    with pytest.raises(SystemExit) as exc:
        main(["serve", flag, value])
    assert exc.value.code == f"meshserve serve: error: flags: {key} must be >= 1, got {value}"
    assert error_of(tmp_path, f"{key}: {value}\n").endswith(f"{key} must be >= 1, got {value}")


def test_weights_naming_a_dtype_and_another_dtype(tmp_path: Path) -> None:
    """``--weights bfloat16`` holds every weight as bfloat16 (it sets the dtype): with another
    ``--dtype`` from the same place it is an error, not a silent choice; a flag wins over the file."""
    with pytest.raises(SystemExit, match="weights bfloat16 and dtype float32 contradict"):
        serve_config("--weights", "bfloat16", "--dtype", "float32")
    assert serve_config("--weights", "bfloat16", "--dtype", "bfloat16").engine.dtype == "bfloat16"
    path = tmp_path / "serve.yaml"
    path.write_text("engine:\n  dtype: float32\n")
    assert serve_config("--config", str(path), "--weights", "bfloat16").engine.dtype == "bfloat16"
    path.write_text("engine:\n  weights: bfloat16\n")
    cfg = serve_config("--config", str(path), "--dtype", "float32").engine
    assert (cfg.weights, cfg.dtype) == ("float32", "float32")
    path.write_text("engine:\n  weights: bfloat16\n  dtype: float32\n")
    with pytest.raises(SystemExit, match="contradict"):
        serve_config("--config", str(path))
    assert (
        serve_config("--weights", "int8", "--dtype", "bfloat16").engine.dtype == "bfloat16"
    )  # int8: the rest bfloat16
