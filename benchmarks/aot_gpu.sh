#!/usr/bin/env bash
# BERT-base and DeBERTa-base train steps compiled for NVIDIA GPUs on this CPU (python -m deberta_jax.aot; the CUDA
# plugin, jax[cuda12], and no GPU): bfloat16, attention dropout 0.1 (published; 0 for BERT's cuDNN anchor, which has
# none, its hidden dropout kept), at 512 x 32, 2,048 x 8 and
# 8,192 x 2 tokens x rows per GPU (16,384 tokens a GPU: a global batch of 32 / 8 / 2 on one H200, 256 / 64 / 16 on
# an 8-GPU H100 node with FSDP over its 8 GPUs), with each attention kernel of BERT_KERNELS / DEBERTA_KERNELS.
# Per row: $OUT/<family>-<target>-<tokens>-<kernel>.json (the figures, fit hints included) and .md (its markdown
# row); $OUT/table.md is rebuilt from every row in $OUT, so a subset run adds to it. XLA's GPU compiler gives no
# cost analysis: FLOPs are the model's, bytes unknown, the roofline compute and NVLink alone (docs/tpu.md).
# Each base-model compile takes minutes of one CPU core.
#
#   bash benchmarks/aot_gpu.sh [OUT]            # OUT defaults to results/aot-gpu; rows already there are kept
#   FAMILIES=bert TARGETS=h200:1 SHAPES=512:32 BERT_KERNELS=dense bash benchmarks/aot_gpu.sh   # one row
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/aot-gpu}
PY=${PYTHON:-.venv/bin/python}
FAMILIES=${FAMILIES:-bert deberta}
TARGETS=${TARGETS:-h200:1 h100:8}  # GPU:COUNT, FSDP over the COUNT GPUs
SHAPES=${SHAPES:-512:32 2048:8 8192:2}  # tokens:rows per GPU
BERT_KERNELS=${BERT_KERNELS:-dense blockwise cudnn pallas}
DEBERTA_KERNELS=${DEBERTA_KERNELS:-dense blockwise pallas}
# DeBERTa's relative table: "grown" is configs/deberta.py's (it follows the training length: 2 x seq_len / 2 rows
# for every distance), "published" DeBERTa-v3's (256 log buckets to 512, as the released checkpoints run at any
# length); past 512 tokens they differ, and the fused kernels' memory is linear in length only with the latter.
DEBERTA_TABLES=${DEBERTA_TABLES:-grown published}
mkdir -p "$OUT"

aot() {  # aot NAME FAMILY TOPOLOGY FSDP ARGS...; a row already in $OUT is kept (FORCE=1 compiles it again)
  local name=$1 family=$2 topology=$3 fsdp=$4
  shift 4
  if [ -z "${FORCE:-}" ] && [ -s "$OUT/$name.md" ]; then echo "$name kept"; return; fi
  "$PY" -m deberta_jax.aot --config "configs/$family.py:base" --topology "$topology" --config.mesh.fsdp="$fsdp" \
    --config.model.dtype=bfloat16 --programs=train --format markdown \
    --out "$OUT/$name.json" "$@" 2>"$OUT/$name.log" > "$OUT/$name.md" \
    && { echo "$name done"; rm "$OUT/$name.log"; } \
    || { echo "$name FAILED: see $OUT/$name.log"; rm -f "$OUT/$name.md"; }
}

for target in $TARGETS; do
  gpus=${target##*:}
  topology=$([ "$gpus" = 1 ] && echo "${target%%:*}" || echo "$target")
  for tokens_rows in $SHAPES; do
    tokens=${tokens_rows%%:*} rows=$((${tokens_rows##*:} * gpus))
    for family in $FAMILIES; do
      kernels=$([ "$family" = bert ] && echo "$BERT_KERNELS" || echo "$DEBERTA_KERNELS")
      tables=$([ "$family" = bert ] && echo grown || echo "$DEBERTA_TABLES")
      for table in $tables; do
        [ "$table" = published ] && [ "$tokens" -le 512 ] && continue  # the same table as the grown one
        table_flags=()
        [ "$table" = published ] && table_flags=(--config.model.position_buckets=256 \
          --config.model.max_relative_positions=512)
        for kernel in $kernels; do
          aot "$family-${target/:/x}-$tokens-$kernel$([ "$table" = published ] && echo -v3)" "$family" "$topology" \
            "$gpus" --config.data.seq_len="$tokens" --config.model.max_position_embeddings="$tokens" \
            --config.train.batch_size="$rows" --config.model.attention_kernel="$kernel" \
            --config.model.attention_dropout="$([ "$kernel" = cudnn ] && echo 0.0 || echo 0.1)" "${table_flags[@]}"
        done
      done
    done
  done
done
# Every row in $OUT (this run's and earlier ones'), not only this run's, makes the table.
rows=()
for f in "$OUT"/*-*.md; do rows+=("$f"); done  # the rows, not table.md or README.md
{ "$PY" -c "from deberta_jax.aot.text import GPU_MARKDOWN_HEADER; print(GPU_MARKDOWN_HEADER)"; cat "${rows[@]}"; } \
  > "$OUT/table.md.tmp"
mv "$OUT/table.md.tmp" "$OUT/table.md"
