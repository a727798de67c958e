"""`jitney top`'s frame, drawn from a frame as /ui/events sends it (no stack needed)."""

from __future__ import annotations

import re
import time

from jitney.commands.top import BARS, render
from protocol.snapshot import BatchSnapshot, Seat


def frame(seats_per_worker: int = 3) -> dict[str, object]:
    phases = ["decode", "prefill", "decode", "preempted", "waiting"][:seats_per_worker]
    seats = [Seat(f"{i:08x}", 0, p, 50 * i, 200, 4, 9, 0) for i, p in enumerate(phases)]
    running = sum(p in ("decode", "prefill") for p in phases)
    snap = BatchSnapshot("w1", "tiny", time.time(), 8, 3, 10, running, 7, running, 2.5, "kv_blocks")
    snap.seats = seats
    return {"time": time.time(), "queue": {"lag": 4, "pending": 2}, "workers": [snap.to_dict()]}


def test_without_colour_a_letter_per_seat_a_dot_per_free_slot_then_the_queue():
    lines = render(frame(5), 200, color=False)
    assert "queue lag 4" in lines[0] and "1 worker(s)" in lines[0]
    (row,) = [line for line in lines if line.startswith("w1 ")]
    assert row.endswith("DPD·····|XW +5")  # 3 held, 5 free of 8, 2 of the 7 queued listed
    assert "KV  30%" in row and "bound kv" in row
    assert lines[-1].startswith("seats:")


def test_with_colour_the_bar_height_is_the_share_of_max_tokens():
    (row,) = [line for line in render(frame(3), 200, color=True) if line.startswith("w1 ")]
    bars = re.findall(r"\x1b\[38;5;\d+m(.)\x1b\[0m", row)
    assert bars[:3] == [BARS[0], BARS[2], BARS[4]]  # 0, 50 and 100 of 200 tokens


def test_a_narrow_terminal_clips_the_seats_and_says_so():
    (row,) = [line for line in render(frame(5), 80, color=False) if line.startswith("w1 ")]
    assert len(row) <= 80 and "…" in row


def test_an_error_frame_says_what_is_wrong():
    lines = render({"time": time.time(), "error": "redis unavailable", "workers": []}, 100, False)
    assert "redis unavailable" in lines[0] and "no live workers" in lines


def test_a_seat_under_an_adapter_is_marked_and_the_line_names_the_adapters():
    data = frame(3)
    snap = BatchSnapshot.from_dict(data["workers"][0])  # type: ignore[index]
    snap.seats[0].adapter = snap.seats[2].adapter = "sql"
    data["workers"] = [snap.to_dict()]
    (row,) = [line for line in render(data, 200, color=False) if line.startswith("w1 ")]
    assert row.endswith("dPd····· +7 lora sql×2")
    (row,) = [line for line in render(data, 200, color=True) if line.startswith("w1 ")]
    assert row.count("\x1b[4m") == 2
