"""Client-side helpers for the whole-system tests: streaming over HTTP, the offline reference,
what the model's queues hold, placement's reads."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

import aiohttp
import redis
from transformers import PreTrainedTokenizerBase

from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.models.model_loader import LoadedModel, load_model
from engine.outputs import CompletedRequest
from generation import SamplingParams
from generation.detokenizer import IncrementalDetokenizer
from protocol import WORKER_GROUP, Keys
from tests.engine.engine_helpers import NEAR_TIE, near_ties, next_token_logprobs
from tests.services import Worker, wait_for

MODEL = "tiny-random"
KEYS = Keys()
PLACED = ("--prefix-placement",)  # gateway and workers (off by default)
OUTCOMES = ("own", "shared", "stolen")  # where an entry a worker read waited


def offline(prompts: list[list[int]], max_tokens: int) -> list[CompletedRequest]:
    engine = Engine(EngineConfig(model=MODEL, kv_cache_memory="16MiB"), loaded=load_model(MODEL))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return engine.generate(prompts, params)


async def stream_completion(
    session: aiohttp.ClientSession, base: str, body: dict, allow_error: bool = False
) -> tuple[str, dict]:
    """POST with stream=true; return the joined text and the usage chunk (or, with
    `allow_error`, the error chunk's body under "error")."""
    text, usage = "", {}
    async with session.post(
        f"{base}/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                assert allow_error, chunk
                return text, chunk
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
            if chunk.get("usage"):
                usage = chunk["usage"]
    return text, usage


async def complete(
    session: aiohttp.ClientSession, base: str, prompt: list[int], **extra: object
) -> dict:
    """A non-streaming greedy completion (6 tokens unless `extra` says otherwise)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, **extra}
    async with session.post(f"{base}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


def queue_streams(r: redis.Redis) -> list[str]:
    """Every stream of the model's queues: the shared one and, with placement, the workers' own
    streams (listed in the queue set)."""
    listed = [_text(q) for q in r.zrange(KEYS.queues(MODEL), 0, -1)]
    return list(dict.fromkeys([KEYS.requests(MODEL), *listed]))


def pending_by_consumer(r: redis.Redis, streams: list[str] | None = None) -> dict[str, int]:
    """Consumer (worker id) -> entries it read and has not acknowledged, in `streams` (every
    stream of the model's queues unless given)."""
    pending: Counter[str] = Counter()
    for stream in queue_streams(r) if streams is None else streams:
        try:
            consumers = r.xinfo_consumers(stream, WORKER_GROUP)
        except redis.ResponseError:  # gone since listed (a dead worker's emptied own stream)
            continue
        pending.update({_text(c["name"]): c["pending"] for c in consumers})
    return dict(pending)


def assert_nothing_left(r: redis.Redis) -> None:
    """Every entry of every stream of the model's queues, own streams included, acknowledged and
    deleted (nothing else per request is kept: its replies are its gateway's to trim)."""
    for stream in queue_streams(r):
        wait_for(lambda s=stream: _unfinished(r, s) == (0, 0), 10, f"{stream} empty")


def _unfinished(r: redis.Redis, stream: str) -> tuple[int, int]:
    """(entries, pending entries) of `stream`; a stream gone holds none."""
    try:
        return r.xlen(stream), r.xpending(stream, WORKER_GROUP)["pending"]
    except redis.ResponseError:
        return r.xlen(stream), 0


def reads(workers: list[Worker]) -> dict[tuple[str, str], float]:
    """(worker, outcome) -> entries that worker read, by where they waited."""
    return {
        (w.worker_id, o): w.metric("jitney_placement_reads_total", outcome=o)
        for w in workers
        for o in OUTCOMES
    }


def read_since(before: dict, workers: list[Worker]) -> dict[tuple[str, str], float]:
    """What was read since `before`: only the (worker, outcome) pairs that moved."""
    now = reads(workers)
    return {k: now[k] - before[k] for k in now if now[k] != before[k]}


def own_reads(workers: list[Worker]) -> float:
    """Entries the workers read from their own streams (placed there by a gateway)."""
    return sum(w.metric("jitney_placement_reads_total", outcome="own") for w in workers)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def assert_same_greedy_text(
    ref: LoadedModel, prompt: list[int], text: str, want: CompletedRequest
) -> None:
    """The served text equals the offline run's (same incremental detokenizer), or it is the
    text of a token stream that holds to the near-tie rule at every position: each token the
    reference's argmax after the prompt and the tokens before it, or within NEAR_TIE of it.

    The gateway serves text, not token ids, so the served tokens are rebuilt: a depth-first
    walk over the near-ties (almost always just the argmax) whose detokenized text stays a
    prefix of the served text, until a stream of the offline length reproduces it exactly."""
    if text == want.text:
        return
    walk = _TextWalk(ref, prompt, text, len(want.token_ids))
    if walk.find([]) is None:
        raise AssertionError(f"served {text!r} != offline {want.text!r}: {walk.failure}")


@dataclass
class _TextWalk:
    ref: LoadedModel
    prompt: list[int]
    text: str
    num_tokens: int
    failure: str = "no token stream of that length reproduces the served text"
    _deepest: int = -1

    def find(self, tokens: list[int]) -> list[int] | None:
        """A continuation of `tokens` to the full length whose text is the served text."""
        final = len(tokens) == self.num_tokens
        emitted = streamed_text(self.ref.tokenizer, self.prompt, tokens, final)
        if final:
            return tokens if emitted == self.text else None
        if not self.text.startswith(emitted):
            return None
        row = next_token_logprobs(self.ref, self.prompt + tokens)[-1]
        for token in near_ties(row):
            if (found := self.find([*tokens, token])) is not None:
                return found
        if len(tokens) > self._deepest:  # no near-tie fits here: the likely place it went wrong
            self._deepest = len(tokens)
            top = row.topk(2).values
            argmax = int(row.argmax())
            self.failure = (
                f"no near-tie (tolerance {NEAR_TIE:g}) fits at token {len(tokens)}: after "
                f"{emitted!r} the reference's argmax is {argmax} "
                f"({self.ref.tokenizer.decode([argmax])!r}, top-2 log-prob gap "
                f"{float(top[0] - top[1]):.2e}), "
                f"the served text goes on {self.text[len(emitted) :][:20]!r}"
            )
        return None


def streamed_text(
    tokenizer: PreTrainedTokenizerBase, prompt: list[int], tokens: list[int], final: bool = True
) -> str:
    """The text a client has received once `tokens` were generated (with `final`, the
    request's whole text: what is held back of an incomplete character is released)."""
    detok = IncrementalDetokenizer.create(tokenizer, prompt)
    emitted = "".join(detok.add(token) for token in tokens)
    return emitted + detok.finish() if final else emitted
