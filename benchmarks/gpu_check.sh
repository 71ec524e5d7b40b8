#!/usr/bin/env bash
# The checks that need a GPU, as one prepared run (a few minutes on one GPU): the Pallas kernel
# compiled by Triton against the dense kernel, then its speed and memory against the blockwise kernel.
# Nothing here has run on a GPU yet (no session so far was lent one).
#
# Needs jax with CUDA, flax and optax (the device image has them) and, for the benchmark, the pure-Python
# ml_collections; where it is missing, carry its wheel and put it on PYTHONPATH first, e.g.
#   pip download --no-deps -d .whl ml_collections   (here), then there:
#   pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# Usage, from the repository root: bash benchmarks/gpu_check.sh [python]
set -uo pipefail
PY=${1:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$(pwd)"
# Float32 matmuls in full precision, as on CPU, so the tests' 1e-5 tolerances apply. If the Pallas
# tests fail by about 1e-3 only, Triton is using TF32 in the kernel's dots: rerun without this line to see.
export JAX_DEFAULT_MATMUL_PRECISION=highest
status=0
$PY -c "import jax; print(jax.__version__, jax.devices())" || exit 1
$PY -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py -k "pallas or kernel_equals_dense or other_kernels" || status=1
unset JAX_DEFAULT_MATMUL_PRECISION
$PY benchmarks/train_step.py --mode eval --model bert,deberta --seq 2048,8192 --batch 1 --trained-length 512 \
    --kernel dense,blockwise,pallas --warmup 2 --steps 5 || status=1
# Past what dense attention can hold (its [N, N] index alone is 4 GB at 32k): the linear-memory kernels.
$PY benchmarks/train_step.py --mode eval --model bert,deberta --seq 32768 --batch 1 --trained-length 512 \
    --kernel blockwise,pallas --warmup 1 --steps 3 || status=1
# Training: the fused forward needs attention_dropout=0, so every kernel runs without dropout here.
# The dense kernel's DeBERTa terms both ways: "auto" picks the relative shift on a GPU, never timed on one yet.
$PY benchmarks/train_step.py --mode train --model bert,deberta --seq 512 --batch 32 --kernel dense,blockwise,pallas \
    --relative-terms gather,shift --dropout 0 --steps 5 || status=1
exit $status
