#!/usr/bin/env bash
# The GPU checks, prepared as one command for a session that is lent a CUDA machine (about 15 minutes of device
# time in all): run it from the repository root there, with $OUT set to the folder whose files come back.
#
#     bash benchmarks/gpu_session.sh            # tests, then the bench rows, then FP8 (each step runs even if one before failed)
#
# What it writes under $OUT (each command's output, last line JSON where the command prints JSON):
#   gpu_tests.log      the gpu-marked tests: graphed decode and verification, the compiled prefill buckets
#                      through the pipeline, losslessness on CUDA, FP8 GEMMs
#   bench_2b.json      `litevlm bench --shape 2b --cuda-graphs` (random weights at the 2B shapes, latency only)
#   bench_2b_eager.json  the same rows without the graphs and compiled prefill, for the ratio side by side
#   fp8_gpu.json       benchmarks/fp8_gpu.py at the paper's 2B shapes (FP8 against bf16, eager and compiled)
# The package installs without its dependencies: the machine's image brings its own torch and transformers.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')" || exit 1
timeout 240 python -m pytest -q -m gpu tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
timeout 150 litevlm bench --shape 2b --n 20 --cuda-graphs --json > "$OUT/bench_2b.json" 2> "$OUT/bench_2b.err"
tail -c 600 "$OUT/bench_2b.json"
timeout 120 litevlm bench --shape 2b --n 20 --json > "$OUT/bench_2b_eager.json" 2> "$OUT/bench_2b_eager.err"
tail -c 600 "$OUT/bench_2b_eager.json"
timeout 240 python benchmarks/fp8_gpu.py > "$OUT/fp8_gpu.json" 2> "$OUT/fp8_gpu.err"
tail -c 600 "$OUT/fp8_gpu.json"
