"""Prefix-aware placement's rule: the longest cached prefix wins unless its worker is busy; a
request's LoRA adapter, where some workers hold it resident and others not, comes first."""

from __future__ import annotations

from gateway.serving.placement import BUSY_SLACK, choose, lead
from protocol.queue.placement import Cached


def worker(
    name: str, blocks: int, room: int = 4, waiting: int = 0, unread: int = 0, adapter: bool = True
) -> Cached:
    return Cached(name, blocks, room, waiting, unread, adapter)


def test_the_worker_holding_the_longest_prefix_gets_the_request_when_it_has_room():
    cached = [worker("a", 2), worker("b", 9, room=1), worker("c", 0)]
    assert choose(cached, prompt_blocks=10) == ("hit", cached[1])


def test_what_every_worker_holds_is_no_hit():
    """A header all of them cached says nothing: the shared stream keeps the load even."""
    assert choose([worker("a", 3), worker("b", 3, room=9)], 10) == ("no_hit", None)
    assert choose([worker("a", 0), worker("b", 0)], 10) == ("no_hit", None)
    assert choose([worker("a", 8)], 10) == ("no_hit", None)  # one worker: nothing to choose


def test_ties_go_to_the_worker_further_ahead():
    cached = [worker("a", 5, room=1), worker("b", 5, room=3), worker("c", 0)]
    assert choose(cached, 10) == ("hit", cached[1])


def test_a_busy_holder_loses_a_short_prefix_to_a_worker_with_room():
    """Its seats are full (room 0, one unread entry already): a free worker starts at once."""
    busy = worker("a", 9, room=0, unread=1)
    assert lead(busy) == 1
    assert choose([busy, worker("b", 0, room=2)], 10) == ("busy", None)


def test_when_nobody_has_room_a_long_hit_waits_at_most_the_slack_behind():
    """Everyone full: the holder of most of the prompt is worth up to BUSY_SLACK more requests
    ahead of it; a short hit, or one further behind, goes to the shared stream."""
    others = worker("b", 0, room=0, waiting=1)  # lead 1
    near = worker("a", 8, room=0, waiting=1 + BUSY_SLACK)
    assert choose([near, others], prompt_blocks=10) == ("hit", near)
    far = worker("a", 8, room=0, waiting=2 + BUSY_SLACK)
    assert choose([far, others], prompt_blocks=10) == ("busy", None)
    short = worker("a", 2, room=0, waiting=1)
    assert choose([short, others], prompt_blocks=10) == ("busy", None)


def test_a_worker_holding_the_adapter_gets_the_request_without_a_prefix_hit():
    """Some workers hold the request's adapter resident: one of them, even for a prompt nobody
    has cached (the others would read the adapter's files first)."""
    holder = worker("b", 0, adapter=False), worker("a", 0, room=1), worker("c", 0, adapter=False)
    assert choose(holder, prompt_blocks=0) == ("adapter", holder[1])


def test_among_the_adapter_s_holders_the_prefix_rule_picks():
    """The holder with the longest cached prefix wins, even against a longer one elsewhere (the
    other adapter's blocks are not this one's); ties go to the one further ahead."""
    elsewhere = worker("x", 9, adapter=False)
    short, long = worker("a", 1, room=4), worker("b", 6, room=1)
    assert choose([elsewhere, short, long], 10) == ("adapter", long)
    ahead = worker("c", 0, room=3)
    assert choose([elsewhere, worker("a", 0, room=1), ahead], 10) == ("adapter", ahead)


def test_a_busy_holder_of_the_adapter_loses_to_a_worker_with_room():
    """The holder is full and another worker has room: the shared stream, where that worker
    takes it, loading the adapter. Nobody has room: the holder, within the slack."""
    busy = worker("a", 0, room=0, unread=1)
    assert choose([busy, worker("b", 0, room=2, adapter=False)], 10) == ("busy", None)
    full = worker("b", 0, room=0, waiting=1, adapter=False)  # lead 1
    near = worker("a", 0, room=0, waiting=1 + BUSY_SLACK)
    assert choose([near, full], 10) == ("adapter", near)
    far = worker("a", 0, room=0, waiting=2 + BUSY_SLACK)
    assert choose([far, full], 10) == ("busy", None)


def test_an_adapter_every_worker_holds_or_none_does_leaves_the_prefix_rule():
    everyone = [worker("a", 0), worker("b", 5, room=1)]
    assert choose(everyone, 10) == ("hit", everyone[1])
    nobody = [worker("a", 0, adapter=False), worker("b", 0, adapter=False)]
    assert choose(nobody, 10) == ("no_hit", None)
