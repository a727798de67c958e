"""Stopping background tasks reliably.

On Python 3.11, `asyncio.wait_for` (used inside redis-py for socket writes) can swallow a
cancellation that lands just as the inner call completes (CPython gh-86296, fixed in 3.12), so one
`task.cancel()` may be lost. Stopping therefore re-cancels until the task is done.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None, timeout: float = 5.0) -> None:
    if task is None:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not task.done() and loop.time() < deadline:
        task.cancel()
        await asyncio.wait([task], timeout=0.05)
    if task.done() and not task.cancelled():
        task.exception()  # retrieved: a crash was logged where it happened
