#!/usr/bin/env bash
# The checks that need a GPU, as one prepared run for a lent machine (at most 10 minutes; each step under its own
# timeout, and no step started past the deadline). On the lent image as it is (Python 3.12, jax 0.11.2 with CUDA
# 13, flax, optax: benchmarks/device_image/packages.txt) plus the wheels carried in .whl/ (benchmarks/gpu_wheels.sh):
#
#   0. preflight: jax and the device, the kernel module imported there, the fused kernel's three Triton calls;
#   1. parity: the fused kernel against the dense one at the production tiles, 2,048 and 1,000 tokens with
#      DeBERTa-v3's table and 2,048 with the table grown to the length (tile-local terms), float32 and bfloat16,
#      every gradient, the dropped entries (benchmarks/gpu_check.py);
#   2. one DeBERTa-base attention layer, 2 x 8,192, bfloat16: forward and forward+backward timed, the device's
#      peak memory, at the default launch and other settings, with the grown table too, beside cuDNN's BERT attention
#      (benchmarks/gpu_attention.py, a process per program so that each peak is its own);
#   3. a profile of that layer: the fused kernels' time against XLA's products and table gradients;
#   4. DeBERTa-base's and BERT-base's train steps at 2,048 x 8 with DeBERTa-v3's table: tokens/s and MFU against
#      the datasheet's peak (benchmarks/train_step.py).
# Every step prints JSON lines, also appended to $OUT/gpu_check.jsonl when $OUT is set (the device tool's output
# folder), with one {"step": ..., "rc": ...} line per step; the exit status says whether every step passed.
#
#   bash benchmarks/gpu_wheels.sh                 # here: the carried wheels into .whl/
#   device tool: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600)
#   bash benchmarks/gpu_check.sh --rehearse       # here and in CI: every step on this CPU at small shapes, importing
#                                                 # only what the image holds (under 5 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
REHEARSE=()
[ "${1:-}" = --rehearse ] && REHEARSE=(--rehearse)
PY=${PYTHON:-python3}
[ -n "${REHEARSE[*]}" ] && [ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
DEADLINE=${DEADLINE:-570}  # seconds from the start; the device tool stops a command at 600
# Each step's limit is sized for the GPU; a rehearsal on a CPU that other jobs share may take several times its
# idle time, which says nothing about the GPU run, so there the limits are tripled (the deadline stays).
SLOWER=1
[ -n "${REHEARSE[*]}" ] && SLOWER=3
LOG=${OUT:+$OUT/gpu_check.jsonl}
LOG=${LOG:-/dev/null}
START=$SECONDS
export PYTHONUNBUFFERED=1

site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install --quiet --no-index --no-deps --target "$site" .whl/*.whl || exit 1
fi
export PYTHONPATH="$(pwd):$site${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${REHEARSE[*]}" ]; then
  # Only what the lent image holds, and the CPU: a missing import or a renamed API fails here.
  export PYTHONPATH="$(pwd)/benchmarks/device_image:$PYTHONPATH" DEBERTA_IMAGE_GUARD=1 JAX_PLATFORMS=cpu
fi

status=0
step() {  # step NAME SECONDS COMMAND...: run under min(SECONDS, time left), its JSON lines to stdout and $LOG
  local name=$1 limit=$(($2 * SLOWER)) left=$((DEADLINE - (SECONDS - START))) began=$SECONDS rc
  shift 2
  if [ "$left" -lt 20 ]; then
    echo "{\"step\": \"$name\", \"rc\": null, \"skipped\": \"the deadline\"}" | tee -a "$LOG"; status=1; return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  timeout --kill-after=10 "$limit" "$@" 2> >(grep -v "plugin configuration error" >&2) | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  [ "$rc" -ne 0 ] && status=1
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - began)), \"timed_out\": $([ "$rc" -eq 124 ] \
    && echo true || echo false)}" | tee -a "$LOG"
}

step preflight 120 "$PY" benchmarks/gpu_check.py preflight "${REHEARSE[@]}"
step parity 180 "$PY" benchmarks/gpu_check.py parity "${REHEARSE[@]}"
step "layer default" 60 "$PY" benchmarks/gpu_attention.py --only deberta-pallas "${REHEARSE[@]}"
step "layer grown table" 60 "$PY" benchmarks/gpu_attention.py --only deberta-pallas --tables grown "${REHEARSE[@]}"
for tuning in "backward_tile=64" "forward=8x2,key_pass=8x2,query_pass=8x2"; do
  step "layer $tuning" 60 "$PY" benchmarks/gpu_attention.py --only deberta-pallas --tuning "$tuning" "${REHEARSE[@]}"
done
for program in bert-cudnn bert-pallas; do
  step "layer $program" 45 "$PY" benchmarks/gpu_attention.py --only "$program" "${REHEARSE[@]}"
done
step profile 60 "$PY" benchmarks/gpu_check.py profile "${REHEARSE[@]}"
if [ -n "${REHEARSE[*]}" ]; then
  shape=(--size micro --seq 64 --batch 2 --warmup 1 --steps 1) bert_kernels=dense,pallas  # no cuDNN on a CPU
else
  shape=(--size base --seq 2048 --batch 8 --dtype bfloat16 --warmup 2 --steps 5) bert_kernels=cudnn,pallas
fi
step "train deberta" 120 "$PY" benchmarks/train_step.py --model deberta "${shape[@]}" --dropout 0.1 \
  --relative-table published --kernel pallas,dense
step "train bert" 90 "$PY" benchmarks/train_step.py --model bert "${shape[@]}" --dropout 0.1 --kernel "$bert_kernels"
passed=$([ $status -eq 0 ] && echo true || echo false)
echo "{\"step\": \"all\", \"passed\": $passed, \"seconds\": $((SECONDS - START))}" | tee -a "$LOG"
exit $status
