#!/usr/bin/env bash
# The README's speculation table: three traces, each with speculation off (`--speculative none`)
# and on (the default) in one process per trace (research/speculation_ab.py: the weights loaded
# once, the two engines taking steps in turn, each timed by its own steps, who goes first
# flipping every round), so a machine whose speed drifts moves both alike. Run it on a quiet
# machine:
#   research/speculation_tables.sh OUT_DIR [ROUNDS]
# AB_FLAGS adds flags to every run (AB_FLAGS="--speculative-history-tokens 0": prompt lookup over
# each sequence's own text only).
# - quoting: bench/traces/quoting.json, one request at a time (8 prompts whose answers quote them)
# - one user: a 134-token random prompt, 256 tokens (the forward section's one-user trace)
# - mixed-64: ../shared/traces/mixed-64.json, all 64 requests at t=0
# Prints a markdown table: tokens/s per run, the speed-up of the means (the rounds' own range),
# drafts kept, tokens a step (one request at a time), and the seconds the last 25% of the tokens
# took (off / on, means); then per trace where each mode's steps spent their time (prompts,
# plain decode steps, decode steps with drafts).
set -eu
OUT=${1:?usage: research/speculation_tables.sh OUT_DIR [ROUNDS]}
ROUNDS=${2:-3}
PY=${PYTHON:-.venv/bin/python}
TRACES=${TRACES:-../shared/traces}  # where mixed-64.json is
QUOTING=${QUOTING:-bench/traces/quoting.json}
ONE_USER_TOKENS=${ONE_USER_TOKENS:-256}
mkdir -p "$OUT"
ONE="$OUT/one-user-trace.json"
$PY -m bench.synthetic_trace --requests 1 --output-len "$ONE_USER_TOKENS" --vocab-size 49152 \
  --min-prompt-len 134 --max-prompt-len 134 --output "$ONE" > /dev/null

ab() {  # name label trace [flags...]: one trace's rounds, the report kept as OUT/name.json
  local name=$1 label=$2 trace=$3
  shift 3
  $PY -m research.speculation_ab --model smollm2-135m --threads 2 --rounds "$ROUNDS" \
    --trace "$trace" --label "$label" --output "$OUT/$name.json" ${AB_FLAGS:-} "$@" > "$OUT/$name.md" \
    2> "$OUT/$name.log" || { echo "research.speculation_ab failed: $name (see $OUT/$name.log)" >&2; exit 1; }
}

ab quoting "\`bench/traces/quoting.json\`, one request at a time" "$QUOTING" --max-num-seqs 1
ab one-user "one user, a 134-token random prompt, $ONE_USER_TOKENS tokens" "$ONE" --max-num-seqs 1
ab mixed-64 "\`mixed-64.json\`, all 64 at t=0" "$TRACES/mixed-64.json"
head -n 2 "$OUT/quoting.md"
for name in quoting one-user mixed-64; do sed -n 3p "$OUT/$name.md"; done
grep -h "same tokens" "$OUT"/*.md
for name in quoting one-user mixed-64; do echo "$name: $(grep -h 'seconds in prefill' "$OUT/$name.md")"; done
