#!/usr/bin/env bash
# docs/performance.md's per-file table: Jitney beside llama.cpp on the same GGUF files, one run.
# Run it on a quiet machine (nothing else running), from the repository root:
#   LLAMA_BIN=<dir with llama-batched-bench, llama-server> bench/file_tables.sh OUT_DIR FILE.gguf...
# Per file: one user (a 134-token prompt, then 256 tokens) in three rounds, Jitney's default
# (the file's own blocks, speculation off) interleaved with `llama-batched-bench`; with MIXED=1
# also `mixed-64.json` offline beside `llama-server --parallel 64` (a trace in the file's tokens:
# TRACE_<name>=path, else ../shared/traces/mixed-64.json, SmolLM2's); with PPL=1 perplexity of
# the default against the exact mode (`--quantization none`: the file's weights dequantized); and
# the resident weight bytes against the file's size. `python -m bench.gguf_files` makes the files.
set -u
OUT=${1:?usage: bench/file_tables.sh OUT_DIR FILE.gguf...}
shift
LLAMA_BIN=${LLAMA_BIN:?the directory holding llama-batched-bench and llama-server}
PY=${PYTHON:-.venv/bin/python}
TRACES=${TRACES:-../shared/traces}
THREADS=${THREADS:-2}
mkdir -p "$OUT"
ONE="$OUT/one-user.json"

jitney_one() {  # file name round: ms per decoded token of Jitney's default, one user
  $PY -m jitney.cli bench offline --model "$1" --policies continuous --baseline none \
    --threads "$THREADS" --speculative none --trace "$ONE" --output "$OUT/$2-one-$3.json" \
    > "$OUT/$2-one-$3.log" 2>&1
  $PY - "$OUT/$2-one-$3.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["results"][0]  # decoding after the first token, as llama.cpp's
ms = 1000 * (r["wall_s"] - r["mean_ttft_s"]) / (r["output_tokens"] - 1)
print(f"jitney: {ms:.2f} ms per token ({1000 / ms:.1f} tokens/s)")
PY
}
llama_one() {  # file: llama.cpp's generation time / 256 tokens
  "$LLAMA_BIN/llama-batched-bench" -m "$1" -c 8192 -npp 134 -ntg 256 -npl 1 -t "$THREADS" 2>&1 |
    awk -F'|' '/^\|  *134/ {printf "llama.cpp: %.2f ms per token (%s generated tokens/s)\n", 1000 * $8 / 256, $9}'
}
mixed() {  # file name trace: Jitney offline, then llama-server through jitney bench serve
  $PY -m jitney.cli bench offline --model "$1" --policies continuous --baseline none \
    --threads "$THREADS" --speculative none --trace "$3" --output "$OUT/$2-mixed.json" \
    > "$OUT/$2-mixed.log" 2>&1
  echo "jitney mixed: $(grep -A2 'tok/s  mean' "$OUT/$2-mixed.log" | awk '/^jitney/ {print $2}') tokens/s"
  "$LLAMA_BIN/llama-server" -m "$1" -c 51200 --parallel 64 -t "$THREADS" --port 8091 \
    > "$OUT/$2-llama-server.log" 2>&1 &
  local server=$!
  for _ in $(seq 120); do curl -sf localhost:8091/health > /dev/null && break; sleep 1; done
  $PY -m jitney.cli bench serve --url http://127.0.0.1:8091 --trace "$3" --rate inf \
    --label llama-server --output "$OUT/$2-mixed-llama.json" --plot '' > "$OUT/$2-mixed-llama.log" 2>&1
  echo "llama-server mixed: $(grep 'output throughput' "$OUT/$2-mixed-llama.log")"
  kill "$server"; wait "$server" 2> /dev/null
}

for file in "$@"; do
  name=$(basename "$file" .gguf)
  vocab=$($PY -c "from engine.models.gguf_index import read_gguf_index as r; \
t = {x.name: x for x in r('$file').tensors}['token_embd.weight']; print(t.dims[1])")
  $PY -m bench.synthetic_trace --requests 1 --output-len 256 --vocab-size "$vocab" \
    --min-prompt-len 134 --max-prompt-len 134 --output "$ONE" > /dev/null
  echo "== $name: one user (134-token prompt, 256 tokens), three interleaved rounds"
  for round in 1 2 3; do jitney_one "$file" "$name" "$round"; llama_one "$file"; done
  $PY -m bench.resident_weights "$file"
  if [ -n "${MIXED:-}" ]; then
    var="TRACE_${name//[^A-Za-z0-9]/_}"
    mixed "$file" "$name" "${!var:-$(realpath "$TRACES/mixed-64.json")}"
  fi
  if [ -n "${PPL:-}" ]; then
    $PY -m research.perplexity --model "$file" --modes fp32,gguf --tokens "${PPL_TOKENS:-4096}" \
      --threads "$THREADS" --output "$OUT/$name-ppl.json" > "$OUT/$name-ppl.log" 2>&1
    tail -n 4 "$OUT/$name-ppl.log"
  fi
done
