"""Headless Chromium driven over the DevTools protocol with aiohttp (no selenium, no playwright):
start it, open a page, evaluate JavaScript, take a screenshot."""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

from tests.services import wait_for

CHROMIUM = "/usr/bin/chromium"


class CdpError(RuntimeError):
    pass


@contextmanager
def chromium(width: int = 1400, height: int = 900) -> Iterator[int]:
    """A headless Chromium on a free DevTools port (yielded); stopped with all its processes."""
    profile = Path(tempfile.mkdtemp(prefix="jitney-chromium-"))
    args = [
        shutil.which("chromium") or CHROMIUM,
        "--headless=new",
        "--no-sandbox",  # tests run as root in containers
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-extensions",
        "--remote-debugging-address=127.0.0.1",
        "--remote-debugging-port=0",
        f"--user-data-dir={profile}",
        f"--window-size={width},{height}",
        "about:blank",
    ]
    log = open(profile / "chromium.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    port_file = profile / "DevToolsActivePort"
    try:

        def listening() -> bool:
            assert proc.poll() is None, (profile / "chromium.log").read_text(errors="replace")
            return port_file.exists() and bool(port_file.read_text().split())

        wait_for(listening, 30, "chromium's DevTools port")
        yield int(port_file.read_text().split()[0])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the group this test started: its renderers too
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        shutil.rmtree(profile, ignore_errors=True)


class Page:
    """One tab: `call` sends a DevTools command and returns its result (events are skipped)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self._ids = itertools.count(1)

    @classmethod
    async def open(cls, session: aiohttp.ClientSession, port: int) -> Page:
        async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
            targets = await response.json()
        url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        return cls(await session.ws_connect(url, max_msg_size=0))

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        await self.ws.send_str(json.dumps({"id": call_id, "method": method, "params": params}))
        async for message in self.ws:
            reply = json.loads(message.data)
            if reply.get("id") != call_id:
                continue
            if "error" in reply:
                raise CdpError(f"{method}: {reply['error']}")
            return reply["result"]
        raise CdpError(f"{method}: the DevTools connection closed")

    async def evaluate(self, expression: str) -> Any:
        result = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise CdpError(f"{expression[:60]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self, path: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))
