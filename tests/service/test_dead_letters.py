"""`jitney dead-letters` lists what the workers dead-lettered (never the prompt) and purges."""

from __future__ import annotations

import time

from protocol import Keys, RequestMessage
from tests.service.helpers import MODEL
from tests.services import JitneyProcess
from worker.redis_io import Entry, WorkerRedis

KEYS = Keys()


def test_lists_dead_letters_without_their_prompts_then_purges(redis_server):
    io = WorkerRedis(redis_server.client(), KEYS, "w1", MODEL)
    msg = RequestMessage(
        "cmpl-poison",
        "tiny-random",
        [11, 22, 33, 44],
        {"max_tokens": 9},
        KEYS.replies("gw"),
        "gw",
        time.time(),
    )
    io.dead_letter(
        Entry("1-1", {k.encode(): v.encode() for k, v in msg.encode().items()}),
        "failed on 3 deliveries",
    )
    io.dead_letter(Entry("1-2", {b"v": b"1", b"m": b"{broken"}), "failed on 3 deliveries")

    def run(*flags: str) -> str:
        proc = JitneyProcess(["dead-letters", *flags], {"REDIS_URL": redis_server.url})
        assert proc.proc.wait(30) == 0, proc.output()
        return proc.output()

    out = run()
    assert "2 dead-lettered request(s)" in out
    (row,) = [line for line in out.splitlines() if "cmpl-poison" in line]
    assert row.split()[3:7] == ["tiny-random", "4", "9", "failed"]
    assert "(unreadable entry)" in out
    assert "11, 22" not in out and "[11" not in out  # the prompt stays private
    assert "purged 2" in run("--purge")
    assert redis_server.client().xlen(KEYS.dead_letters) == 0
