#!/usr/bin/env bash
# The README's "Running on TPU and GPU" table: BERT and DeBERTa at base and large compiled for v5e-16 and v5p-8
# (python -m deberta_jax.aot), each command's markdown rows appended to $OUT/table.md and its figures written to
# $OUT/<name>.json. Needs libtpu (pip install "jax[tpu]==<the installed jax>"); nothing runs on a TPU.
#
#   bash benchmarks/aot_table.sh [OUT]          # OUT defaults to results/aot; about an hour of one CPU core
#
# Lanes: the v5e and v5p commands run side by side (one core each).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/aot}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
export JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1

aot() {  # aot NAME TOPOLOGY FSDP CONFIG ARGS...
  local name=$1 topology=$2 fsdp=$3 config=$4
  shift 4
  "$PY" -m deberta_jax.aot --config "$config" --topology "$topology" --config.model.dtype=bfloat16 \
    --config.mesh.fsdp="$fsdp" --format markdown --out "$OUT/$name.json" "$@" 2>"$OUT/$name.log" > "$OUT/$name.md" \
    && { echo "$name done"; rm "$OUT/$name.log"; } || echo "$name FAILED: see $OUT/$name.log"
}

lane() {  # lane SLICE TOPOLOGY FSDP: every model at both lengths
  local slice=$1 topology=$2 fsdp=$3
  for size in base large; do
    for family in bert deberta; do
      aot "$slice-$family-$size-512" "$topology" "$fsdp" "configs/$family.py:$size" --programs=train,length
      aot "$slice-$family-$size-2048" "$topology" "$fsdp" "configs/$family.py:$size" --programs=train \
        --config.data.seq_len=2048 --config.model.max_position_embeddings=2048 --config.train.batch_size=64
    done
  done
}

lane v5e v5e:4x4 16 &
lane v5p v5p:2x2x2 1 &
wait
# What the knobs do for DeBERTa-base at 2,048 tokens, which does not fit v5e without them (remat runs as a scan).
knob() {  # knob NAME OVERRIDE
  aot "v5e-deberta-base-2048-$1" v5e:4x4 16 configs/deberta.py:base --programs=train \
    --config.data.seq_len=2048 --config.model.max_position_embeddings=2048 --config.train.batch_size=64 "$2"
}
(knob remat-dots_no_batch --config.model.remat=dots_no_batch; knob accum2 --config.train.grad_accum_steps=2) &
(knob remat-full --config.model.remat=full; knob blockwise --config.model.attention_kernel=blockwise) &
wait
aot v5e-deberta-base-512-scan v5e:4x4 16 configs/deberta.py:base --programs=train \
  --config.model.scan_layers=True
aot v5e-deberta-base-512-2-slices v5e:4x4 16 configs/deberta.py:base --programs=train --num_slices 2
{ "$PY" -c "from deberta_jax.aot.text import MARKDOWN_HEADER; print(MARKDOWN_HEADER)"; cat "$OUT"/*-*.md; } \
  > "$OUT/table.md"
rm "$OUT"/*-*.md  # the rows are in table.md, the figures in the JSON files
