#!/usr/bin/env bash
# The checks that need a GPU, as one prepared run (under 10 minutes on one H100/H200):
#   1. the fused GPU kernel (attention_kernel=pallas), compiled by Triton on the GPU, against the dense kernel:
#      outputs and every gradient, float32 and bfloat16, padding, ragged tiles, dropout masks, window, bias;
#   2. one DeBERTa-base attention layer, bfloat16, 8,192 tokens x 2, forward + backward, against the published
#      Triton figure on an H200 (DisentangledFlash: 88.9 ms and 1.36 GiB; transformers' eager: 119.3 ms, 20.1 GiB);
#   3. DeBERTa-base's and BERT-base's train steps (bfloat16, dropout 0.1) in tokens/s and MFU at 512 and 2,048.
# Every step prints its figures even when another fails; the exit status says whether all passed.
#
# Needs jax with CUDA, flax, optax, ml_collections and pytest (the device image has jax; where the others are
# missing, carry their wheels: `pip download -d .whl flax optax ml_collections pytest` here, then there
# `pip install -q --no-index --find-links .whl flax optax ml_collections pytest`).
# Usage, from the repository root: bash benchmarks/gpu_check.sh [python]
set -uo pipefail
PY=${1:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$(pwd)"
status=0
$PY -c "import jax; print(jax.__version__, jax.devices())" || exit 1
# The suite's conftest picks the CPU unless told otherwise. Float32 products in full precision, as on the CPU,
# so the tests' tolerances apply: failures by about 1e-3 only would be Triton using TF32.
JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest $PY -m pytest -q -p no:cacheprovider \
    tests/kernels/test_fused_kernels.py -k "pallas- or pallas]" || status=1
$PY benchmarks/gpu_attention.py --lengths 8192 --rows 2 || status=1
for seq_batch in "512 32" "2048 8"; do
    set -- $seq_batch
    $PY benchmarks/train_step.py --mode train --model deberta --size base --seq "$1" --batch "$2" --dtype bfloat16 \
        --dropout 0.1 --kernel pallas,dense --warmup 2 --steps 5 || status=1
    $PY benchmarks/train_step.py --mode train --model bert --size base --seq "$1" --batch "$2" --dtype bfloat16 \
        --dropout 0.1 --kernel cudnn,pallas --warmup 2 --steps 5 || status=1
done
exit $status
