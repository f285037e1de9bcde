#!/usr/bin/env bash
# The GPU checks as one command, for a session lent a CUDA machine (an H200 image with torch and transformers, none
# of the serve/eval extras, no network; about 15 minutes of device time in all). Run it from anywhere, with $OUT set
# to the folder whose files come back:
#
#     bash benchmarks/gpu_session.sh             # on the GPU: every step below, about 7 minutes
#     bash benchmarks/gpu_session.sh --dry-run   # the same steps on this CPU, small shapes: checks the script
#     GPU_SESSION_MINIMAL=1 bash benchmarks/gpu_session.sh --dry-run   # the least of each step (its test's)
#
# Each step runs under its own `timeout`, whose limit comes from PLAN below; the script sums the plan, each step's
# kill-after included, prints the sum and refuses to start past 420 s (7 minutes of a
# 15-minute device budget that also pays the machine's start and the copies). Each step writes its output under
# $WORK (GPU_SESSION_WORK, default $TMPDIR/litevlm_gpu_session) as it goes and runs even if one before it failed; after
# each step $OUT gets $WORK as one archive, gpu_session.tgz (every file below but the walkthrough's weights), and its
# summaries (steps, env, gpu_tests, step_costs, the two benches' .json, FAILED.txt): at most 8 files, what a device
# returns. A failed install falls back to the source tree
# (PYTHONPATH=src, `GPU_SESSION_BREAK_INSTALL=1` makes the dry run take that path); only no CUDA device stops the run
# (non-zero, with FAILED.txt saying why). The gpu-marked tests are stopped with SIGINT, so pytest still writes its
# XML. What it writes under $WORK:
#   steps.jsonl / steps.json   each step's exit status, seconds and whether it timed out (a line as each ends)
#   env.json                   torch, CUDA, cuDNN, device and capability, which optional packages import
#   gpu.txt                    nvidia-smi's name, memory and driver (GPU only)
#   gpu_tests.log / .xml / .json  the gpu-marked tests (pytest -m gpu): graphed decode and verification, the GPU
#                              fast path through the pipeline, losslessness on CUDA, FP8 GEMMs; .json counts them
#   step_costs.*               benchmarks/step_costs.py at the 2B shapes (random weights, bf16 and FP8): the memory
#                              bandwidth and the floor of a decode step, then the CUDA backend's decode, full-tree
#                              verification, draft chain, prefill and the modules' eager decode, the steps eager
#                              inside their graphs, then compiled inside while its budget lasts; its `goals` check
#                              decode <= 1.5x the floor, verification <= 1.3x a decode, FP8 decode <= bf16's
#                              (.jsonl: a line per variant as it is measured)
#   bench_2b_graphs.*          `litevlm bench --shape 2b` (random weights at the 2B shapes, bf16, latency only):
#                              baseline, EAGLE, LiteVLM and LiteVLM FP8 rows on the CUDA backend, the prefill eager
#                              .jsonl: each answer, then each row, as it is measured; .json: the result; .out/.err
#   bench_hd.*                 `litevlm bench --model drive-hd` (the trained embedded model: real acceptance) on a few
#                              synthetic frames, baseline and LiteVLM, every row on the CUDA backend: images to answer
#   walkthrough.*              benchmarks/your_model.sh on the device (bf16): every recipe, eval --litevlm, bench
#                              and FP8 quantize on a tiny user checkpoint, unscored (no pycocoevalcap on the image);
#                              walkthrough/ keeps its checkpoint and modules. The minimal dry run checks its syntax.
# A .json whose command failed or timed out holds {"complete": false, ...} with the reason; the .jsonl keeps what
# was measured before. The package installs without its dependencies: the image brings its own torch and transformers.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; elif [[ $# -gt 0 ]]; then echo "usage: $0 [--dry-run]" >&2; exit 2; fi
MINIMAL="${GPU_SESSION_MINIMAL:-0}"
OUT="${OUT:-/tmp/gpu_out}"
# Every step writes under WORK; `pack` brings it back to $OUT as one archive beside the summaries (see the top).
WORK="${GPU_SESSION_WORK:-${TMPDIR:-/tmp}/litevlm_gpu_session}"
PY="${PYTHON:-$(command -v python3 || echo python)}"
rm -rf "$WORK"
mkdir -p "$OUT" "$WORK"
rm -f "$OUT"/gpu_session.tgz "$OUT"/{steps,env,gpu_tests,step_costs,bench_2b_graphs,bench_hd}.json "$OUT"/FAILED.txt
export PYTHONUNBUFFERED=1
export LITEVLM_NATIVE=0 # the native CPU steps are never used on CUDA: no device time spent compiling them
# No inductor compile in the bench rows: each is one decoder layer's (the layers reuse it), but a row meets a dozen
# prefill buckets, layer ranges and KV widths, each its own compile and Triton builds, more than a step's budget. The
# CUDA backend's prefill runs eagerly (pinned to a fused kernel), and its decode, verification and draft steps are
# replayed graphs all the same; the bench JSON says so ("compiled"). step_costs compiles its steps itself, at one
# bucket each, within its own budget.
export LITEVLM_CUDA_COMPILE=0

ROWS="baseline,eagle,litevlm,litevlm fp8"
if [[ $DRY_RUN == 1 ]]; then
    # drive-tiny (the embedded model) on the CPU, a few questions and tokens: every step's code, none of its cost
    MODEL_ARGS=(--model drive-tiny --device cpu --no-score) # unscored like random weights: no pycocoevalcap
    BENCH_ARGS=(--n 2 --warmup 1 --max-new-tokens 8)
    STEP_COSTS_ARGS=(--dry-run-cpu --iters 2 --warmup 1 --no-compiled-draft --budget-s 35)
    HD_FRAMES=2 HD_ARGS=(--n 4 --warmup 1 --max-new-tokens 16)
    if [[ $MINIMAL == 1 ]]; then
        BENCH_ARGS=(--n 1 --warmup 0 --max-new-tokens 4)
        STEP_COSTS_ARGS=(--dry-run-cpu --iters 1 --warmup 0 --no-compiled)
        HD_FRAMES=1 HD_ARGS=(--n 1 --warmup 0 --max-new-tokens 4)
    fi
    HD_DEVICE_ARGS=(--backend cuda-twin)
else
    # 6 questions after 2 warm-up ones, 32 new tokens each (random weights never stop early): 32 answers a run. The
    # graphed run captures each row's decode and verification graphs at setup (seconds), its prefill eager.
    MODEL_ARGS=(--shape 2b)
    BENCH_ARGS=(--n 6 --warmup 2 --max-new-tokens 32)
    # every eager variant, then the compiled ones while 35 s last (a compile started before then runs to its end: the
    # step's limit leaves 40 s for it); the compiled draft chain (its whole chain's compile) left out
    STEP_COSTS_ARGS=(--budget-s 35 --no-compiled-draft)
    # drive-hd's answers end at its end of answer: its default token limit; fp32 (its answers are the CPU's)
    HD_FRAMES=4 HD_ARGS=(--n 24 --warmup 2)
    HD_DEVICE_ARGS=(--device cuda --backend cuda)
fi

FAILED_STEPS=()

# The plan: each step's limit in seconds. A step past its limit gets SIGTERM (the tests SIGINT), then SIGKILL
# KILL_AFTER seconds later.
# env: the first CUDA start and torch import on a cold machine; walkthrough: 52-90 s on this CPU in a dry run (nine
# processes, each importing torch: about 5 s apiece here);
# step_costs: its own 35 s budget, and 40 s more for a compile started just before it ends.
declare -A PLAN=([install]=20 [env]=30 [gpu_tests]=70 [step_costs]=75 [bench_2b_graphs]=60 [bench_hd]=35 [walkthrough]=95)
KILL_AFTER=5
PLANNED_S=0
for name in "${!PLAN[@]}"; do PLANNED_S=$((PLANNED_S + PLAN[$name] + KILL_AFTER)); done
echo "planned: ${#PLAN[@]} steps, ${PLANNED_S} s at most (limits and kill-afters)" >&2
printf '{"planned_s": %d, "limit_s": 420, "steps": %d}\n' "$PLANNED_S" "${#PLAN[@]}" > "$WORK/plan.json"
if ((PLANNED_S > 420)); then
    echo "the plan takes ${PLANNED_S} s, over the 420 s a session can give it" | tee "$OUT/FAILED.txt" >&2
    exit 1
fi

# step NAME CMD...: run CMD under `timeout` (PLAN[NAME] seconds; STEP_SIGNAL, default TERM, then KILL), its stdout in
# $WORK/NAME.out and stderr in $WORK/NAME.err as it goes, then one line of steps.jsonl; then `pack`.
step() {
    local name=$1
    local limit=${PLAN[$name]}
    shift 1
    echo "== $name (timeout ${limit}s): $*" >&2
    local t0=$SECONDS
    timeout -s "${STEP_SIGNAL:-TERM}" --kill-after=$KILL_AFTER "$limit" "$@" > "$WORK/$name.out" 2> "$WORK/$name.err"
    local rc=$?
    local timed_out=false
    [[ $rc == 124 || $rc == 137 || ($rc == 2 && $((SECONDS - t0)) -ge $limit) ]] && timed_out=true  # pytest: 2 on SIGINT
    printf '{"step": "%s", "rc": %d, "seconds": %d, "timeout_s": %d, "timed_out": %s}\n' \
        "$name" "$rc" $((SECONDS - t0)) "$limit" "$timed_out" >> "$WORK/steps.jsonl"
    [[ $rc == 0 ]] || FAILED_STEPS+=("$name")
    echo "   rc $rc after $((SECONDS - t0)) s" >&2
    pack
    return $rc
}

# last_json NAME: $WORK/NAME.json = the last line of $WORK/NAME.out that is a JSON object, else a record of why not.
last_json() {
    "$PY" - "$WORK" "$1" <<'EOF'
import json, sys
from pathlib import Path
out, name = Path(sys.argv[1]), sys.argv[2]
steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
status = next((s for s in reversed(steps) if s["step"] == name), {})
found = None
for line in reversed((out / f"{name}.out").read_text(errors="replace").splitlines()):
    try:
        obj = json.loads(line)
    except ValueError:
        continue
    if isinstance(obj, dict):
        found = obj
        break
if found is None or status.get("rc") != 0:
    err = (out / f"{name}.err").read_text(errors="replace").strip().splitlines()
    found = {"complete": False, "step": name, **status, "stderr_tail": err[-15:], "last_json": found}
(out / f"{name}.json").write_text(json.dumps(found))
EOF
    pack
}

# finish: steps.json, every line of steps.jsonl as one JSON list.
finish() {
    "$PY" - "$WORK" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
lines = (out / "steps.jsonl").read_text().splitlines() if (out / "steps.jsonl").exists() else []
(out / "steps.json").write_text(json.dumps([json.loads(line) for line in lines], indent=1))
EOF
}

# pack: what comes back from the device is at most 8 files in $OUT, so WORK goes there as one archive,
# gpu_session.tgz (every file but the walkthrough's weights), beside the summaries a reader opens first (SUMMARIES, and
# FAILED.txt when there is one). Run after every step, so a session cut short still returns what it measured.
SUMMARIES=(steps.json env.json gpu_tests.json step_costs.json bench_2b_graphs.json bench_hd.json FAILED.txt)
pack() {
    finish
    tar czf "$WORK.tgz" --exclude='*.safetensors' -C "$WORK" . && mv -f "$WORK.tgz" "$OUT/gpu_session.tgz"
    local f
    for f in "${SUMMARIES[@]}"; do
        [[ -f "$WORK/$f" ]] && cp "$WORK/$f" "$OUT/$f"
    done
    return 0
}

fail() {
    echo "$1" | tee "$WORK/FAILED.txt" >&2
    pack
    exit 1
}

# 1. install (no dependencies, no isolated build: the image's own torch and setuptools); the dry run only resolves it
# where this tree's package already imports (a development venv), and installs it like the real run elsewhere. Where
# the install fails, every later step runs the package from the source tree (PYTHONPATH=src).
INSTALL=("$PY" -m pip install --no-build-isolation --no-deps -e .)
if [[ $DRY_RUN == 1 ]] && "$PY" -c 'import pathlib, sys, litevlm
sys.exit(not pathlib.Path(litevlm.__file__).resolve().is_relative_to(pathlib.Path("src").resolve()))' 2> /dev/null; then
    INSTALL=("$PY" -m pip install --dry-run --no-build-isolation --no-deps -e .)
fi
if [[ "${GPU_SESSION_BREAK_INSTALL:-0}" == 1 ]]; then
    INSTALL=(false) # the dry run's check of the source-tree path
fi
if ! step install "${INSTALL[@]}"; then
    echo "install failed (${INSTALL[*]}, see install.err): running from the source tree, PYTHONPATH=src" >&2
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
    FAILED_STEPS=() # the install is the first step: nothing else has failed
    echo "install failed; ran from the source tree (PYTHONPATH=src)" > "$WORK/install_fallback.txt"
fi

# GRAPH_FLAGS: how the 2B bench asks for the CUDA backend: `--backend cuda` on the GPU, its CPU twin `--backend
# cuda-twin` in the dry run. Set GRAPH_FLAGS in the environment to override.
DEFAULT_GRAPH_FLAGS=$([[ $DRY_RUN == 1 ]] && echo "--backend cuda-twin" || echo "--backend cuda")
GRAPH_FLAGS="${GRAPH_FLAGS-$DEFAULT_GRAPH_FLAGS}"

# 2. the machine
[[ $DRY_RUN == 1 ]] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$WORK/gpu.txt" 2>&1
step env "$PY" -c '
import importlib.util, json, sys
import torch
cuda = torch.cuda.is_available()
def has(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
import litevlm
print(json.dumps({
    "python": sys.version.split()[0],
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "cuda_available": cuda,
    "device": torch.cuda.get_device_name() if cuda else "cpu",
    "capability": list(torch.cuda.get_device_capability()) if cuda else None,
    "cudnn": torch.backends.cudnn.version() if cuda else None,
    "litevlm": litevlm.__file__,
    "graph_flags": sys.argv[1],
    "packages": {m: has(m) for m in ("transformers", "triton", "pycocoevalcap", "fastapi", "uvicorn", "ray")},
}))
' "$GRAPH_FLAGS"
last_json env
if [[ $DRY_RUN == 0 ]] && ! grep -q '"cuda_available": true' "$WORK/env.json"; then
    fail "no CUDA device visible to torch (env.json: $(head -c 400 "$WORK/env.json"))"
fi

# 3. the gpu-marked tests (on the CPU every one of them skips: the dry run checks that they are collected), file by
# file in this order (pytest keeps the order of files named one by one): the pipeline's fast path first, so that a run
# cut short has its answer, the compiles last; SIGINT at the limit, so pytest writes its XML
GPU_TEST_FILES=(tests/test_pipeline.py tests/test_fused_attention.py tests/test_fp8.py tests/test_backend.py)
STEP_SIGNAL=INT step gpu_tests "$PY" -m pytest -v -rfE --durations=0 -m gpu "${GPU_TEST_FILES[@]}" \
    -p no:cacheprovider --junitxml="$WORK/gpu_tests.xml"
mv "$WORK/gpu_tests.out" "$WORK/gpu_tests.log"
"$PY" - "$WORK" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1])
summary = {"complete": False}
if (out / "gpu_tests.xml").exists():
    cases = ET.parse(out / "gpu_tests.xml").getroot().iter("testcase")
    summary = {"complete": True, "passed": [], "failed": [], "skipped": []}
    for c in cases:
        name = f"{c.get('classname')}::{c.get('name')}"
        bad = c.find("failure") if c.find("failure") is not None else c.find("error")
        if bad is not None:
            summary["failed"].append({"test": name, "message": (bad.get("message") or "")[:600]})
        elif c.find("skipped") is not None:
            summary["skipped"].append({"test": name, "reason": (c.find("skipped").get("message") or "")[:200]})
        else:
            summary["passed"].append(name)
    summary["counts"] = {k: len(summary[k]) for k in ("passed", "failed", "skipped")}
(out / "gpu_tests.json").write_text(json.dumps(summary, indent=1))
EOF
pack

# 4. the CUDA backend's steps one at a time against the floor (a compile of its own, bounded by its budget)
step step_costs "$PY" benchmarks/step_costs.py "${STEP_COSTS_ARGS[@]}" --jsonl "$WORK/step_costs.jsonl"
last_json step_costs

# 5. the bench rows at the 2B shapes on the CUDA backend
# shellcheck disable=SC2086  # the flag variable is a word list
step bench_2b_graphs "$PY" -m litevlm bench "${MODEL_ARGS[@]}" --configs "$ROWS" "${BENCH_ARGS[@]}" \
    --no-transformers --json --jsonl "$WORK/bench_2b_graphs.jsonl" $GRAPH_FLAGS
last_json bench_2b_graphs

# 6. drive-hd from frames to answers, every row on the CUDA backend: a few synthetic frames made first (outside $WORK:
# images do not go back), then the baseline and LiteVLM, unscored (no pycocoevalcap on the image)
HD_DATA="${WORK}_hd_data"
rm -rf "$HD_DATA"
step bench_hd bash -c '"$1" -m litevlm data synth --out "$2" --frames "$3" --seed 1 > /dev/null && shift 3 && exec "$@"' \
    _ "$PY" "$HD_DATA" "$HD_FRAMES" "$PY" -m litevlm bench --model drive-hd --data "$HD_DATA" --configs baseline,litevlm \
    "${HD_ARGS[@]}" "${HD_DEVICE_ARGS[@]}" --no-transformers --no-score --json --jsonl "$WORK/bench_hd.jsonl"
rm -rf "$HD_DATA"
last_json bench_hd

# 7. the user's walkthrough on the device: every recipe on a tiny checkpoint, eval and bench unscored
WALK=(bash benchmarks/your_model.sh "$WORK/walkthrough")
[[ $MINIMAL == 1 ]] && WALK=(bash -n benchmarks/your_model.sh)
# unscored (no pycocoevalcap); the bench without transformers' rows (its static cache compiles on CUDA) and one question,
# and recipes of 3 s of training each
export WALKTHROUGH_EVAL_ARGS="--no-score" WALKTHROUGH_BENCH_ARGS="--no-transformers --n 1 --warmup 0" PYTHON="$PY"
export WALKTHROUGH_MINUTES=0.05
WALKTHROUGH_DEVICE_ARGS=$([[ $DRY_RUN == 1 ]] && echo "" || echo "--device cuda --dtype bfloat16")
export WALKTHROUGH_DEVICE_ARGS
step walkthrough "${WALK[@]}"

if [[ ${#FAILED_STEPS[@]} -gt 0 ]]; then
    echo "failed steps: ${FAILED_STEPS[*]}" | tee "$WORK/FAILED.txt" >&2
    pack
    exit 1
fi
pack
echo "all steps passed; files in $OUT (every file in gpu_session.tgz, also in $WORK)" >&2
