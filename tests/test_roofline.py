"""The roofline model (benchmarks/roofline.py) against hand-computed cases."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from benchmarks import roofline as rl
from benchmarks.roofline import Hardware, HardwareError, Parallelism, Workload, mbu, mfu, ring_all_reduce_s, roofline
from model.config import LlamaConfig

# SmolLM2-135M from peers.md: 30 layers, hidden 576, 9 query / 3 KV heads of 64, MLP 1536,
# vocabulary 49152, tied embeddings; 134.5 M parameters.
SMOLLM2 = LlamaConfig.smollm2_135m()
# peers.md: numpy read bandwidth ≈ 25 GB/s, fp32 sgemm ≈ 148 GFLOP/s on the 2-core build machine.
PEERS_CPU = Hardware(
    name="peers-cpu", hbm_bytes_per_s=25e9, peak_flops={"float32": 148e9}, interconnect_bytes_per_s=25e9
)
# The seeds' example chip: 1e15 FLOP/s, 3e12 B/s.
CHIP = Hardware(name="chip", hbm_bytes_per_s=3e12, peak_flops={"bfloat16": 1e15}, interconnect_bytes_per_s=1e11)
# A tied Llama-3-8B-shaped model with the MLP widened to make exactly ~8.0e9 parameters.
EIGHT_B = LlamaConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=15595,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
)
TINY = LlamaConfig.tiny()  # V=256 D=64 F=128 L=2 N=4 K=2 H=16, tied


def test_seed_8b_example() -> None:
    assert EIGHT_B.param_count() == pytest.approx(8.0e9, rel=1e-4)
    r = roofline(EIGHT_B, CHIP, Parallelism(), Workload(batch=1, context_len=0, dtype="bfloat16"))
    # 8B parameters x 2 bytes = 16 GB read per decode step; 16e9 / 3e12 = 5.33 ms.
    assert r.decode.memory_bytes == pytest.approx(16.0e9, rel=1e-4)
    assert r.tpot_s == pytest.approx(5.333e-3, rel=1e-3)
    assert r.regime == "memory"
    # Ridge 1e15 / 3e12 = 333 FLOP/byte; in bf16 (2 FLOPs per 2-byte weight per row) that is the batch.
    assert r.ridge == pytest.approx(333.33, rel=1e-4)
    assert r.critical_batch == pytest.approx(333.33, rel=1e-4)
    below = roofline(EIGHT_B, CHIP, Parallelism(), Workload(batch=300, context_len=0))
    above = roofline(EIGHT_B, CHIP, Parallelism(), Workload(batch=400, context_len=0))
    assert below.regime == "memory" and above.regime == "compute"
    # Compute-bound: 2 FLOPs per (matmul) parameter per token at 1e15 FLOP/s.
    assert above.tpot_s == pytest.approx(2 * 400 * 8.0e9 / 1e15, rel=1e-3)


def test_smollm2_fp32_decode_floor_on_peers_cpu() -> None:
    r = roofline(SMOLLM2, PEERS_CPU, Parallelism(), Workload(batch=1, context_len=0, dtype="float32"))
    # peers.md: 540 MB / 25 GB/s ≈ 21.6 ms per token (46 tok/s).
    assert r.decode.weight_bytes == 4 * SMOLLM2.param_count() == 538_060_032
    assert r.tpot_s == pytest.approx(21.6e-3, rel=5e-3)
    assert r.tokens_per_s == pytest.approx(46.4, rel=5e-3)
    # peers.md compute ceiling: 148 GFLOP/s / 0.27 GFLOP per token ≈ 548 tok/s.
    big = roofline(SMOLLM2, PEERS_CPU, Parallelism(), Workload(batch=4096, context_len=0, dtype="float32"))
    assert big.regime == "compute"
    assert big.tokens_per_s == pytest.approx(548, rel=0.01)
    # fp32 halves the rows per byte: the critical batch is twice the ridge (148/25 = 5.92 FLOP/byte).
    assert r.ridge == pytest.approx(5.92) and r.critical_batch == pytest.approx(11.84)


def test_smollm2_kv_bytes_and_context() -> None:
    # 2 * 30 layers * 3 KV heads * 64 * 2 bytes = 23,040 B per token in bf16 (sharding-notes §0).
    assert SMOLLM2.kv_bytes_per_token(2) == 23040
    r = roofline(SMOLLM2, CHIP, Parallelism(), Workload(batch=64, context_len=2048))
    assert r.decode.kv_bytes == 64 * 2048 * 23040
    assert r.kv_stored_bytes == 64 * 2048 * 23040


def test_tiny_decode_by_hand() -> None:
    # Matmul weights: attention 2*64*16*(2*4 + 2*2) = 24576, MLP 2*3*64*128 = 49152, LM head 256*64 = 16384.
    # Norms (2*2 + 1) * 64 = 320.
    hw = Hardware(name="h", hbm_bytes_per_s=1e9, peak_flops={"float32": 1e9}, interconnect_bytes_per_s=1e9)
    d = rl.decode_step(TINY, hw, Parallelism(), Workload(batch=2, context_len=10, dtype="float32"))
    assert d.weight_bytes == (24576 + 49152 + 16384 + 320) * 4
    assert d.kv_bytes == 2 * 10 * (2 * 2 * 2 * 16 * 4)  # B * S * 2(K,V) * L * K * H * 4 bytes
    assert d.flops == 2 * 2 * (24576 + 49152 + 16384) + 4 * 2 * 10 * 2 * 4 * 16
    assert d.memory_s == pytest.approx((d.weight_bytes + d.kv_bytes) / 1e9)
    assert d.compute_s == pytest.approx(d.flops / 1e9)
    assert d.collective_s == 0 and d.num_collectives == 0


def test_tiny_prefill_by_hand() -> None:
    hw = Hardware(name="h", hbm_bytes_per_s=1e9, peak_flops={"float32": 1e9}, interconnect_bytes_per_s=1e9)
    p = rl.prefill_step(TINY, hw, Parallelism(), Workload(prompt_len=8, dtype="float32"))
    # 2*T*(attention + MLP weights) + LM head on the last position + causal attention 2*T*(T+1)*L*N*H.
    assert p.flops == 2 * 8 * (24576 + 49152) + 2 * 16384 + 2 * 8 * 9 * 2 * 4 * 16
    assert p.kv_bytes == 8 * 512
    r = roofline(TINY, hw, Parallelism(), Workload(prompt_len=8, dtype="float32"))
    assert r.ttft_s == pytest.approx(max(p.memory_s, p.compute_s))


def test_tp_collectives_by_hand() -> None:
    hw = Hardware(name="h", hbm_bytes_per_s=4.8e12, peak_flops={"bfloat16": 989e12}, interconnect_bytes_per_s=450e9)
    wl = Workload(batch=64, context_len=2048)
    d = rl.decode_step(SMOLLM2, hw, Parallelism(tp=8, attention="replicated"), wl)
    # replicated attention: 1 all-reduce per layer + 1 for the vocabulary-split embedding = 31,
    # each of 64 rows x 576 x 4 bytes (float32 residual) = 147,456 B; ring 2*7/8 * bytes / 450 GB/s.
    assert d.num_collectives == 31
    assert d.collective_s == pytest.approx(31 * 2 * 7 / 8 * 147456 / 450e9)
    assert d.collective_bytes == pytest.approx(31 * 2 * 7 / 8 * 147456)
    heads = rl.decode_step(SMOLLM2, hw, Parallelism(tp=3, attention="heads"), wl)
    assert heads.num_collectives == 61  # 2 per layer + 1
    assert heads.kv_bytes == 64 * 2048 * 23040 / 3  # KV split over heads
    # TPOT = max(memory, compute) + collectives.
    r = roofline(SMOLLM2, hw, Parallelism(tp=8, attention="replicated"), wl)
    assert r.tpot_s == pytest.approx(max(d.memory_s, d.compute_s) + d.collective_s)
    lat = rl.decode_step(SMOLLM2, hw, Parallelism(tp=8, attention="replicated"), Workload(batch=64, hop_latency_s=1e-6))
    assert lat.collective_s == pytest.approx(d.collective_s + 31 * 14 * 1e-6)


def test_throughput_scales_with_data_parallel_replicas() -> None:
    one = roofline(SMOLLM2, CHIP, Parallelism(dp=1), Workload(batch=16))
    four = roofline(SMOLLM2, CHIP, Parallelism(dp=4), Workload(batch=16))
    assert four.tpot_s == one.tpot_s
    assert four.tokens_per_s == pytest.approx(4 * 16 / one.tpot_s)
    # On shared hardware (fake CPU devices) four replicas split one machine: no gain.
    shared = Hardware(
        name="s", hbm_bytes_per_s=25e9, peak_flops={"float32": 148e9}, interconnect_bytes_per_s=25e9, shared=True
    )
    s1 = roofline(SMOLLM2, shared, Parallelism(dp=1), Workload(batch=16, dtype="float32"))
    s4 = roofline(SMOLLM2, shared, Parallelism(dp=4), Workload(batch=16, dtype="float32"))
    assert s4.tokens_per_s == pytest.approx(s1.tokens_per_s)


@pytest.mark.parametrize("layout", ["single", "latency", "throughput", "hybrid", "tp3"])
def test_bytes_per_device_agree_with_sharding_plan(layout: str) -> None:
    from sharding.layouts import load_layout
    from sharding.plan import make_plan

    plan = make_plan(load_layout(layout), SMOLLM2, 8)
    par = Parallelism.from_plan(plan)
    for itemsize, dtype in ((4, "float32"), (2, "bfloat16")):
        assert rl.weight_bytes_per_device(SMOLLM2, par, itemsize) == plan.weight_bytes_per_device(SMOLLM2, itemsize)
        r = roofline(SMOLLM2, CHIP if dtype == "bfloat16" else PEERS_CPU, par, Workload(8 // par.dp, 2048, dtype=dtype))
        assert r.kv_stored_bytes == plan.kv_bytes_per_device(SMOLLM2, 8 * 2048, dtype)  # a pool of 8 x 2048
        assert r.parallelism.all_reduces_per_layer == plan.all_reduces_per_layer


def test_utilization_helpers() -> None:
    assert mbu(16e9, 2 * 16e9 / 3e12, 3e12) == pytest.approx(0.5)
    assert mfu(1e15, 4.0, 1e15) == pytest.approx(0.25)
    assert ring_all_reduce_s(1e6, 1, 1e9) == 0
    assert ring_all_reduce_s(1e6, 4, 1e9) == pytest.approx(1.5e-3)
    assert ring_all_reduce_s(1e6, 4, 1e9, hop_latency_s=1e-6) == pytest.approx(1.5e-3 + 6e-6)


def test_decode_utilization_8b_by_hand() -> None:
    # 8B parameters in bf16 = 16 GB per decode step (batch 1, no KV); a 10 ms step at 2 TB/s
    # moves 1.6 TB/s: MBU 0.8. FLOPs 2 x 8e9 = 1.6e10 per step -> 1.6e12 FLOP/s of 1e15: MFU 0.0016.
    hw = Hardware(name="h", hbm_bytes_per_s=2e12, peak_flops={"bfloat16": 1e15}, interconnect_bytes_per_s=1e11)
    u = rl.decode_utilization(EIGHT_B, hw, Parallelism(), batch=1, context_len=0, dtype="bfloat16", step_s=10e-3)
    assert u.mbu == pytest.approx(0.8, rel=1e-3)
    assert u.mfu == pytest.approx(0.0016, rel=1e-3)
    assert u.predicted_s == pytest.approx(16e9 / 2e12, rel=1e-3)  # 8 ms, memory-bound
    assert u.measured_s == 10e-3
    # A step exactly at the roofline's memory-bound time is MBU 1.
    at = rl.decode_utilization(EIGHT_B, hw, Parallelism(), 1, 0, "bfloat16", u.predicted_s)
    assert at.mbu == pytest.approx(1.0)


def test_decode_utilization_tiny_with_kv_and_shared_devices() -> None:
    # Tiny, fp32, B=2, S=10: bytes and FLOPs as in test_tiny_decode_by_hand; a 1 ms step.
    hw = Hardware(name="h", hbm_bytes_per_s=1e9, peak_flops={"float32": 1e9}, interconnect_bytes_per_s=1e9)
    nbytes = (24576 + 49152 + 16384 + 320) * 4 + 2 * 10 * 512
    flops = 2 * 2 * (24576 + 49152 + 16384) + 4 * 2 * 10 * 2 * 4 * 16
    u = rl.decode_utilization(TINY, hw, Parallelism(), 2, 10, "float32", 1e-3)
    assert u.mbu == pytest.approx(nbytes / 1e-3 / 1e9)
    assert u.mfu == pytest.approx(flops / 1e-3 / 1e9)
    # Shared hardware, 2 data-parallel replicas: each device has half the machine and its own copy
    # of the weights, so the same per-device step is twice the utilization of its half.
    shared = dataclasses.replace(hw, shared=True)
    u2 = rl.decode_utilization(TINY, shared, Parallelism(dp=2), 2, 10, "float32", 1e-3)
    assert u2.mbu == pytest.approx(2 * u.mbu) and u2.mfu == pytest.approx(2 * u.mfu)
    with pytest.raises(HardwareError, match="bfloat16"):
        rl.decode_utilization(TINY, hw, Parallelism(), 2, 10, "bfloat16", 1e-3)


def test_prefill_utilization_by_hand() -> None:
    # SmolLM2 fp32, a 512-token prompt on the peers.md CPU (148 GFLOP/s): FLOPs of prefill_step.
    flops = rl.prefill_step(SMOLLM2, PEERS_CPU, Parallelism(), Workload(prompt_len=512, dtype="float32")).flops
    attn, mlp, head = 30 * 576 * 64 * (2 * 9 + 2 * 3), 30 * 3 * 576 * 1536, 49152 * 576
    assert flops == 2 * 512 * (attn + mlp) + 2 * head + 2 * 512 * 513 * 30 * 9 * 64
    u = rl.prefill_utilization(SMOLLM2, PEERS_CPU, Parallelism(), 512, "float32", step_s=1.0)
    assert u.mfu == pytest.approx(flops / 148e9)
    assert u.predicted_s == pytest.approx(flops / 148e9)  # compute-bound: TTFT = FLOPs / peak
    assert u.mfu == pytest.approx(u.predicted_s / u.measured_s)


def test_hardware_presets() -> None:
    names = rl.hardware_names()
    assert {"h100-sxm", "h200", "tpu-v5e", "tpu-v5p", "tpu-v6e", "cpu-this-machine"} <= set(names)
    for name in ("h100-sxm", "h200", "tpu-v5e", "tpu-v5p", "tpu-v6e"):
        hw = rl.load_hardware(name)
        assert hw.source and hw.peak("bfloat16") > 1e14 and hw.hbm_bytes_per_s > 5e11
        assert hw.interconnect_bytes_per_s > 5e10 and hw.memory_bytes
    assert rl.load_hardware("h200").ridge("bfloat16") == pytest.approx(206, abs=1)  # sharding-notes §7
    assert rl.load_hardware("tpu-v5e").ridge("bfloat16") == pytest.approx(240, abs=1)  # scaling book
    with pytest.raises(HardwareError, match="presets"):
        rl.load_hardware("tpu-v9")
    with pytest.raises(HardwareError, match="float32"):
        rl.load_hardware("tpu-v5e").peak("float32")


def test_cpu_this_machine_uses_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rl, "measure_cpu", lambda: (20e9, 100e9))
    hw = rl.load_hardware("cpu-this-machine")
    assert hw.hbm_bytes_per_s == 20e9 and hw.peak("float32") == 100e9 and hw.shared
    with pytest.raises(HardwareError, match="bfloat16"):
        hw.peak("bfloat16")


def test_measure_cpu_is_positive_and_cached() -> None:
    first = rl.measure_cpu(read_bytes=8 * 2**20, matmul_n=128, repeats=1)
    assert first[0] > 1e8 and first[1] > 1e8
    assert rl.measure_cpu(read_bytes=8 * 2**20, matmul_n=128, repeats=1) is first


def test_cli_prints_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tiny_gguf import write_tiny_llama_gguf

    from benchmarks.cli import main

    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "r.json"
    args = ["roofline", "--model", str(model), "--hardware", "h200", "tpu-v5e", "--batch", "1", "64"]
    assert main([*args, "--layout", "1x1", "1x8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ridge 206 FLOP/byte" in text and "TPOT" in text and "1x8" in text
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * 2 * 2
    assert {(r["hardware"], r["tp"], r["batch"]) for r in rows} == {
        (h, tp, b) for h in ("h200", "tpu-v5e") for tp in (1, 8) for b in (1, 64)
    }
    assert all(r["tpot_s"] > 0 and r["regime"] in ("memory", "compute") for r in rows)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch", "-4"], "must be >= 1, got -4"),
        (["--batch", "0"], "must be >= 1, got 0"),
        (["--context", "-5"], "must be >= 1"),
        (["--act-bytes", "-1"], "must be >= 1"),
        (["--hop-latency-us", "-3"], "must be >= 0"),
        (["--batch", "x"], "expected an integer"),
    ],
)
def test_cli_rejects_nonsense_numbers(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["roofline", "--hardware", "h200", *flags])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_cli_errors_on_bad_model_json_path_and_no_usable_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tiny_gguf import write_tiny_llama_gguf

    from benchmarks.cli import main

    not_gguf = tmp_path / "notes.txt"
    not_gguf.write_text("hello")
    for model in (tmp_path / "missing.gguf", not_gguf):
        with pytest.raises(SystemExit, match="meshserve-bench roofline: .*" + model.name):
            main(["roofline", "--hardware", "h200", "--model", str(model)])
    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    with pytest.raises(SystemExit, match="no folder"):
        main(["roofline", "--hardware", "h200", "--model", str(model), "--json", str(tmp_path / "no" / "r.json")])
    # The tiny model has 4 heads and 2 KV heads: heads-sharded attention over 3 devices cannot split them.
    args = ["roofline", "--hardware", "h200", "--model", str(model), "--attention", "heads", "--layout", "1x3", "foo"]
    assert main(args) == 1
    captured = capsys.readouterr()
    assert "1x3: unusable" in captured.out and "no usable layout among 1x3, foo" in captured.err
    assert main(["roofline", "--hardware", "h200", "--model", str(model), "--context", "100000"]) == 0
    assert "past the model's" in capsys.readouterr().err


# ---- several hosts ------------------------------------------------------------------------------
def _steps(hw: Hardware, par: Parallelism, wl: Workload) -> tuple[rl.StepCost, rl.StepCost]:
    return rl.decode_step(SMOLLM2, hw, par, wl), rl.prefill_step(SMOLLM2, hw, par, wl)


@pytest.mark.parametrize(("dp", "tp", "attention"), [(1, 8, "replicated"), (2, 4, "replicated"), (1, 3, "heads")])
def test_one_host_reproduces_the_ring_exactly(dp: int, tp: int, attention: str) -> None:
    hw = rl.load_hardware("h200")
    par, wl = Parallelism(dp=dp, tp=tp, attention=attention), Workload(batch=64, prompt_len=300, hop_latency_s=1e-6)
    one = _steps(hw, par, wl)
    for per_host in (par.num_devices, 2 * par.num_devices, 1000):
        assert _steps(dataclasses.replace(hw, devices_per_host=per_host), par, wl) == one
    for step, rows in zip(one, (64, 300), strict=True):
        count, nbytes = 30 * par.all_reduces_per_layer + 1, rows * 576 * 4
        # Bit for bit what the one-host ring gave before hosts existed.
        assert step.collective_s == count * ring_all_reduce_s(nbytes, tp, 450e9, 1e-6) == step.inside_host_s
        assert step.collective_bytes == count * 2 * (tp - 1) / tp * nbytes
        assert step.across_hosts_s == 0 and step.across_hosts_bytes == 0
    assert roofline(SMOLLM2, hw, par, wl).hosts == 1


def test_model_axis_across_two_hosts_by_hand() -> None:
    hw = dataclasses.replace(rl.load_hardware("h200"), devices_per_host=8)
    assert (hw.interconnect_bytes_per_s, hw.inter_host_bytes_per_s, hw.inter_host_latency_s) == (450e9, 50e9, 5e-6)
    par, wl = Parallelism(tp=16, attention="replicated"), Workload(batch=64, hop_latency_s=1e-6)
    assert rl.host_split(par, 8) == rl.HostSplit(per_host=8, group_hosts=2, data_groups=1, hosts=2)
    d = rl.decode_step(SMOLLM2, hw, par, wl)
    # 31 all-reduces of 64 x 576 x 4 = 147,456 B, two-level over k = 8 devices on each of h = 2 hosts:
    # reduce-scatter + all-gather inside a host 2(k-1)/k * B / 450 GB/s + 2(k-1) * 1 µs; the 1/k shard
    # all-reduced across hosts 2(h-1)/h * (B/k) / 50 GB/s + 2(h-1) * 5 µs.
    inside = 31 * (2 * 7 / 8 * 147456 / 450e9 + 14 * 1e-6)
    across = 31 * (2 * 1 / 2 * (147456 / 8) / 50e9 + 2 * 5e-6)
    assert d.inside_host_s == pytest.approx(inside, rel=1e-12)
    assert d.across_hosts_s == pytest.approx(across, rel=1e-12)
    assert d.collective_s == pytest.approx(inside + across, rel=1e-12)
    # The bytes each device sends add up to the flat ring's 2(n-1)/n; 1/k of the reduced data crosses.
    assert d.collective_bytes == pytest.approx(31 * 2 * 15 / 16 * 147456, rel=1e-12)
    assert d.across_hosts_bytes == pytest.approx(31 * 147456 / 8, rel=1e-12)
    r = roofline(SMOLLM2, hw, par, wl)
    assert r.tpot_s == pytest.approx(max(d.memory_s, d.compute_s) + inside + across, rel=1e-12)
    assert r.hosts == 2 and r.as_dict()["hosts"] == 2 and r.as_dict()["decode"]["across_hosts_s"] == d.across_hosts_s
    # Memory and compute do not care where the devices sit.
    flat = rl.decode_step(SMOLLM2, dataclasses.replace(hw, devices_per_host=None), par, wl)
    assert (d.memory_s, d.compute_s, d.num_collectives) == (flat.memory_s, flat.compute_s, flat.num_collectives)


def test_data_only_split_adds_only_the_gather() -> None:
    hw = rl.load_hardware("h200")
    wl = Workload(batch=32, hop_latency_s=1e-6)
    # Source of the packed row: pack_step's 2 + 2 * TOP_LOGPROBS float32 columns.
    top = re.search(
        r"^TOP_LOGPROBS = (\d+)",
        (Path(rl.__file__).parent.parent / "service" / "engine" / "output.py").read_text(),
        re.M,
    )
    assert top and rl.PACKED_ROW_BYTES == (2 + 2 * int(top.group(1))) * 4 == 168
    for par, groups in ((Parallelism(dp=16), 2), (Parallelism(dp=2, tp=8, attention="replicated"), 2),
                        (Parallelism(dp=4, tp=4, attention="replicated"), 2), (Parallelism(dp=24), 3)):  # fmt: skip
        one = rl.decode_step(SMOLLM2, hw, par, wl)
        two = rl.decode_step(SMOLLM2, dataclasses.replace(hw, devices_per_host=8), par, wl)
        assert rl.host_split(par, 8).data_groups == groups and rl.host_split(par, 8).group_hosts == 1
        # A ring all-gather of dp * B packed rows among the host groups: (g-1)/g * bytes / 50 GB/s + (g-1) * 5 µs.
        share = (groups - 1) / groups * par.dp * 32 * 168
        assert two.inside_host_s == one.collective_s  # the all-reduces stay inside a host, unchanged
        assert two.across_hosts_s == pytest.approx(share / 50e9 + (groups - 1) * 5e-6, rel=1e-12)
        assert two.across_hosts_bytes == pytest.approx(share, rel=1e-12)
        assert two.collective_bytes == pytest.approx(one.collective_bytes + share, rel=1e-12)
        assert (two.memory_s, two.compute_s, two.num_collectives) == (one.memory_s, one.compute_s, one.num_collectives)
    # Replicas that fit one host: nothing crosses.
    assert (
        rl.decode_step(SMOLLM2, dataclasses.replace(hw, devices_per_host=8), Parallelism(dp=8), wl).across_hosts_s == 0
    )


def test_layouts_that_do_not_tile_hosts_or_lack_a_link() -> None:
    with pytest.raises(rl.TopologyError, match="whole number of 3-device model groups"):
        rl.host_split(Parallelism(tp=3, attention="heads", dp=4), 8)
    with pytest.raises(rl.TopologyError, match="12 devices"):
        rl.host_split(Parallelism(tp=12), 8)
    cpu = dataclasses.replace(rl.load_hardware("cpu-peers-md"), devices_per_host=2)
    assert cpu.inter_host_bytes_per_s is None
    roofline(SMOLLM2, cpu, Parallelism(tp=2), Workload(dtype="float32"))  # one host: fine
    with pytest.raises(rl.TopologyError, match="no inter-host link"):
        roofline(SMOLLM2, cpu, Parallelism(dp=2, tp=2), Workload(dtype="float32"))
    with pytest.raises(HardwareError, match="devices_per_host"):
        dataclasses.replace(cpu, devices_per_host=0)
    for name in ("h100-sxm", "h200", "tpu-v5e", "tpu-v5p"):
        hw = rl.load_hardware(name)
        assert hw.inter_host_bytes_per_s and hw.inter_host_latency_s > 0 and hw.devices_per_host is None


def test_cli_prints_inside_and_across_host_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tiny_gguf import write_tiny_llama_gguf

    from benchmarks.cli import main

    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "r.json"
    args = ["roofline", "--model", str(model), "--hardware", "h200", "--layout", "1x8", "2x4", "3x1"]
    assert main([*args, "--hosts", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("layout"))
    assert header.index("t_comm") < header.index("hosts") < header.index("t_in") < header.index("t_across")
    assert "across hosts: 50 GB/s per device, 5.0 µs per hop" in text
    assert "3x1: unusable: 3 devices do not split evenly over 2 hosts" in text
    rows = json.loads(out.read_text())
    assert [(r["dp"], r["tp"], r["hosts"], r["devices_per_host"]) for r in rows] == [(1, 8, 2, 4), (2, 4, 2, 4)]
    assert all(r["decode"]["across_hosts_s"] > 0 for r in rows)
    # Without a host option the table is as before: no split columns.
    assert main(["roofline", "--model", str(model), "--hardware", "h200", "--layout", "1x8"]) == 0
    assert "t_across" not in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main([*args, "--hosts", "2", "--devices-per-host", "8"])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err
