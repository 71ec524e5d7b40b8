#!/usr/bin/env bash
# The wheels the device check carries to the lent GPU image (benchmarks/device_image/carried.txt, at the versions in
# constraints.txt), pure Python only, into .whl/ (gitignored; the device tool carries it when named in `carry`):
#
#   bash benchmarks/gpu_wheels.sh
#   then, with the device tool: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600)
#
# gpu_check.sh installs them there (pip --no-index --no-deps --target, beside the image's own packages).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
rm -rf .whl && mkdir -p .whl
while read -r name; do
  case "$name" in ''|'#'*) continue ;; esac
  pin=$(grep -i -E "^${name//_/[-_]}==" constraints.txt || echo "$name")
  # The image runs Python 3.12: wheels for it, and only those that need no compiler (py3-none-any).
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --platform any -d .whl "$pin"
done < benchmarks/device_image/carried.txt
du -sh .whl && ls .whl
