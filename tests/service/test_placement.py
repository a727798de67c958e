"""Prefix-aware placement on the real system: a conversation's turns reach the worker holding
its history, an entry placed on a frozen or killed worker is served by another with nothing lost
or repeated, and a dead worker's summary goes with its lease."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import aiohttp
import pytest

from engine.models.model_loader import load_model
from protocol import HEARTBEAT_TTL_S
from tests.service.helpers import (
    KEYS,
    MODEL,
    PLACED,
    assert_nothing_left,
    assert_same_greedy_text,
    complete,
    offline,
    read_since,
    reads,
    stream_completion,
)
from tests.services import running_system, start_worker, wait_for, wait_ready

pytestmark = pytest.mark.slow
BLOCK = 16  # the workers' default block size


class Conversation:
    """A chat resending its history every turn: the last prompt, a reply, the user's new words
    (random token ids of the tiny model's vocabulary)."""

    def __init__(self, seed: int, first: int = 40):
        self.rng = random.Random(seed)
        self.prompt = self.words(first)

    def words(self, n: int) -> list[int]:
        return [self.rng.randrange(3, 250) for _ in range(n)]

    def next_turn(self) -> list[int]:
        self.prompt = [*self.prompt, *self.words(8), *self.words(12)]
        return self.prompt


async def test_turns_go_to_the_worker_holding_the_conversation_and_a_dead_one_s_summary_goes():
    """Three conversations over three workers: each first turn is read from the shared stream,
    every later turn (one with n = 2, served as one entry) from the same worker's own stream,
    `cached_tokens` exactly the last prompt's full blocks. Then that worker is killed: its
    summary expires with its lease, the next turn goes to the shared stream, and the worker
    restarted under its id starts with an empty summary."""
    with running_system(("p1", "p2", "p3"), PLACED, gateway_flags=PLACED) as system:
        r, workers = system.server.client(), system.workers
        holders: dict[int, str] = {}
        async with aiohttp.ClientSession() as session:
            conversations = [Conversation(seed) for seed in range(3)]
            for c, conversation in enumerate(conversations):
                before = reads(workers)
                await complete(session, system.base, conversation.prompt)
                (first,) = read_since(before, workers)
                assert first[1] == "shared"
                holders[c] = first[0]
                for turn in range(2):
                    last = len(conversation.prompt)
                    before = reads(workers)
                    extra = {"n": 2} if turn else {}
                    out = await complete(session, system.base, conversation.next_turn(), **extra)
                    assert read_since(before, workers) == {(holders[c], "own"): 1}
                    assert len(out["choices"]) == (2 if turn else 1)
                    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
                    if not turn:  # (with n = 2 the usage reports choice 1's, the whole prompt)
                        assert cached == last // BLOCK * BLOCK
            holder = next(w for w in workers if w.worker_id == holders[0])
            holder.proc.proc.kill()
            summary = KEYS.prefix_summary(holder.worker_id)
            wait_for(lambda: not r.exists(summary), HEARTBEAT_TTL_S + 2, "the summary to expire")
            survivors = [w for w in workers if w is not holder]
            before = reads(survivors)
            out = await complete(session, system.base, conversations[0].next_turn())
            (moved,) = read_since(before, survivors)
            assert (
                moved[1] == "shared" and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            )
        restarted = start_worker(system.server, holder.worker_id, *PLACED)
        try:
            wait_ready(r, restarted)
            wait_for(lambda: r.hget(summary, "block_size") is not None, 30, "a new summary")
            assert {len(field) for field in r.hkeys(summary)}.isdisjoint({8})  # no block yet
        finally:
            restarted.proc.stop()


async def test_an_entry_placed_on_a_frozen_then_killed_worker_is_served_elsewhere_exactly():
    """The worker holding a conversation runs its second turn (streaming) when it freezes; the
    third turn, placed on it meanwhile (its summary still lives), is taken by the other worker
    after the steal bound, long before the lease lapses. The frozen worker is then killed and
    its running turn taken over. Both clients get the no-fault text, no token lost or repeated."""
    slow = {"JITNEY_FAILPOINTS": "step_delay_ms=20"}  # 120 tokens take a few seconds
    n = 120
    with running_system(("f1", "f2"), PLACED, slow, gateway_flags=PLACED) as system:
        r, workers = system.server.client(), system.workers
        conversation = Conversation(seed=7, first=48)
        async with aiohttp.ClientSession() as session:
            before = reads(workers)
            await complete(session, system.base, conversation.prompt)
            ((holder_id, _),) = read_since(before, workers)
            holder = next(w for w in workers if w.worker_id == holder_id)
            other = next(w for w in workers if w is not holder)
            body = {"model": MODEL, "temperature": 0, "ignore_eos": True}
            running_prompt = conversation.next_turn()
            running = asyncio.create_task(
                stream_completion(
                    session, system.base, {**body, "prompt": running_prompt, "max_tokens": n}
                )
            )
            await asyncio.to_thread(
                wait_for,
                lambda: holder.metric("jitney_generation_tokens_total") > 10,
                30,
                "the second turn generating",
            )
            assert read_since(before, workers)[(holder_id, "own")] == 1
            holder.proc.proc.send_signal(signal.SIGSTOP)
            frozen_at = time.monotonic()
            placed_prompt = conversation.next_turn()
            placed = await stream_completion(
                session, system.base, {**body, "prompt": placed_prompt, "max_tokens": 20}
            )
            # taken past the steal bound, while the frozen worker's summary and lease still live
            assert time.monotonic() - frozen_at < HEARTBEAT_TTL_S - 1
            assert other.metric("jitney_placement_reads_total", outcome="stolen") == 1
            holder.proc.proc.kill()
            holder.proc.proc.wait()
            finished = await asyncio.wait_for(running, 60)
        assert other.metric("jitney_request_handoffs_total", event="taken_over") == 1
        ref = load_model(MODEL)
        want_running, want_placed = offline([running_prompt], n)[0], offline([placed_prompt], 20)[0]
        assert_same_greedy_text(ref, running_prompt, finished[0], want_running)
        assert_same_greedy_text(ref, placed_prompt, placed[0], want_placed)
        assert finished[1]["completion_tokens"] == n and placed[1]["completion_tokens"] == 20
        assert_nothing_left(r)
