#!/usr/bin/env bash
# Every row of docs/performance.md's per-CPU and weight-mode tables in one run, interleaved where
# the rows are compared: Jitney's weight modes, the earlier engine, and llama.cpp on the same file.
# Run it on a quiet machine (nothing else running), from the repository root:
#   BASELINE=<git worktree of 5444940> LLAMA_BIN=<dir with llama-batched-bench, llama-server> \
#     bench/forward_tables.sh OUT_DIR
# (`git worktree add /tmp/base 5444940`; ../shared/tools/build_llama_cpp.sh builds llama.cpp.)
# QUICK=1 runs only the rows compared with the peer and the earlier engine (the default mode's):
# without AMX the dense bf16 rows alone take tens of minutes.
set -u
OUT=${1:?usage: bench/forward_tables.sh OUT_DIR}
BASELINE=${BASELINE:?a git worktree of the earlier engine (5444940)}
LLAMA_BIN=${LLAMA_BIN:?the directory holding llama-batched-bench and llama-server}
PY=${PYTHON:-.venv/bin/python}
TRACES=${TRACES:-../shared/traces}
mkdir -p "$OUT"
GGUF=$($PY -c "from engine.models.model_loader import smollm2_gguf_path; print(smollm2_gguf_path())")
ONE="$OUT/one-user.json"
$PY -m bench.synthetic_trace --requests 1 --output-len 256 --vocab-size 49152 \
  --min-prompt-len 134 --max-prompt-len 134 --output "$ONE" > /dev/null
MIXED=$(realpath "$TRACES/mixed-64.json")
ROOT=$PWD

row() {  # name trace [flags...]: one `jitney bench offline` run, tokens/s and ms per step
  # (--speculative none: the forward against the peer's, a step one token; speculation's own
  # gain is docs/performance.md#speculative-decoding)
  local name=$1 trace=$2
  shift 2
  $PY -m jitney.cli bench offline --model smollm2-135m --policies continuous --baseline none \
    --threads 2 --speculative none --trace "$trace" --output "$OUT/$name.json" "$@" \
    > "$OUT/$name.log" 2>&1
  report "$name"
}
earlier() {  # name trace: the same on the earlier engine (same virtualenv)
  (cd "$BASELINE" && PYTHONPATH="$BASELINE" "$ROOT/$PY" -m jitney.cli bench offline \
    --model smollm2-135m --policies continuous --baseline none --threads 2 --trace "$2" \
    --output "$OUT/$1.json" > "$OUT/$1.log" 2>&1)
  report "$1"
}
report() {
  local tok step
  tok=$(grep -A2 'tok/s  mean' "$OUT/$1.log" | awk '/^jitney/ {print $2}')
  # the "step" column by its header (the earlier engine's table has no "propose" column)
  step=$(grep -A2 'ms per step' "$OUT/$1.log" |
    awk '/ms per step/ {for (i = 1; i <= NF; i++) if ($i == "step") col = i - 2}
         /^jitney/ {print $col}')
  echo "$1: $tok tokens/s, $step ms per step"
}
llama_one() {  # llama.cpp, one user: generation time / 256 tokens
  "$LLAMA_BIN/llama-batched-bench" -m "$GGUF" -c 8192 -npp 134 -ntg 256 -npl 1 -t 2 2>&1 |
    awk -F'|' '/^\|  *134/ {printf "llama.cpp: %.2f ms per token (%s generated tokens/s)\n", 1000 * $8 / 256, $9}'
}

echo "== one user (134-token prompt, 256 tokens), three interleaved rounds"
for round in 1 2 3; do row "one-gguf-$round" "$ONE"; llama_one; done
if [ -z "${QUICK:-}" ]; then
  row one-int8 "$ONE" --quantization int8
  row one-none "$ONE" --quantization none
  row one-bf16 "$ONE" --quantization none --dtype bfloat16
  row one-transformers "$ONE" --model-impl transformers
fi
earlier one-earlier "$ONE"
echo "== mixed-64.json (64 requests at t=0)"
row mixed-gguf-1 "$MIXED"; earlier mixed-earlier "$MIXED"; row mixed-gguf-2 "$MIXED"
if [ -z "${QUICK:-}" ]; then
  row mixed-int8 "$MIXED" --quantization int8
  row mixed-none "$MIXED" --quantization none
  row mixed-bf16 "$MIXED" --quantization none --dtype bfloat16
fi
echo "== llama.cpp's server, --parallel 64, through jitney bench serve"
"$LLAMA_BIN/llama-server" -m "$GGUF" -c 51200 --parallel 64 -t 2 --port 8091 > "$OUT/llama-server.log" 2>&1 &
server=$!
for _ in $(seq 120); do curl -sf localhost:8091/health > /dev/null && break; sleep 1; done
$PY -m jitney.cli bench serve --url http://127.0.0.1:8091 --trace "$MIXED" --rate inf \
  --label llama-server --output "$OUT/mixed-llama.json" --plot '' > "$OUT/mixed-llama.log" 2>&1
echo "llama-server: $(grep 'output throughput' "$OUT/mixed-llama.log")"
kill "$server"; wait "$server" 2> /dev/null
