"""What the live batch view costs a worker: one snapshot (build + JSON) against one engine step.

`python -m research.snapshot_cost [--model tiny-random] [--seats 64] [--redis-url URL]`: an
engine decodes a full batch of `--seats` sequences; its mean step time is compared with the mean
cost of a snapshot of that batch (and, with --redis-url, of its SET too). A worker publishes at
most every SNAPSHOT_INTERVAL_S, so its share of the loop's time is the snapshot's cost over
that interval (or over one step, when a step takes longer).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from engine.config import EngineConfig
from engine.llm_engine import Engine
from generation.sampling_params import SamplingParams
from protocol import Keys
from protocol.redis_client import sync_client
from protocol.snapshot import SNAPSHOT_INTERVAL_S
from worker.live_snapshot import SnapshotPublisher, build_snapshot

PROMPT_TOKENS = 16


def measure(
    model: str, seats: int, repeat: int, steps: int, redis_url: str | None
) -> dict[str, float | int | str]:
    engine = Engine(EngineConfig(model=model, max_num_seqs=seats, kv_cache_memory="1GiB"))
    params = SamplingParams(max_tokens=steps + 64, ignore_eos=True)
    for i in range(seats):
        engine.add_request(f"cmpl-{i:04d}", list(range(10, 10 + PROMPT_TOKENS)), params)
    while any(s.num_uncomputed_tokens > 1 for s in engine.view.sequences()):
        engine.step()  # every prompt computed: from here on, decode steps of the whole batch
    engine.step()  # warm
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_s = (time.perf_counter() - start) / steps
    assert engine.stats.batch_size == seats

    start = time.perf_counter()
    for _ in range(repeat):
        payload = build_snapshot(engine, "bench-worker", "tiny-random").encode()
    snapshot_s = (time.perf_counter() - start) / repeat
    result: dict[str, float | int | str] = {
        "model": model,
        "seats": seats,
        "snapshot_bytes": len(payload),
        "step_ms": step_s * 1000,
        "snapshot_us": snapshot_s * 1e6,
        "snapshot_over_step_pct": 100 * snapshot_s / step_s,
        # Once per interval (or per step, if a step is longer): the loop's time it takes.
        "amortised_pct": 100 * snapshot_s / max(SNAPSHOT_INTERVAL_S, step_s),
    }
    if redis_url:
        client = sync_client(redis_url)
        publisher = SnapshotPublisher(client, Keys("bench"), "w", "tiny-random", interval_s=0.0)
        start = time.perf_counter()
        for _ in range(repeat):
            publisher.maybe_publish(engine)
        publish_s = (time.perf_counter() - start) / repeat
        result["publish_us"] = publish_s * 1e6
        result["publish_over_step_pct"] = 100 * publish_s / step_s
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--seats", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2000, help="snapshots timed")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed")
    parser.add_argument("--redis-url", default=None, help="also time the SET (one round trip)")
    args = parser.parse_args()
    result = measure(args.model, args.seats, args.repeat, args.steps, args.redis_url)
    result["load_average"] = os.getloadavg()[0]
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
