"""A trace of prompts whose answers quote them (summarise, rewrite, extract, edit code), in the
shared/traces format with SmolLM2's chat template: the workload prompt-lookup speculation is
for. Written to bench/traces/quoting.json:

    python -m research.quoting_trace --output bench/traces/quoting.json

The texts are written for this trace. Output lengths are exact (a bench ignores EOS), so runs
with and without speculation do the same work.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

CODE = """def parse_config(path):
    settings = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings


def merge_configs(base, override):
    merged = dict(base)
    for key, value in override.items():
        merged[key] = value
    return merged
"""

REPORT = (
    "The night shift at the Harbor Street depot reported three delays on Tuesday. Bus 14 left "
    "the depot eleven minutes late because its rear door sensor failed the morning check. Bus 22 "
    "was held for six minutes at Mill Road while a delivery truck blocked the stop. Bus 31 ran "
    "on time but skipped the Elm Avenue stop after a rider reported a broken step. The depot "
    "manager, Ana Ruiz, asked the maintenance team to replace the sensor on Bus 14 and to "
    "inspect the step on Bus 31 before Thursday."
)

CONTACTS = (
    "Contacts from the meeting: Priya Natarajan (priya.natarajan@example.org, logistics), "
    "Tomasz Wojcik (t.wojcik@example.org, finance), Grace Mbeki (grace.mbeki@example.org, "
    "operations), Luis Ortega (lortega@example.org, legal), Hannah Stein "
    "(hannah.stein@example.org, research)."
)

TASKS = [
    f"Add type hints to every function in this Python code and return the whole code:\n\n{CODE}",
    f"Rename the variable `settings` to `config` in this code and return all of it:\n\n{CODE}",
    f"Summarise this report in three sentences, keeping the bus numbers:\n\n{REPORT}",
    f"Rewrite this report in a formal tone, keeping every fact:\n\n{REPORT}",
    f"List every name and email address from this text as 'Name: email' lines:\n\n{CONTACTS}",
    f"Convert this text to a JSON list of objects with name, email and team:\n\n{CONTACTS}",
    f"Add a docstring to each function and return the complete code:\n\n{CODE}",
    f"Quote the sentence about Bus 31 from this report, then explain it:\n\n{REPORT}",
]


def quoting_trace(tokenizer: Any, output_len: int) -> dict[str, Any]:
    requests = []
    for i, task in enumerate(TASKS):
        messages = [{"role": "user", "content": task}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        requests.append(
            {
                "id": i,
                "arrival_s": 0.0,
                "prompt_len": len(ids),
                "output_len": output_len,
                "prompt_ids": ids,
                "prompt": prompt,
            }
        )
    meta = {
        "n": len(requests),
        "tokenizer": "SmolLM2-135M-Instruct",
        "kind": "quoting",
        "out_len_dist": f"fixed {output_len}",
    }
    return {"meta": meta, "requests": requests}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", default="bench/traces/quoting.json")
    p.add_argument("--output-len", type=int, default=192)
    args = p.parse_args(argv)
    from engine.models.model_loader import load_model

    tokenizer = load_model("smollm2-135m").tokenizer
    trace = quoting_trace(tokenizer, args.output_len)
    Path(args.output).write_text(json.dumps(trace) + "\n")
    print(f"wrote {len(trace['requests'])} requests to {args.output}")


if __name__ == "__main__":
    main()
