#!/bin/sh
# The GPU bring-up check (bench/gpu_check.py): correctness, the 8B decode step, a mixed trace.
#   bench/gpu_check.sh OUT_DIR                 on a CUDA machine (sized for 8 minutes; never run on one)
#   bench/gpu_check.sh OUT_DIR --device cpu    small shapes, on any machine (make test runs it)
# Runs from a plain copy of the repository: only torch, transformers, tokenizers and numpy are
# needed, no Redis, no SmolLM2, no install. PYTHON picks the interpreter (default python3).
set -eu
if [ $# -lt 1 ]; then
    echo "usage: $0 OUT_DIR [--device cpu|cuda|cuda:N] [--sections correctness,decode,mixed]" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
out=$1
shift
mkdir -p "$out"
PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} exec "${PYTHON:-python3}" -m bench.gpu_check "$out" "$@"
