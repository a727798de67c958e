"""How well a small learned draft head would propose where prompt lookup has nothing to propose.

`python -m research.draft_head_probe [--model smollm2-135m] [--prompts 270] [--epochs 6]`

A probe, not a proposer: it says whether training an EAGLE-style head is worth building into the
engine (its seam is scheduler/speculation/proposer.py), on this machine, with the data a CPU can
make. The head reads what a verification step already has for free: the final-norm hidden state
h of the row that picked token t, and t's embedding; it predicts the token after t (an MLP with a
residual on h, then the model's own LM head, frozen). It is trained on the model's greedy replies
to prompts built from Python's own standard library (its functions, the language reference's
prose in pydoc_data, and made-up contact lists) with editing, summarising and extracting
instructions, none of them the judged trace's texts; the hidden states come from the dense
model's forward over each prompt and reply. It is judged on the trace's greedy replies (EOS
ignored, as the benches run it):
- its accuracy over every position, and before each reply's first EOS;
- its accuracy at the steps where prompt lookup (`research.speculation_ceiling`'s replay: up to 7
  drafts, n-grams of 2-4) proposes nothing. Those steps decode one token, and a head draft there
  pays only while it is kept more often than a draft row costs (`bench offline`'s "a draft row
  priced at" line: 0.1 of a step on AMX, about 0.2 on AVX2 and Zen 4).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import io
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from research.speculation_ceiling import Lookup, replay

Pair = tuple[list[int], list[int]]  # a prompt's tokens and its greedy reply's

CODE_MODULES = (
    *("textwrap", "shlex", "string", "csv", "statistics", "fractions", "heapq", "bisect"),
    *("glob", "fnmatch", "posixpath", "difflib", "calendar", "colorsys", "base64", "gettext"),
    *("ipaddress", "pprint", "quopri", "tokenize", "shutil", "configparser", "argparse"),
    *("json.decoder", "urllib.parse", "email.utils", "html", "mimetypes"),
)
CODE_TASKS = (
    "Add type annotations to this function and give back the full function:",
    "Add a clear docstring to this function and return the whole function:",
    "Rewrite this function with more descriptive variable names and return it:",
    "Add a comment above each block of this code explaining it, and return the code:",
    "Explain what this function does, quoting the important lines:",
    "Find a possible bug in this function and show the corrected version:",
)
PROSE_TASKS = (
    "Summarise this passage in two sentences:",
    "Rewrite this paragraph in simpler words:",
    "Rewrite this text in a formal style, keeping every detail:",
    "Turn this text into short bullet points:",
    "Quote the most important sentence in this text and explain why it matters:",
    "List the technical terms used in this text, one per line:",
)
CONTACT_TASKS = (
    "Format these people as a Markdown table with name, email and team:",
    "Write these contacts as CSV lines: name,email,team:",
    "Give these people as a JSON array with name, email and team:",
    "List each person's email address, one per line:",
)
FIRST_NAMES = ("Alice", "Bohdan", "Chen", "Dmitri", "Esther", "Farid", "Gwen", "Hiro", "Ines")
LAST_NAMES = ("Okafor", "Lindqvist", "Moreau", "Tanaka", "Haddad", "Kowalski", "Silva", "Novak")
TEAMS = ("sales", "support", "platform", "design", "security", "data", "marketing")


def source_segment(lines: list[str], node: ast.AST) -> str:
    """`ast.get_source_segment(source, node)` from the source's lines split once (it splits the
    whole source on every call: 14 s for CODE_MODULES' functions, against 0.2 s)."""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset : node.end_col_offset].decode()
    head = lines[first].encode()[node.col_offset :].decode()
    tail = lines[last].encode()[: node.end_col_offset].decode()
    return "".join([head, *lines[first + 1 : last], tail])


def stdlib_functions() -> list[str]:
    """Functions of 6-22 lines from CODE_MODULES' source, in a fixed order."""
    found = []
    for name in CODE_MODULES:
        source = inspect.getsource(importlib.import_module(name))
        # Split as the ast module does: only at \r\n, \r and \n, each line keeping its end.
        lines = io.StringIO(source, newline="").readlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef):
                text = source_segment(lines, node)
                if 6 <= text.count("\n") <= 22 and len(text) < 900:
                    found.append(inspect.cleandoc("\n" + text) if text[0] == " " else text)
    return found


def reference_paragraphs() -> list[str]:
    from pydoc_data import topics

    paragraphs = (
        " ".join(p.split())
        for key in sorted(topics.topics)
        for p in topics.topics[key].split("\n\n")
    )
    return [p for p in paragraphs if 300 <= len(p) <= 800 and ">>>" not in p]


def contact_list(rng: random.Random) -> str:
    people = []
    for _ in range(rng.randint(3, 6)):
        first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
        people.append(
            f"{first} {last} ({first.lower()}.{last.lower()}@example.com, {rng.choice(TEAMS)})"
        )
    return "Attendees: " + ", ".join(people) + "."


def training_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` instructions: 40% code, 40% prose, 20% contact lists."""
    rng = random.Random(seed)
    functions, paragraphs = stdlib_functions(), reference_paragraphs()
    rng.shuffle(functions)
    rng.shuffle(paragraphs)
    code, prose = (2 * count) // 5, (2 * count) // 5
    prompts = [f"{rng.choice(CODE_TASKS)}\n\n{functions[i % len(functions)]}" for i in range(code)]
    prompts += [
        f"{rng.choice(PROSE_TASKS)}\n\n{paragraphs[i % len(paragraphs)]}" for i in range(prose)
    ]
    prompts += [
        f"{rng.choice(CONTACT_TASKS)}\n\n{contact_list(rng)}" for _ in range(count - code - prose)
    ]
    return prompts


@dataclass
class Features:
    hidden: torch.Tensor  # [N, d]: the row that picked `token`
    token: torch.Tensor  # [N]: t
    target: torch.Tensor  # [N]: the token after t
    where: list[tuple[int, int]]  # (pair, t's index in its reply)


def features(model: nn.Module, pairs: Sequence[Pair]) -> Features:
    """Every (h, t, next) of the replies: h at the row that picked reply token j (the prompt's
    last row for j = 0), t = reply[j], next = reply[j + 1]."""
    hidden, token, target, where = [], [], [], []
    with torch.inference_mode():
        for k, (prompt, reply) in enumerate(pairs):
            ids = prompt + reply
            h = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
            for j in range(len(reply) - 1):
                hidden.append(h[len(prompt) - 1 + j])
                token.append(reply[j])
                target.append(reply[j + 1])
                where.append((k, j))
    return Features(torch.stack(hidden), torch.tensor(token), torch.tensor(target), where)


class DraftHead(nn.Module):
    """h and t's embedding -> the hidden state whose LM-head argmax is the token after t."""

    def __init__(self, embed: torch.Tensor, lm_head: torch.Tensor, width: int = 1536):
        super().__init__()
        d = embed.shape[1]
        self.embed, self.lm_head = embed, lm_head  # the model's own, frozen
        self.up, self.down = nn.Linear(2 * d, width), nn.Linear(width, d)

    def forward(self, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        z = torch.cat([hidden, self.embed[token]], -1)
        return (hidden + self.down(F.silu(self.up(z)))) @ self.lm_head.T

    def accuracy(self, f: Features, rows: torch.Tensor | None = None) -> float:
        rows = torch.arange(len(f.target)) if rows is None else rows
        if len(rows) == 0:
            return float("nan")
        with torch.no_grad():
            picks = self(f.hidden[rows], f.token[rows]).argmax(-1)
        return (picks == f.target[rows]).float().mean().item()


def train(head: DraftHead, f: Features, epochs: int, seed: int = 0) -> tuple[float, float]:
    """AdamW on 90% of `f`; (the last batch's loss, accuracy on the held-out 10%)."""
    torch.manual_seed(seed)
    order = torch.randperm(len(f.target))
    cut = max(1, int(0.9 * len(order)))
    fit, held = order[:cut], order[cut:]
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    loss = torch.tensor(float("nan"))
    for _ in range(epochs):
        shuffled = fit[torch.randperm(len(fit))]
        for i in range(0, len(shuffled), 256):
            batch = shuffled[i : i + 256]
            loss = F.cross_entropy(head(f.hidden[batch], f.token[batch]), f.target[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return loss.item(), head.accuracy(f, held)


def lookup_less_rows(pairs: Sequence[Pair], f: Features, lookup: Lookup) -> torch.Tensor:
    """The rows of `f` whose target is the first token of a replayed step with no lookup draft
    (after the reply's first token: the head needs t)."""
    index = {w: i for i, w in enumerate(f.where)}
    rows = []
    for k, (prompt, reply) in enumerate(pairs):
        start = 0
        for at, _ in replay(prompt, reply, lookup.continuations):
            if start >= 1 and not lookup.continuations(list(prompt) + reply[:start]):
                rows.append(index[(k, start - 1)])  # t = reply[start - 1], next = reply[start]
            start = at
    return torch.tensor(rows, dtype=torch.long)


def greedy_replies(engine, prompts: list[list[int]], max_tokens: list[int], ignore_eos: bool):
    from generation.sampling_params import SamplingParams

    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=ignore_eos) for n in max_tokens
    ]
    return [
        (p, d.token_ids) for p, d in zip(prompts, engine.generate(prompts, params), strict=True)
    ]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--trace", default="bench/traces/quoting.json")
    p.add_argument("--prompts", type=int, default=270, help="training prompts")
    p.add_argument("--max-tokens", type=int, default=160, help="a training reply's most tokens")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--width", type=int, default=1536, help="the head's hidden width")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=None, help="also write the figures here (JSON)")
    args = p.parse_args(argv)
    from engine.config import EngineConfig
    from engine.llm_engine import Engine

    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=args.model))
    model, tokenizer = engine.loaded.model, engine.loaded.tokenizer
    started = time.perf_counter()

    def chat(text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return tokenizer.encode(rendered, add_special_tokens=False)

    prompts = [chat(t) for t in training_prompts(args.prompts)]
    train_pairs = greedy_replies(engine, prompts, [args.max_tokens] * len(prompts), False)
    requests = json.loads(Path(args.trace).read_text())["requests"]
    trace_pairs = greedy_replies(
        engine, [r["prompt_ids"] for r in requests], [r["output_len"] for r in requests], True
    )
    fit, judged = features(model, train_pairs), features(model, trace_pairs)
    embed = model.get_input_embeddings().weight.detach().float()
    lm_head = model.get_output_embeddings().weight.detach().float()
    head = DraftHead(embed, lm_head, args.width)
    loss, held_out = train(head, fit, args.epochs)
    eos = set(engine.eos_token_ids)
    cut = [next((i for i, t in enumerate(r) if t in eos), len(r)) for _, r in trace_pairs]
    before_eos = torch.tensor([i for i, (k, j) in enumerate(judged.where) if j + 1 < cut[k]])
    lookup_less = lookup_less_rows(trace_pairs, judged, Lookup())
    steps = sum(len(replay(p, r, Lookup().continuations)) for p, r in trace_pairs)
    result = {
        "training replies": len(train_pairs),
        "training tokens": len(fit.target),
        "final loss": round(loss, 3),
        "held-out accuracy": round(held_out, 3),
        "trace positions": len(judged.target),
        "trace accuracy": round(head.accuracy(judged), 3),
        "trace accuracy before EOS": round(head.accuracy(judged, before_eos), 3),
        "replayed steps": steps,
        "steps without a lookup draft": len(lookup_less),
        "accuracy there": round(head.accuracy(judged, lookup_less), 3),
        "seconds": round(time.perf_counter() - started, 1),
    }
    for key, value in result.items():
        print(f"{key:>30}: {value}")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
