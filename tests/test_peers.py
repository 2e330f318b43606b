"""benchmarks/peers.py on hand-made results and fakes (no engine runs): the MBU/MFU and roofline columns, the
interleaved rounds of measure_all, the worker's commands (handle) and its JSON-lines pipe (Worker)."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from model.config import LlamaConfig

spec = importlib.util.spec_from_file_location("peers", Path(__file__).parent.parent / "benchmarks" / "peers.py")
assert spec is not None and spec.loader is not None
peers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peers)

TINY = LlamaConfig.tiny()  # matmul weights 24576 + 49152 + 16384 = 90112, norms 320; KV 512 B/token in fp32
MACHINE = {"read_bytes_per_s": 1e9, "float32_flops": 1e9}
WL = {"prompt_len": 8, "new_tokens": 4, "batches": [1, 2], "ttft_prompt": list(range(16))}


def result(tpot_ms: float) -> dict:
    batches = {str(b): {"tpot_ms": tpot_ms, "decode_tok_s": b / tpot_ms * 1e3, "ttft_s": 0.01} for b in (1, 2)}
    return {"status": "ok", "batches": batches, "ttft_long_s": 0.5, "ttft_long_prefill_tok_s": 32.0, "load_s": 1.0}


def test_mbu_mfu_and_the_roofline_column() -> None:
    results = {
        "meshserve fp32": result(1.0),
        "llama.cpp GGUF blocks": result(0.5),
        "vLLM-CPU fp32": {"status": "failed: x"},
    }
    roof = peers.add_utilization(results, WL, MACHINE, TINY)
    # B=1 at context 8 + 4/2 = 10: (90112 + 320) x 4 + 10 x 512 bytes, 2 x 90112 + 4 x 10 x L2 x N4 x H16 FLOPs,
    # over a 1 ms step at 1 GB/s and 1 GFLOP/s.
    b1 = results["meshserve fp32"]["batches"]["1"]
    assert b1["mbu"] == pytest.approx(((90112 + 320) * 4 + 10 * 512) / 1e-3 / 1e9)
    assert b1["mfu"] == pytest.approx((2 * 90112 + 4 * 10 * 2 * 4 * 16) / 1e-3 / 1e9)
    assert b1["predicted_tpot_ms"] == pytest.approx(((90112 + 320) * 4 + 10 * 512) / 1e9 * 1e3)  # memory-bound
    q4 = results["llama.cpp GGUF blocks"]["batches"]["1"]
    assert q4["mbu"] is None and q4["mfu"] == pytest.approx(2 * b1["mfu"])  # same FLOPs in half the time
    assert results["meshserve fp32"]["ttft_long_mfu"] > 0 and "batches" not in results["vLLM-CPU fp32"]
    # The roofline's own step: memory-bound, so MBU 100 %; its TPOT is the prediction.
    assert roof["batches"]["1"]["mbu"] == pytest.approx(1.0)
    assert roof["batches"]["1"]["tpot_ms"] == pytest.approx(b1["predicted_tpot_ms"])
    assert roof["ttft_long_mfu"] <= 1.0 + 1e-9
    text = peers.table({**results, peers.ROOFLINE: roof}, WL)
    lines = {line[:28].strip(): line for line in text.splitlines()}
    assert peers.ROOFLINE in lines["figure"]
    assert "36.7%" in lines["MBU decode, B=1"] and "100.0%" in lines["MBU decode, B=1"]
    assert lines["MBU decode, B=1"].split()[4] == "-"  # Q4_1's cell
    assert "MFU TTFT, 1 x 16" in lines


def test_ttft_against_the_floor_at_the_sgemm_rate_measured_next_to_it() -> None:
    """A worker's own sgemm probe (taken around its 512-token TTFT) sets that engine's floor: at
    twice the machine's rate, a compute-bound prefill's floor is half the roofline column's."""
    probed = {**result(1.0), "ttft_long_probe_flops": 2e9}
    results = {"meshserve fp32": probed, "HF transformers fp32": result(1.0)}  # HF: no probe
    roof = peers.add_utilization(results, WL, MACHINE, TINY)
    assert roof["ttft_long_mfu"] == pytest.approx(1.0)  # compute-bound at 16 tokens
    assert probed["ttft_long_floor_ratio"] == pytest.approx(0.5 / (roof["ttft_long_s"] / 2))
    assert "ttft_long_floor_ratio" not in results["HF transformers fp32"]
    lines = {line[:28].strip(): line for line in peers.table({**results, peers.ROOFLINE: roof}, WL).splitlines()}
    assert lines["sgemm GFLOP/s at that TTFT"].split()[5] == "2"
    assert lines["TTFT / its compute floor"].split()[5] == f"{probed['ttft_long_floor_ratio']:.2f}"


def test_sgemm_rate_is_positive() -> None:
    assert peers.sgemm_rate(n=64, repeats=1) > 0


class Recorder:
    """Fake engines for ``measure_all``: each answers from ``times[label]`` in turn and logs the call."""

    def __init__(self, times: dict[str, list[tuple[float, float]]], fail_at: dict[str, int] | None = None) -> None:
        self.times, self.fail_at, self.log = times, fail_at or {}, []

    def engine(self, label: str):
        def call(cmd: dict) -> dict:
            self.log.append((label, cmd["op"], cmd.get("batch")))
            timed = sum(1 for lab, op, _ in self.log if lab == label and op == "time")
            if cmd["op"] == "time" and timed == self.fail_at.get(label):
                raise RuntimeError("worker exited (rc 1)")
            if cmd["op"] == "setup":
                return {"status": "ok", "ids": [7, 8], "warmup_s": 9.0}
            if cmd["op"] == "time":
                ttft, total = self.times[label][(timed - 1) % len(self.times[label])]
                return {"status": "ok", "ttft_s": ttft, "total_s": total, "decode_s": total - ttft, "dispatch_ms": 1.0}
            if cmd["op"] == "long_time":
                return {"status": "ok", "ttft_s": 0.5, "probe_flops": 1e9 * timed_long(self.log, label)}
            return {"status": "ok"}

        return call


def timed_long(log: list, label: str) -> int:
    return sum(1 for lab, op, _ in log if lab == label and op == "long_time")


def test_measure_all_interleaves_rounds_and_takes_each_engines_median() -> None:
    wl = {**WL, "batches": [2], "repeats": 3, "new_tokens": 5, "prompts": [[1] * 8] * 2}
    rec = Recorder({"a": [(0.1, 0.5), (0.3, 0.9), (0.2, 0.6)], "b": [(0.2, 0.1)]})
    out = peers.measure_all({"a": rec.engine("a"), "b": rec.engine("b")}, wl, settle_s=0.0)
    timed = [lab for lab, op, _ in rec.log if op == "time"]
    assert timed == ["a", "b", "b", "a", "a", "b"]  # every other round reversed
    assert [op for lab, op, _ in rec.log if lab == "a"] == ["setup", "time", "time", "time", "long_setup"] + [
        "long_time"
    ] * 3
    fig = out["a"]["batches"]["2"]
    assert fig["ttft_s"] == pytest.approx(0.2) and fig["total_s"] == pytest.approx(0.6)  # medians
    assert fig["tpot_ms"] == pytest.approx(1e3 * 0.4 / 4) and fig["decode_tok_s"] == pytest.approx(2 * 4 / 0.4)
    assert fig["host_share"] == pytest.approx(1.0 / 100.0) and fig["warmup_s"] == 9.0
    assert out["a"]["row0_ids"] == [7, 8] and out["a"]["ttft_long_probe_flops"] == 3e9  # the fastest probe
    # b's 5-token runs were faster than its 1-token runs (a runner without first_at): no decode
    # figures, and none made up.
    assert out["b"]["batches"]["2"]["tpot_ms"] is None and "host_share" not in out["b"]["batches"]["2"]
    peers.add_utilization({"b": out["b"]}, wl, MACHINE, TINY)
    assert "mbu" not in out["b"]["batches"]["2"]


def test_a_failing_engine_drops_out_and_the_others_go_on() -> None:
    wl = {**WL, "batches": [1, 2], "repeats": 2, "prompts": [[1] * 8] * 2}
    rec = Recorder({"a": [(0.1, 0.5)], "c": [(0.1, 0.5)]}, fail_at={"c": 2})
    out = peers.measure_all({"a": rec.engine("a"), "c": rec.engine("c")}, wl, settle_s=0.0)
    assert out["c"] == {"status": "failed: RuntimeError: worker exited (rc 1)"}
    assert [op for lab, op, _ in rec.log if lab == "c"] == ["setup", "time", "time"]  # no call after it failed
    assert set(out["a"]["batches"]) == {"1", "2"} and out["a"]["ttft_long_s"] == 0.5


class FakeRunner(peers.Runner):
    def __init__(self, stamps: bool = False) -> None:
        self.calls: list = []
        self.stamps = stamps  # whether generate sets first_at, as the real runners but vLLM's do

    def setup(self, batch: int, prompt_len: int, new_tokens: int) -> None:
        self.calls.append(("setup", batch, prompt_len, new_tokens))

    def generate(self, rows: list[list[int]], n: int) -> list[int]:
        self.calls.append(("generate", len(rows), len(rows[0]), n))
        if self.stamps:
            time.sleep(0.01)
            self.first_at = time.perf_counter()
            time.sleep(0.02)
        return list(range(n))


def test_handle_runs_each_command_on_the_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    probes = iter([2e9, 3e9])
    monkeypatch.setattr(peers, "sgemm_rate", lambda: next(probes))
    wl = {**WL, "prompts": [[1] * 8] * 2}
    r = FakeRunner()
    assert peers.handle(r, wl, {"op": "setup", "batch": 2})["ids"] == [0, 1, 2, 3]
    got = peers.handle(r, wl, {"op": "time", "batch": 2})  # no first_at: a 1-token run for TTFT
    assert got["ttft_s"] >= 0 and got["decode_s"] == pytest.approx(got["total_s"] - got["ttft_s"])
    assert peers.handle(r, wl, {"op": "long_setup"}) == {}
    assert peers.handle(r, wl, {"op": "long_time"})["probe_flops"] == 3e9  # the faster of the two
    assert r.calls == [("setup", 2, 8, 4), ("generate", 2, 8, 4), ("generate", 2, 8, 4), ("generate", 2, 8, 1),
                       ("setup", 1, 16, 1), ("generate", 1, 16, 1), ("generate", 1, 16, 1)]  # fmt: skip
    with pytest.raises(ValueError, match="unknown op"):
        peers.handle(r, wl, {"op": "nap"})
    # A runner that timestamps its first token: TTFT and decode split one run, no extra run.
    r = FakeRunner(stamps=True)
    got = peers.handle(r, wl, {"op": "time", "batch": 2})
    assert r.calls == [("generate", 2, 8, 4)]
    assert 0.01 <= got["ttft_s"] < got["total_s"] and 0.02 <= got["decode_s"] < got["total_s"]
    assert got["ttft_s"] + got["decode_s"] == pytest.approx(got["total_s"])


def test_worker_pipe_round_trip_timeout_and_exit() -> None:
    echo = "import sys, json\nprint(json.dumps({'status': 'ok'}), flush=True)\nfor line in sys.stdin:\n" \
           "    c = json.loads(line)\n    if c['op'] == 'quit': break\n    if c['op'] == 'die': sys.exit(3)\n" \
           "    if c['op'] == 'nap': import time; time.sleep(30)\n" \
           "    print(json.dumps({'status': 'ok', 'echo': c['op']}), flush=True)\n"  # fmt: skip
    w = peers.Worker([sys.executable, "-c", echo], dict(os.environ), timeout=20)
    assert w.hello == {"status": "ok"} and w({"op": "time"}) == {"status": "ok", "echo": "time"}
    w.close()
    assert w.proc.returncode == 0
    w = peers.Worker([sys.executable, "-c", echo], dict(os.environ), timeout=20)
    with pytest.raises(RuntimeError, match="rc 3"):
        w({"op": "die"})
    w = peers.Worker([sys.executable, "-c", echo], dict(os.environ), timeout=0.5)
    with pytest.raises(TimeoutError):
        w({"op": "nap"})
    w.close()
    assert w.proc.returncode is not None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt-len", "0"], "--prompt-len: must be >= 1, got 0"),
        (["--new-tokens", "1"], "--new-tokens: must be >= 2, got 1"),
        (["--batches", "8", "-1"], "--batches: must be >= 1"),
        (["--model", "/nonexistent/model.gguf"], "not found"),
    ],
)
def test_bad_arguments_are_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        peers.main([*argv, "--peers", "meshserve"])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_an_empty_text_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tiny_gguf import write_tiny_llama_gguf

    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(SystemExit) as exc:  # it looped forever doubling an empty token list
        peers.main(["--model", str(model), "--text", str(empty), "--peers", "meshserve"])
    assert exc.value.code == 2 and "no tokens in it" in capsys.readouterr().err


def greedy_dense(graphdef, params, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    """``n`` greedy ids of the cache-less dense reference forward (tests/reference.py)."""
    from reference import dense_logits

    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(dense_logits(graphdef, params, ids)[-1])))
    return ids[len(prompt) :]


def test_the_float_row_serves_through_the_engine_loop(tmp_path: Path) -> None:
    """``meshserve`` runs the served engine (a Runner on one device through its engine loop) and
    gives the dense reference's greedy ids, every row done, round after round, the first token's
    time stamped and the decode steps' dispatch timed."""
    from tiny_gguf import write_tiny_llama_gguf

    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    wl = {"model": str(path), "threads": 2}
    rows = [[5, 17, 40, 99, 120, 7, 8, 9], [6, 18, 41, 98, 121, 8, 9, 10]]
    runner = peers.make_runner("meshserve", wl)
    assert "the served engine" in runner.notes and "KV cache float32" in runner.notes
    want = greedy_dense(runner.graphdef, runner.params, rows[0], 6)
    runner.setup(2, len(rows[0]), 6)
    for _ in range(2):  # a second round prefills again (prefix cache off) and gives the same ids
        runner.first_at = None
        assert runner.generate(rows, 6) == want
        assert runner.first_at is not None
        stats = runner.stats()
        assert stats["dispatch_ms"] > 0
    runner.setup(1, len(rows[0]), 6)  # a new B: the previous loop stopped, a new pool
    assert runner.generate(rows[:1], 6) == want
    runner.close()


def test_the_stored_row_serves_the_gguf_blocks_and_the_float_rows_ids(tmp_path: Path) -> None:
    """``meshserve-stored`` runs the served engine over the file's Q4_1 blocks and decodes the ids
    of the float32 row on the same file (the same weights' values)."""
    from tiny_gguf import write_tiny_llama_gguf

    from model.matmul import has_packed

    path = write_tiny_llama_gguf(tmp_path / "q.gguf", quantize="Q4_1")
    wl = {"model": str(path), "threads": 2}
    rows = [[5, 17, 40, 99, 120, 7, 8, 9], [6, 18, 41, 98, 121, 8, 9, 10]]
    got = {}
    for variant in ("meshserve", "meshserve-stored"):
        runner = peers.make_runner(variant, wl)
        assert has_packed(runner.params) == (variant == "meshserve-stored")
        runner.setup(2, len(rows[0]), 6)
        got[variant] = runner.generate(rows, 6)
        runner.close()
    assert len(got["meshserve"]) == 6 and got["meshserve-stored"] == got["meshserve"]
    assert "meshserve GGUF blocks as stored" in peers.QUANTIZED  # no fp32-bytes MBU for it


def test_the_int8_row_serves_q8_0_blocks_of_the_float_weights(tmp_path: Path) -> None:
    """``meshserve-int8`` quantizes the float32 weights (here dequantized Q4_1) to Q8_0 blocks and
    decodes the ids of the float model over those blocks' values."""
    from flax import nnx
    from tiny_gguf import write_tiny_llama_gguf

    from model.weights import block_params
    from model.weights.build import llama_from_params
    from model.weights.checkpoint import expected_shapes
    from model.weights.quant_panels import QuantPanels

    path = write_tiny_llama_gguf(tmp_path / "q.gguf", quantize="Q4_1")
    wl = {"model": str(path), "threads": 2}
    rows = [[5, 17, 40, 99, 120, 7, 8, 9]]
    runner = peers.make_runner("meshserve-int8", wl)
    w_down = runner.params["layers"]["w_down"].get_value()
    assert isinstance(w_down, QuantPanels) and w_down.format == "q8_0"
    runner.setup(1, len(rows[0]), 6)
    got = runner.generate(rows, 6)
    runner.close()
    floats = block_params.dequantize_params(nnx.to_pure_dict(runner.params), expected_shapes(runner.cfg), np.float32)
    ref = peers.MeshserveRunner.over(runner.cfg, *llama_from_params(runner.cfg, floats))
    ref.setup(1, len(rows[0]), 6)
    assert len(got) == 6 and got == ref.generate(rows, 6)
    ref.close()
    assert "meshserve int8 (Q8_0 of fp32)" in peers.QUANTIZED


def test_the_kv_bf16_row_holds_a_bfloat16_pool(tmp_path: Path) -> None:
    """``meshserve-kv-bf16``: the served engine with a bfloat16 KV cache (EngineConfig.kv_dtype)."""
    from tiny_gguf import write_tiny_llama_gguf

    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    runner = peers.make_runner("meshserve-kv-bf16", {"model": str(path), "threads": 2})
    assert "KV cache bfloat16" in runner.notes
    runner.setup(1, 8, 4)
    assert runner.loop.runner.kv_dtype.name == "bfloat16" and runner.loop.runner.cache.k.dtype.name == "uint16"
    assert len(runner.generate([[5, 17, 40, 99, 120, 7, 8, 9]], 4)) == 4
    runner.close()
    assert peers.KV_DTYPE["meshserve fp32, bf16 KV"] == "bfloat16"


def test_greedy_ids_are_compared_with_the_float32_row() -> None:
    ids = {
        "meshserve fp32": [1, 2, 3, 4],
        "meshserve GGUF blocks as stored": [1, 2, 9, 4],
        "llama.cpp GGUF blocks": [1, 2, 3, 4],
    }
    assert peers.id_agreement(ids) == {
        "meshserve GGUF blocks as stored": "greedy ids agree with meshserve fp32 for 2/4 tokens",
        "llama.cpp GGUF blocks": "greedy ids agree with meshserve fp32 for 4/4 tokens",
    }
    assert peers.id_agreement({"llama.cpp GGUF blocks": [1]}) == {}


def test_only_the_served_engines_rows_are_offered() -> None:
    """The per-slot engine's options (its layer forms, bf16x3 matmuls) and the separate "paged"
    rows are gone: every meshserve row is the served engine."""
    assert set(peers.PEERS) == {"meshserve", "hf", "llamacpp", "vllm", "meshserve-kv-bf16", "meshserve-stored",
                                "meshserve-int8"}  # fmt: skip
    assert set(peers.REQUIRES) == set(peers.VARIANTS) == set(peers.PEERS)
    for removed in (["--peers", "meshserve-paged"], ["--peers", "meshserve-bf16x3"], ["--layers", "scan"]):
        with pytest.raises(SystemExit):
            peers.main(removed)
