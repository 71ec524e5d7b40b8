#!/usr/bin/env bash
# DeBERTa-base with the fused TPU kernel as the study trains and scores it: attention dropout 0.1 (published; the
# kernel draws it inside its tiles), train steps at 512 x 256, 2,048 x 64 and 8,192 x 16 tokens x rows on v5e-16
# (mesh.fsdp=16) and v5p-8 (plain data parallelism, as results/aot), BERT-base's on v5e-16 with the same kernel for
# comparison, and the length study's forward at 8x the 512-token training length as trained and under each length
# method (log_length, window, window_global, interpolate_distances); DeBERTa's train steps past 512 tokens also with
# the published relative table (256 buckets, distances to 512) instead of one that grows with the length. Markdown
# rows in $OUT/table.md, records in $OUT/[bert-|v3-table-]<slice>-<tokens>-train.json and $OUT/<slice>-length.json.
# Needs libtpu; nothing runs on a TPU; about 50 minutes of one CPU core.
#
#   bash benchmarks/aot_fused_study.sh [OUT]          # OUT defaults to results/aot-fused/study
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/aot-fused/study}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
export JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1

aot() {  # aot NAME FAMILY TOPOLOGY FSDP ARGS...
  local name=$1 family=$2 topology=$3 fsdp=$4
  shift 4
  "$PY" -m deberta_jax.aot --config "configs/$family.py:base" --topology "$topology" --config.mesh.fsdp="$fsdp" \
    --config.model.dtype=bfloat16 --config.model.attention_kernel=pallas_tpu --config.model.attention_dropout=0.1 \
    --format markdown --out "$OUT/$name.json" "$@" 2>"$OUT/$name.log" > "$OUT/$name.md" \
    && { echo "$name done"; rm "$OUT/$name.log"; } || echo "$name FAILED: see $OUT/$name.log"
}

for slice in v5e:4x4:16 v5p:2x2x2:1; do
  topology=${slice%:*} fsdp=${slice##*:}
  tag=${topology/:/-}
  families="deberta"
  [ "$topology" = v5e:4x4 ] && families="deberta bert"
  for tokens_rows in 512:256 2048:64 8192:16; do
    tokens=${tokens_rows%%:*}
    train=(--programs=train --config.data.seq_len="$tokens" --config.model.max_position_embeddings="$tokens"
           --config.train.batch_size="${tokens_rows##*:}")
    for family in $families; do
      prefix=$([ "$family" = bert ] && echo "bert-" || true)
      aot "$prefix$tag-$tokens-train" "$family" "$topology" "$fsdp" "${train[@]}"
    done
    # The published relative table (256 buckets, distances to 512) at every length, as DeBERTa-v3 runs past 512.
    if [ "$tokens" != 512 ]; then
      aot "v3-table-$tag-$tokens-train" deberta "$topology" "$fsdp" "${train[@]}" \
        --config.model.position_buckets=256 --config.model.max_relative_positions=512
    fi
  done
  aot "$tag-length" deberta "$topology" "$fsdp" --programs=length --length_kernels=pallas_tpu \
    --length_methods=log_length,window,window_global,interpolate_distances
done
# Each compile's rows, not the previous table.md, make the new one.
rows=()
for f in "$OUT"/*.md; do [ "$(basename "$f")" = table.md ] || rows+=("$f"); done
{ "$PY" -c "from deberta_jax.aot.text import MARKDOWN_HEADER; print(MARKDOWN_HEADER)"; cat "${rows[@]}"; } \
  > "$OUT/table.md.tmp"
rm "${rows[@]}"
mv "$OUT/table.md.tmp" "$OUT/table.md"
