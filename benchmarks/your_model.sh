#!/usr/bin/env bash
# The walkthrough "LiteVLM for your own InternVL", as a user types it, on a tiny checkpoint: from a transformers
# InternVL (-hf) folder with its own tokenizer and chat template and a DriveLM train-v1_1 JSON with images, train
# the ViewSelector, the TokenSelector, the EAGLE-2 draft head and its answer openings for that model, evaluate the
# LiteVLM configuration, measure Table 1 on it, calibrate FP8 on the same data and evaluate the FP8 checkpoint.
#
#     bash benchmarks/your_model.sh [WORKDIR]     # WORKDIR (default: a new temporary folder) keeps everything
#
# Budgets are the smallest that exercise each step (a fraction of a minute a recipe); with a real checkpoint drop
# them and pass --device cuda --dtype bfloat16. Every module is written beside the checkpoint's weights (its
# view_selector/, token_selector/, draft/ folders and prompt.json), where `Pipeline.from_pretrained` finds them.
# PYTHON (default: python) runs the package; LITEVLM (default: $PYTHON -m litevlm) is the command line.
# WALKTHROUGH_DEVICE_ARGS (default: none, the CPU) go to every step that runs the model, e.g. "--device cuda --dtype
# bfloat16"; WALKTHROUGH_EVAL_ARGS to both evaluations, e.g. "--no-score" on a machine without pycocoevalcap;
# WALKTHROUGH_BENCH_ARGS to the bench, e.g. "--no-transformers --n 1" where time is short, and WALKTHROUGH_MINUTES
# (default 0.2) is each recipe's training budget, its setup apart. On CUDA the prefill runs
# eagerly unless LITEVLM_CUDA_COMPILE=1: a tiny model's compiles would cost more than they save.
set -euo pipefail
export LITEVLM_CUDA_COMPILE="${LITEVLM_CUDA_COMPILE:-0}"
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
LITEVLM="${LITEVLM:-$PYTHON -m litevlm}"
read -r -a DEV <<< "${WALKTHROUGH_DEVICE_ARGS:-}"
read -r -a EV <<< "${WALKTHROUGH_EVAL_ARGS:-}"
read -r -a BENCH <<< "${WALKTHROUGH_BENCH_ARGS:-}"
MINUTES="${WALKTHROUGH_MINUTES:-0.2}" # each recipe's training budget
WORK="${1:-$(mktemp -d -t litevlm-walkthrough.XXXXXX)}"
mkdir -p "$WORK"
echo "walkthrough in $WORK" >&2

# 0. The user's checkpoint and data (here: tiny and random, written by a helper).
$PYTHON benchmarks/tiny_user_model.py --out "$WORK" >&2
CK="$WORK/InternVL-tiny-hf"
DATA="$WORK/drivelm/drivelm.json"

# 1. ViewSelector: labels from the questions' c-tags and the lexical map, recall calibrated on a held-out split.
$LITEVLM train views --model "$CK" --data "$DATA" --steps 40 --minutes "$MINUTES" >&2
# 2. TokenSelector: the target's own attention over the visual tokens, plus the c-tag prior.
$LITEVLM train tokens --model "$CK" --data "$DATA" --epochs 1 --minutes "$MINUTES" "${DEV[@]}" >&2
# 3. Draft head: self-distillation on the target's own greedy answers and hidden states.
$LITEVLM train draft --model "$CK" --data "$DATA" --minutes "$MINUTES" "${DEV[@]}" >&2
# 4. Answer openings, from the target's own answers to the training questions.
$LITEVLM train openings --model "$CK" --data "$DATA" "${DEV[@]}" >&2

# 5. The LiteVLM configuration on the data (view selection, token selection, speculative decoding), official score.
# This checkpoint's prompts hold fewer visual tokens than the preset leaves unpruned: --select-min-tokens 0 prunes them.
$LITEVLM eval --model "$CK" --data "$DATA" --litevlm --select-min-tokens 0 --n 8 --max-new-tokens 16 --json \
    "${DEV[@]}" "${EV[@]}" >&2
# 6. Table 1 on this model: every configuration on the same questions.
$LITEVLM bench --model "$CK" --data "$DATA" --n 2 --warmup 1 --max-new-tokens 16 "${DEV[@]}" "${EV[@]}" \
    "${BENCH[@]}" >&2

# 7. FP8 calibrated on the user's data into a new checkpoint (the modules travel with it), then evaluated.
$LITEVLM quantize --model "$CK" --data "$DATA" --calib 8 --max-new-tokens 16 --out "$CK-fp8" "${DEV[@]}" >&2
$LITEVLM eval --model "$CK-fp8" --data "$DATA" --litevlm --select-min-tokens 0 --n 8 --max-new-tokens 16 --json \
    "${DEV[@]}" "${EV[@]}"
