"""`jitney top`: the live batch view in a terminal, one line per worker, refreshed in place.

It reads Redis directly (REDIS_URL, --key-prefix), like `jitney dead-letters`, through the
gateway's own `LiveFeed`, so it shows exactly what `/ui/events` sends: an operator's tool that
works with no gateway up, needs no API key, and adds no load to the gateways. Without REDIS_URL
it reads the private Redis of the `jitney up` running on this machine, found through the file
that `up` leaves while it runs (jitney/commands/local_stack.py), else the default Redis.

Each seat is one character: its colour is the phase, its height the tokens done of max_tokens
(without colour, a letter per phase); a seat under a LoRA adapter is underlined (without colour,
its letter in lower case), and the line ends with the adapters its seats run under. `q` or
Ctrl-C quits; `--once` prints one frame and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import select
import shutil
import sys
import termios
import time
import tty
from collections.abc import Iterator
from typing import Any

from gateway.http.live_view import LiveFeed
from gateway.serving.backlog import ModelBacklogs
from jitney.commands.local_stack import live_stacks
from jitney.flag_defaults import field_defaults
from protocol import Keys, ProtocolError, redacted, redis_url
from protocol.redis_client import async_client
from protocol.snapshot import SNAPSHOT_INTERVAL_S, BatchSnapshot, Seat

BARS = "▁▂▃▄▅▆▇█"
FREE = "·"
COLORS = {"prefill": 214, "decode": 35, "preempted": 196, "waiting": 245, "finished": 141}
LETTERS = {"prefill": "P", "decode": "D", "preempted": "X", "waiting": "W", "finished": "F"}
RESET, DIM, UNDERLINE = "\x1b[0m", "\x1b[2m", "\x1b[4m"
# What bounded the last step (scheduler.plan.StepLimit), short enough to leave room for seats.
LIMITS = {
    "none": "-",
    "max_num_seqs": "seqs",
    "max_num_batched_tokens": "tokens",
    "kv_blocks": "kv",
    "batch_running": "batch",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--key-prefix",
        default=field_defaults(Keys)["prefix"],
        help="Redis key prefix of the deployment",
    )
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument(
        "--interval", type=float, default=SNAPSHOT_INTERVAL_S, help="seconds between refreshes"
    )
    p.add_argument("--no-color", action="store_true", help="letters instead of colours")


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_main(args))
    except KeyboardInterrupt:
        return 0


def redis_to_read() -> str:
    """REDIS_URL when set; else the private Redis of the one `jitney up` running here (several:
    the user must choose); else the default Redis, as every other command."""
    if os.environ.get("REDIS_URL"):
        return redis_url()
    stacks = live_stacks()
    if len(stacks) > 1:
        listed = "\n".join(
            f"  REDIS_URL={s.redis_url}  (jitney up pid {s.pid}, gateway {s.gateway_url})"
            for s in stacks
        )
        raise SystemExit(f"{len(stacks)} `jitney up` are running here; choose one:\n{listed}")
    return stacks[0].redis_url if stacks else redis_url()


async def _main(args: argparse.Namespace) -> int:
    keys = Keys(args.key_prefix)
    url = redis_to_read()
    client = async_client(url, 2, socket_timeout=5, socket_connect_timeout=5)
    # A reading of the backlogs only: the bounds matter to admission, not here.
    feed = LiveFeed(client, keys, ModelBacklogs(client, keys).read)
    color = sys.stdout.isatty() and not args.no_color and "NO_COLOR" not in os.environ
    try:
        if args.once:
            frame = await feed.frame()
            print("\n".join(render(frame, shutil.get_terminal_size().columns, color, url)))
            return 1 if "error" in frame else 0
        with _screen() as keys_pressed:
            while True:
                frame = await feed.frame()
                lines = render(frame, shutil.get_terminal_size().columns, color, url)
                lines[0] += f"  {DIM}(q quits){RESET}" if color else "  (q quits)"
                # Home, each line cleared to its end, then the rest of the screen.
                sys.stdout.write("\x1b[H" + "\x1b[K\n".join(lines) + "\x1b[K\n\x1b[J")
                sys.stdout.flush()
                if await keys_pressed(args.interval) & {"q", "Q"}:
                    return 0
    finally:
        await client.aclose()


@contextlib.contextmanager
def _screen() -> Iterator[Any]:
    """The alternate screen, cursor hidden, keys read one at a time (cbreak: Ctrl-C still
    interrupts); everything restored on the way out."""
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd) if sys.stdin.isatty() else None
    if saved is not None:
        tty.setcbreak(fd)
    sys.stdout.write("\x1b[?1049h\x1b[?25l")

    async def keys_pressed(timeout: float) -> set[str]:
        """What was typed while waiting `timeout` seconds (a key cuts the wait short)."""
        if saved is None:
            await asyncio.sleep(timeout)
            return set()
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if select.select([fd], [], [], 0)[0]:
                return set(os.read(fd, 64).decode(errors="replace"))
            await asyncio.sleep(min(left, 0.05))
        return set()

    try:
        yield keys_pressed
    finally:
        sys.stdout.write("\x1b[?25h\x1b[?1049l")
        sys.stdout.flush()
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def render(frame: dict[str, Any], width: int, color: bool, source: str | None = None) -> list[str]:
    """One frame: a header (naming the Redis read: `source`, else REDIS_URL's), a line per
    worker, the legend."""
    when = time.strftime("%H:%M:%S", time.localtime(frame["time"]))
    queue = frame.get("queue")
    head = f"jitney top · {when} · {redacted(source or redis_url())}"
    if queue is not None:
        head += f" · queue lag {queue['lag']} · pending {queue['pending']}"
    if "error" in frame:
        head += f" · {frame['error']}"
    snapshots = []
    for raw in frame["workers"]:
        with contextlib.suppress(ProtocolError):
            snapshots.append(BatchSnapshot.from_dict(raw))
    lines = [head + f" · {len(snapshots)} worker(s)"]
    name_width = min(max((len(s.worker) for s in snapshots), default=6), 24)
    lines += [_worker_line(s, name_width, width, color) for s in snapshots]
    if not snapshots:
        lines.append("no live workers")
    lines.append(_legend(color))
    return lines


def _worker_line(s: BatchSnapshot, name_width: int, width: int, color: bool) -> str:
    kv = 100 * s.kv_used / s.kv_total if s.kv_total else 0.0
    limit = LIMITS.get(s.limit, s.limit)
    info = (
        f"{s.worker[:name_width]:<{name_width}} run {s.running:>3}/{s.max_num_seqs:<3} "
        f"wait {s.waiting:>3} KV {kv:3.0f}% step {s.batch_size:>3} × {s.step_ms:6.1f} ms "
        f"bound {limit:<6} "
    )
    held, queued = s.seats[: s.running], s.seats[s.running :]
    cells = [_seat(seat, color) for seat in held]
    cells += [f"{DIM}{FREE}{RESET}" if color else FREE] * max(0, s.max_num_seqs - len(held))
    if queued:
        cells += ["|", *(_seat(seat, color) for seat in queued)]
    more = s.waiting - len(queued)
    tail = f" +{more}" if more > 0 else ""
    tail += _adapters(s.seats)
    room = max(0, width - len(info) - len(tail) - 1)
    if len(cells) > room:  # one visible character per cell: clip to the terminal, say so
        cells = [*cells[: max(0, room - 1)], "…"]
    return info + "".join(cells) + tail


def _seat(seat: Seat, color: bool) -> str:
    if not color:
        letter = LETTERS.get(seat.phase, "?")
        return letter.lower() if seat.adapter else letter
    share = seat.done / seat.max_tokens if seat.max_tokens else 0.0
    bar = BARS[min(len(BARS) - 1, int(share * len(BARS)))]
    under = UNDERLINE if seat.adapter else ""
    return f"{under}\x1b[38;5;{COLORS.get(seat.phase, 15)}m{bar}{RESET}"


def _adapters(seats: list[Seat]) -> str:
    """The LoRA adapters the seats run under, with how many seats each ("" when none)."""
    counts: dict[str, int] = {}
    for seat in seats:
        if seat.adapter:
            counts[seat.adapter] = counts.get(seat.adapter, 0) + 1
    return " lora " + " ".join(f"{a}×{n}" for a, n in sorted(counts.items())) if counts else ""


def _legend(color: bool) -> str:
    if not color:
        keys = " ".join(f"{letter} {phase}" for phase, letter in LETTERS.items())
        return f"seats: {keys} (lower case: under a LoRA adapter), {FREE} free, | queue"
    keys = " ".join(f"\x1b[38;5;{COLORS[p]}m█{RESET} {p}" for p in COLORS)
    return (
        f"seats: {keys}, {FREE} free, | queue; height: tokens done / max_tokens; "
        "underlined: under a LoRA adapter"
    )
