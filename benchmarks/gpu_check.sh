#!/usr/bin/env bash
# The GPU check, in one short run: does the served engine (what `serve` runs) run
# unchanged on a GPU, which layer form is faster there, and what decode MBU does it reach?
#
#   benchmarks/gpu_check.sh OUT_DIR
#
# Runs from the repository root with the machine's own python3, jax (CUDA) and flax; the
# project's other dependencies must be importable (pip install -e . or PYTHONPATH).
#   1. `meshserve-bench sweep` with random bfloat16 weights at Llama 3 8B's shapes
#      (configs/models/llama-3-8b), one device, 128-token prompts, both layer forms
#      (`--layers scan unrolled`): at batch 1 with the prompt's prefill (TTFT's proxy), then
#      decode only at batch 8-128. TPOT (steps pipelined as the engine loop runs them), the
#      serial step and its dispatch call, MBU and MFU against the roofline preset that matches
#      the device (e.g. h200). Weights' values do not change the speed.
#   2. The same decode sweep with int8 weights (`--weights int8`: random Q8_0 blocks, a float16
#      scale per 32 weights, multiplied by XLA's dequantize-then-dot path), batch 1 and 8.
#   3. benchmarks/gpu_pick.py: the faster layer form at each batch (the choice the engine's
#      `layer_loop: auto`, model.kernels.choose, should make on this backend), and the batch-1
#      TPOT ratio int8 / bfloat16 (target <= 0.6).
#   4. The engine's tests that need neither the default model's download nor 8 CPU devices, on
#      the GPU: the ragged step against the other entry points and against itself alone, and
#      paged attention against its reference; float32 matmuls at "highest" precision
#      (JAX_DEFAULT_MATMUL_PRECISION), as the references compute them: the GPU's default uses
#      TF32 for float32 products.
# Each step has its own timeout; the logs, CSV, JSON and plots go to OUT_DIR.
set -uo pipefail
out=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
sweep_timeout=${SWEEP_TIMEOUT:-240}
test_timeout=${TEST_TIMEOUT:-90}
model=configs/models/llama-3-8b
common=(--random --model "$model" --dtype bfloat16 --layouts 1x1 --prompt-lens 128 --steps 16 --hardware auto
        --layers scan unrolled)

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv 2>&1 | tee "$out/gpu.txt"
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" 2>&1 | tee -a "$out/gpu.txt"

run_sweep() {  # name, timeout, sweep flags...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m benchmarks.cli sweep "${common[@]}" "$@" --out "$out/$name" 2>&1 | tee "$out/$name.log"
  return "${PIPESTATUS[0]}"
}
run_sweep b1 "$sweep_timeout" --batches 1
b1_rc=$?
run_sweep batches "$sweep_timeout" --batches 8 32 64 128 --no-prefill
batches_rc=$?
run_sweep int8 "$sweep_timeout" --weights int8 --batches 1 8 --no-prefill
int8_rc=$?
python3 benchmarks/gpu_pick.py "$out/b1/sweep.json" "$out/batches/sweep.json" --int8 "$out/int8/sweep.json" \
  2>&1 | tee "$out/pick.txt"

JAX_DEFAULT_MATMUL_PRECISION=highest timeout "$test_timeout" python3 -m pytest -q -p no:cacheprovider \
  tests/test_ragged_step.py tests/test_paged_attention.py 2>&1 | tee "$out/pytest.log"
test_rc=${PIPESTATUS[0]}

echo "gpu_check: sweep rc=$b1_rc/$batches_rc, int8 sweep rc=$int8_rc, tests rc=$test_rc" | tee -a "$out/gpu.txt"
[ "$b1_rc" -eq 0 ] && [ "$batches_rc" -eq 0 ] && [ "$int8_rc" -eq 0 ] && [ "$test_rc" -eq 0 ]
