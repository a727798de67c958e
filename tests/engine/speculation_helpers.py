"""Speculation tests' runner: requests to the end step by step, every block pool checked after
each step (the target's, and a draft model's against the sequences still running)."""

from __future__ import annotations

from typing import Any

from engine.llm_engine import Engine
from engine.models.model_loader import LoadedModel
from generation.sampling_params import SamplingParams
from tests.engine.engine_helpers import make_engine

# Random weights loop quickly, so their greedy replies repeat spans: drafts get accepted.
PROMPTS = [[5, 6, 7, 8, 9] * 4, list(range(3, 40)), [11, 12, 13, 11, 12, 13, 14] * 2]
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

Requests = list[tuple[list[int], SamplingParams]]


def check_pools(engine: Engine) -> None:
    engine.block_manager.check_integrity()
    if engine.drafter is not None:
        engine.drafter.check_integrity({seq.seq_id for seq in engine.policy.running})


def run(engine: Engine, requests: Requests, logprobs: bool = False) -> dict[str, list[Any]]:
    """Every request to the end (the pools checked after each step): request id -> each
    choice's tokens, then the text and finish reason of choice 0 (and, with `logprobs`, each
    token's log-prob and its alternatives' ids)."""
    tokens: dict[str, dict[int, list[int]]] = {}
    ends: dict[str, tuple[str, str | None]] = {}
    text: dict[str, str] = {}
    found: dict[str, list[tuple[float, list[int]]]] = {}
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
        tokens[f"r{i}"], text[f"r{i}"], found[f"r{i}"] = {}, "", []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].setdefault(out.index, []).extend(out.new_token_ids)
            if out.index == 0:
                text[out.request_id] += out.delta_text
                found[out.request_id] += [
                    (lp.logprob, [t for t, _ in lp.top]) for lp in out.logprobs or ()
                ]
                if out.finished:
                    ends[out.request_id] = (text[out.request_id], out.finish_reason)
        check_pools(engine)
    return {
        rid: [sorted(t.items()), ends[rid], *([found[rid]] if logprobs else [])]
        for rid, t in tokens.items()
    }


def both(
    loaded: LoadedModel, requests: Requests, logprobs: bool = False, **config: Any
) -> tuple[dict, dict, Engine]:
    """The requests without speculation and with it (`config`'s, n-gram unless it names a
    draft model), and the speculating engine. It verifies every proposal unless `config`
    prices its rows: these tests are about what a verification keeps, not whether it pays."""
    spec = {} if "speculative_model" in config else {"speculative": "ngram"}
    config = {"speculative_draft_row_cost": 0.0, **config}
    off_config = {k: v for k, v in config.items() if not k.startswith("speculative")}
    off_config["speculative"] = "none"
    off = make_engine(loaded, kv_cache_memory="16MiB", **off_config)
    on = make_engine(loaded, kv_cache_memory="16MiB", **spec, **config)
    return run(off, requests, logprobs), run(on, requests, logprobs), on
