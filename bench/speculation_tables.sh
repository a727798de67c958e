#!/usr/bin/env bash
# The README's speculation table: three traces, each with speculation off (`--speculative none`)
# and on (the default), interleaved round by round in one session through `jitney bench offline`,
# so a machine whose speed drifts moves both alike. Run it on a quiet machine:
#   bench/speculation_tables.sh OUT_DIR [ROUNDS]
# - quoting: bench/traces/quoting.json, one request at a time (8 prompts whose answers quote them)
# - one user: a 134-token random prompt, 256 tokens (the forward section's one-user trace)
# - mixed-64: ../shared/traces/mixed-64.json, all 64 requests at t=0
# Prints a markdown table: tokens/s per run, the speed-up of the means, drafts kept, tokens a
# step (on), and the seconds the last 25% of the tokens took (off / on, means).
set -u
OUT=${1:?usage: bench/speculation_tables.sh OUT_DIR [ROUNDS]}
ROUNDS=${2:-2}
PY=${PYTHON:-.venv/bin/python}
TRACES=${TRACES:-../shared/traces}  # where mixed-64.json is
QUOTING=${QUOTING:-bench/traces/quoting.json}
ONE_USER_TOKENS=${ONE_USER_TOKENS:-256}
mkdir -p "$OUT"
ONE="$OUT/one-user-trace.json"
$PY -m bench.synthetic_trace --requests 1 --output-len "$ONE_USER_TOKENS" --vocab-size 49152 \
  --min-prompt-len 134 --max-prompt-len 134 --output "$ONE" > /dev/null

run() {  # name trace mode [flags...]: one run, its report kept as OUT/name-mode-round.json
  local name=$1 trace=$2 mode=$3 round=$4
  shift 4
  $PY -m jitney.cli bench offline --model smollm2-135m --policies continuous --baseline none \
    --threads 2 --speculative "$mode" --trace "$trace" --output "$OUT/$name-$mode-$round.json" \
    "$@" > /dev/null 2> "$OUT/$name-$mode-$round.log" ||
    { echo "bench offline failed: $name $mode (see $OUT/$name-$mode-$round.log)" >&2; exit 1; }
}

for round in $(seq 1 "$ROUNDS"); do
  for mode in none auto; do
    run quoting "$QUOTING" "$mode" "$round" --max-num-seqs 1
    run one-user "$ONE" "$mode" "$round" --max-num-seqs 1
    run mixed-64 "$TRACES/mixed-64.json" "$mode" "$round"
  done
done

$PY - "$OUT" "$ROUNDS" <<'EOF'
import json
import sys
from pathlib import Path

out, rounds = Path(sys.argv[1]), int(sys.argv[2])


def runs(name: str, mode: str) -> list[dict]:
    return [
        json.loads((out / f"{name}-{mode}-{r}.json").read_text())["results"][0]
        for r in range(1, rounds + 1)
    ]


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


print("| trace | off: tokens/s | on: tokens/s | speed-up | drafts kept | tokens a step | "
      "last 25% of tokens, s (off / on) |")
print("|---|---|---|---|---|---|---|")
for name, label in (("quoting", "quoting, one user"), ("one-user", "one user, random prompt"),
                    ("mixed-64", "mixed-64, all at t=0")):
    off, on = runs(name, "none"), runs(name, "auto")
    speed = [r["tokens_per_s"] for r in off], [r["tokens_per_s"] for r in on]
    kept = mean([r["extra"]["spec_acceptance"] or 0.0 for r in on])
    per_step = mean([r["output_tokens"] / r["extra"]["steps"] for r in on])
    if name != "mixed-64":  # one request at a time: each step is one sequence's
        step_cell = f"{per_step:.2f}"
    else:  # many sequences a step: tokens per step say nothing of speculation
        step_cell = "-"
    tail = mean([r["extra"]["tail_s"] for r in off]), mean([r["extra"]["tail_s"] for r in on])
    print(f"| {label} | {', '.join(f'{x:.1f}' for x in speed[0])} | "
          f"{', '.join(f'{x:.1f}' for x in speed[1])} | {mean(speed[1]) / mean(speed[0]):.2f}x | "
          f"{100 * kept:.0f}% | {step_cell} | {tail[0]:.2f} / {tail[1]:.2f} |")
EOF
