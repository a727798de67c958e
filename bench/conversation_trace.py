"""Multi-turn traces: conversations that resend their history every turn, some starting with one
of a few long system prompts they share, arriving interleaved (prefix-aware placement's
benchmark, `bench/traces/multi_turn.json`; `python -m bench.conversation_trace` writes it).

A conversation is an optional shared system prompt, then turns: the user's new tokens and the
reply's. Turn t's prompt is the system prompt, every earlier turn's user and reply tokens, then
turn t's user tokens: the history resent, as chat clients do. The reply is recorded, not the
model's own (as multi-turn benchmarks replay a dataset's conversations), so every run sends the
same prompts whatever the model says; the server generates exactly `len(reply)` tokens. A
prefix cache can only hold the earlier prompt: a reply's own tokens are computed anew either
way. Token ids are drawn in [3, 256), inside both the tiny model's vocabulary and SmolLM2's.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path

LOW, HIGH = 3, 256  # token ids drawn in [LOW, HIGH)
DEFAULT_PATH = Path(__file__).parent / "traces" / "multi_turn.json"


@dataclass(frozen=True, slots=True)
class Turn:
    user: list[int]
    reply: list[int]  # recorded: what the next turn's history holds; its length is max_tokens


@dataclass(frozen=True, slots=True)
class Conversation:
    id: str
    start_s: float  # its first turn's send time, from the start of the run
    system: int | None  # the index of its shared system prompt, if any
    turns: list[Turn]


@dataclass(frozen=True, slots=True)
class ConversationTrace:
    system_prompts: list[list[int]]
    conversations: list[Conversation]

    def prompt(self, conversation: Conversation, turn: int) -> list[int]:
        """What turn `turn` of `conversation` sends: its whole history, then the user's turn."""
        system = conversation.system
        prompt = [] if system is None else list(self.system_prompts[system])
        for earlier in conversation.turns[:turn]:
            prompt += earlier.user + earlier.reply
        return prompt + conversation.turns[turn].user

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def to_dict(self) -> dict:
        return {
            "system_prompts": self.system_prompts,
            "conversations": [asdict(c) for c in self.conversations],
        }

    @classmethod
    def from_dict(cls, d: dict) -> ConversationTrace:
        return cls(
            [list(map(int, s)) for s in d["system_prompts"]],
            [
                Conversation(
                    str(c["id"]),
                    float(c["start_s"]),
                    None if c["system"] is None else int(c["system"]),
                    [Turn(list(t["user"]), list(t["reply"])) for t in c["turns"]],
                )
                for c in d["conversations"]
            ],
        )


def load_conversations(path: str | Path, limit: int | None = None) -> ConversationTrace:
    """A trace file; `limit`: its first N conversations only."""
    trace = ConversationTrace.from_dict(json.loads(Path(path).read_text()))
    if limit is not None:
        trace = ConversationTrace(trace.system_prompts, trace.conversations[:limit])
    return trace


@dataclass(frozen=True, slots=True)
class TraceShape:
    conversations: int = 24
    turns: tuple[int, int] = (3, 6)  # per conversation, inclusive
    system_prompts: int = 3
    system_len: int = 320  # tokens of each shared system prompt
    with_system: float = 0.75  # share of conversations that start with one
    user_len: tuple[int, int] = (16, 64)
    reply_len: tuple[int, int] = (16, 48)
    spacing_s: float = 0.3  # mean gap between conversations' starts (exponential)


def generate(shape: TraceShape, seed: int = 0) -> ConversationTrace:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(LOW, HIGH) for _ in range(n)]

    systems = [tokens(shape.system_len) for _ in range(shape.system_prompts)]
    conversations, start = [], 0.0
    for i in range(shape.conversations):
        system = rng.randrange(shape.system_prompts) if rng.random() < shape.with_system else None
        turns = [
            Turn(tokens(rng.randint(*shape.user_len)), tokens(rng.randint(*shape.reply_len)))
            for _ in range(rng.randint(*shape.turns))
        ]
        conversations.append(Conversation(f"c{i}", round(start, 3), system, turns))
        start += rng.expovariate(1 / shape.spacing_s)
    return ConversationTrace(systems, conversations)


# The control: single turns with nothing shared (what placement costs when it cannot help).
CONTROL = TraceShape(
    conversations=200,
    turns=(1, 1),
    with_system=0.0,
    user_len=(64, 512),
    reply_len=(16, 64),
    spacing_s=0.05,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", default=str(DEFAULT_PATH))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--conversations", type=int, default=None, help="how many (a shape's own)")
    p.add_argument(
        "--control",
        action="store_true",
        help="single turns of random prompts sharing no prefix, 20 a second (not committed)",
    )
    args = p.parse_args()
    shape = CONTROL if args.control else TraceShape()
    if args.conversations is not None:
        shape = replace(shape, conversations=args.conversations)
    trace = generate(shape, args.seed)
    Path(args.output).write_text(json.dumps(trace.to_dict(), separators=(",", ":")) + "\n")
    prompts = [trace.prompt(c, t) for c in trace.conversations for t in range(len(c.turns))]
    print(
        f"wrote {args.output}: {len(trace.conversations)} conversations, {len(prompts)} turns, "
        f"{sum(map(len, prompts))} prompt tokens (longest {max(map(len, prompts))})"
    )


if __name__ == "__main__":
    main()
