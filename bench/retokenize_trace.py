"""A trace's prompts in another model's tokens: the same requests, arrivals and output lengths.

`python -m bench.retokenize_trace --trace ../shared/traces/mixed-64.json --model FILE.gguf
--output gemma-mixed-64.json`

Each prompt's user text (the shared traces hold SmolLM2's chat format: the text between
`<|im_start|>user` and `<|im_end|>`) is rendered with the model's own chat template, or kept as
plain text for a base model without one, and tokenized by the model's tokenizer (read from the
GGUF file's metadata). `output_len` stays exact, so every system does the same decoding work.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from engine.models.gguf_model import open_gguf
from engine.models.model_loader import DEFAULT_CACHE_DIR

_USER_TURN = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)


def user_text(prompt: str) -> str:
    """The user's text of a ChatML prompt (the whole prompt where there is no user turn)."""
    turns = _USER_TURN.findall(prompt)
    return "\n".join(t.strip() for t in turns) if turns else prompt


def retokenize(trace: dict, tokenizer, name: str) -> dict:
    requests = []
    for r in trace["requests"]:
        text = user_text(r["prompt"])
        if tokenizer.chat_template:
            messages = [{"role": "user", "content": text}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
            prompt = tokenizer.decode(ids)
        else:
            ids = tokenizer(text)["input_ids"]
            prompt = text
        requests.append({**r, "prompt_len": len(ids), "prompt_ids": ids, "prompt": prompt})
    meta = {**trace.get("meta", {}), "tokenizer": name, "retokenized_from": trace["meta"]}
    return {"meta": meta, "requests": requests}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--model", type=Path, required=True, help="a GGUF file")
    p.add_argument("--output", type=Path, required=True)
    args = p.parse_args()
    opened = open_gguf(args.model, DEFAULT_CACHE_DIR, print, None)
    trace = json.loads(args.trace.read_text())
    out = retokenize(trace, opened.tokenizer, args.model.name)
    args.output.write_text(json.dumps(out))
    lens = [r["prompt_len"] for r in out["requests"]]
    print(f"{len(lens)} requests, prompts {min(lens)}-{max(lens)} tokens -> {args.output}")


if __name__ == "__main__":
    main()
