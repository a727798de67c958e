"""The live batch view against a live stack under load: the page in headless Chromium, and
`jitney top` (once, and interactive in a tmux pane)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from jitney.commands.top import BARS
from protocol.snapshot import PHASES
from tests.observability.cdp import Page, chromium
from tests.services import System, running_system, wait_for

ROOT = Path(__file__).resolve().parents[2]
MAX_NUM_SEQS = 8
CLIENTS = 20  # more than the two workers' 16 seats: some wait in the stream
MAX_TOKENS = 200

pytestmark = pytest.mark.slow  # a two-worker stack, its load, a browser


@pytest.fixture(scope="module")
def stack() -> Iterator[System]:
    with running_system(("w1", "w2"), worker_flags=("--max-num-seqs", str(MAX_NUM_SEQS))) as s:
        yield s


class Load:
    """CLIENTS streamed completions at a time, each client sending its next when one ends,
    from a thread of its own until stopped (so the batch keeps moving while the test looks)."""

    def __init__(self, base: str):
        self.base = base
        self.finished = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(self._client(session, i) for i in range(CLIENTS)))

    async def _client(self, session: aiohttp.ClientSession, i: int) -> None:
        body = {
            "model": "tiny-random",
            "prompt": f"client {i}: tell me a story",
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
        }
        while not self._stop.is_set():
            try:
                async with session.post(f"{self.base}/v1/completions", json=body) as response:
                    async for _ in response.content:
                        if self._stop.is_set():
                            return  # closing the stream cancels the request
                    if response.status != 200:
                        self.failures.append(f"HTTP {response.status}")
                    self.finished += 1
            except aiohttp.ClientError as e:
                self.failures.append(repr(e))

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


# Every worker's seats as the page shows them: worker -> [[id, phase, done, max_tokens], ...].
SEATS_JS = """JSON.stringify(Object.fromEntries([...document.querySelectorAll('section.worker')]
  .map(w => [w.dataset.worker, [...w.querySelectorAll('.seat:not(.free)')]
    .map(s => [s.dataset.id, s.dataset.phase, +s.dataset.done, +s.dataset.max])])))"""
# Non-blank pixels of each occupancy strip.
CANVAS_JS = """[...document.querySelectorAll('section.worker canvas')].map(c => {
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0; for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return n; })"""


async def read_seats(page: Page) -> dict[str, list[list[Any]]]:
    return json.loads(await page.evaluate(SEATS_JS))


def running(seats: dict[str, list[list[Any]]]) -> dict[str, int]:
    return {w: sum(s[1] in ("prefill", "decode") for s in ss) for w, ss in seats.items()}


async def watch_page(port: int, base: str, screenshot: Path) -> None:
    async with aiohttp.ClientSession() as session:
        page = await Page.open(session, port)
        await page.call("Page.navigate", url=f"{base}/ui")
        deadline = time.monotonic() + 60
        while True:
            first = await read_seats(page)
            busy = running(first)
            if set(busy) == {"w1", "w2"} and all(busy.values()):
                break
            assert time.monotonic() < deadline, f"the page never showed both workers busy: {first}"
            await asyncio.sleep(0.25)
        await asyncio.sleep(1.5)  # three updates later
        second = await read_seats(page)
        for seats in (first, second):
            for seat_id, phase, done, max_tokens in (s for ss in seats.values() for s in ss):
                assert re.fullmatch(r"[0-9a-f]{8}", seat_id) and phase in PHASES
                assert max_tokens == MAX_TOKENS and 0 <= done < MAX_TOKENS
            assert all(len(ss) <= MAX_NUM_SEQS + 16 for ss in seats.values())
        before = {s[0]: s[2] for ss in first.values() for s in ss}
        after = {s[0]: s[2] for ss in second.values() for s in ss}
        moved = [i for i in before.keys() & after.keys() if after[i] > before[i]]
        assert moved or before.keys() != after.keys(), f"no progress between reads: {first}"
        assert all(after[i] >= before[i] for i in before.keys() & after.keys())
        lag = await page.evaluate("document.getElementById('lag').textContent")
        assert re.fullmatch(r"\d+", lag), lag
        prefix = await page.evaluate("document.querySelector('section.worker .prefix').textContent")
        words = r"prefix hits \d+% · placed \d+ · shared \d+ · stolen \d+ · waited [\d.]+ ms"
        assert re.fullmatch(words, prefix), prefix
        assert all(n > 0 for n in await page.evaluate(CANVAS_JS)), "an occupancy strip is blank"
        await page.screenshot(screenshot)


def test_the_page_shows_both_workers_seats_moving(stack: System, tmp_path: Path) -> None:
    shot = tmp_path / "live-view.png"
    with Load(stack.base) as load, chromium() as port:
        asyncio.run(watch_page(port, stack.base, shot))
    assert not load.failures, load.failures[:3]
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 10_000


def top_env(stack: System) -> dict[str, str]:
    return {**os.environ, "REDIS_URL": stack.server.url, "COLUMNS": "160"}


def test_top_once_prints_each_worker_with_its_seats(stack: System) -> None:
    with Load(stack.base):
        wait_for(lambda: stack.workers[0].metric("jitney_requests_running") > 0, 30, "load")
        out = subprocess.run(
            [sys.executable, "-m", "jitney.cli", "top", "--once"],
            capture_output=True,
            text=True,
            timeout=30,
            env=top_env(stack),
            cwd=ROOT,
        )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "queue lag" in lines[0] and "2 worker(s)" in lines[0]
    for worker in ("w1", "w2"):
        (line,) = [line for line in lines if line.startswith(worker + " ")]
        held = int(re.search(r"run +(\d+)/8", line).group(1))  # type: ignore[union-attr]
        # Not a terminal: a letter per seat (D decode, P prefill, ...), "·" per free slot.
        assert len(re.findall("[DPXWF]", line)) >= held
        assert line.count("·") >= MAX_NUM_SEQS - held
    assert lines[-1].startswith("seats:")


@contextmanager
def tmux(command: list[str], env: dict[str, str]) -> Iterator[tuple[list[str], str]]:
    """A detached tmux session (on a private server socket) running `command`."""
    base = ["tmux", "-L", f"jitney-test-{os.getpid()}"]
    session = "top"
    size = ["-x", "160", "-y", "20"]
    subprocess.run(
        [*base, "new-session", "-d", "-s", session, *size, "-c", str(ROOT), *command],
        check=True,
        env=env,
    )
    try:
        yield base, session
    finally:
        subprocess.run([*base, "kill-server"], capture_output=True)


def test_top_in_a_terminal_refreshes_in_place_and_quits_on_q(stack: System) -> None:
    command = ["env", f"REDIS_URL={stack.server.url}", sys.executable, "-m", "jitney.cli", "top"]
    with Load(stack.base), tmux(command, top_env(stack)) as (base, session):

        def screen() -> str:
            return subprocess.run(
                [*base, "capture-pane", "-p", "-t", session], capture_output=True, text=True
            ).stdout

        def both_busy() -> bool:
            lines = screen().splitlines()
            rows = [line for line in lines if re.match(r"w[12] ", line)]
            return len(rows) == 2 and all(any(c in BARS for c in row) for row in rows)

        wait_for(both_busy, 30, f"top showing both workers' seats:\n{screen()}")
        first = screen()
        assert first.count("jitney top") == 1, "not refreshed in place"
        wait_for(lambda: screen() != first, 10, "the next frame")

        def has_session() -> bool:
            found = subprocess.run([*base, "has-session", "-t", session], capture_output=True)
            return found.returncode != 0

        subprocess.run([*base, "send-keys", "-t", session, "q"], check=True)
        wait_for(has_session, 10, "top to quit on q")
