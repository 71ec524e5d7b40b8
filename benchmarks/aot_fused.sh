#!/usr/bin/env bash
# The fused TPU kernel in whole train steps: BERT and DeBERTa at base on v5e-16 at 512, 2,048 and 8,192 tokens,
# each with XLA's attention (the dense kernel; DeBERTa's terms by the relative shift) and with
# attention_kernel=pallas_tpu, plus the length study's forward at 8x. Every run at attention_dropout=0, BERT's and
# DeBERTa's alike (this table was made before the fused kernel drew attention dropout; the rows at the published 0.1
# are benchmarks/aot_fused_study.sh's), so the rows compare like with like. Markdown rows in $OUT/table.md, records
# in $OUT/<name>.json. Needs libtpu; nothing runs on a TPU.
#
#   bash benchmarks/aot_fused.sh [OUT]          # OUT defaults to results/aot-fused; about an hour of one CPU core
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/aot-fused}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
export JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1

aot() {  # aot NAME CONFIG ARGS...
  local name=$1 config=$2
  shift 2
  "$PY" -m deberta_jax.aot --config "$config" --topology v5e:4x4 --config.mesh.fsdp=16 \
    --config.model.dtype=bfloat16 --config.model.attention_dropout=0.0 --format markdown --out "$OUT/$name.json" \
    "$@" 2>"$OUT/$name.log" > "$OUT/$name.md" && { echo "$name done"; rm "$OUT/$name.log"; } \
    || echo "$name FAILED: see $OUT/$name.log"
}

for family in deberta bert; do
  for kernel in pallas_tpu dense; do
    aot "$family-512-$kernel" "configs/$family.py:base" --config.model.attention_kernel=$kernel --programs=train,length \
      --length_kernels=$kernel
    for tokens_rows in 2048:64 8192:16; do
      aot "$family-${tokens_rows%%:*}-$kernel" "configs/$family.py:base" --config.model.attention_kernel=$kernel \
        --programs=train --config.data.seq_len=${tokens_rows%%:*} \
        --config.model.max_position_embeddings=${tokens_rows%%:*} --config.train.batch_size=${tokens_rows##*:}
    done
  done
done
{ "$PY" -c "from deberta_jax.aot.text import MARKDOWN_HEADER; print(MARKDOWN_HEADER)"; cat "$OUT"/*-*.md; } \
  > "$OUT/table.md"
rm "$OUT"/*-*.md
