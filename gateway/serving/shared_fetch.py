"""One Redis reading in flight at a time, shared by every caller that wants it meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class SharedFetch(Generic[T]):
    """Calls `fetch` when nobody is already waiting on it; concurrent callers await that one
    call. Shielded: a caller cancelled (its client gone) does not cancel it for the others."""

    def __init__(self, fetch: Callable[[], Awaitable[T]]):
        self._fetch = fetch
        self._fetching: asyncio.Future[T] | None = None

    async def __call__(self) -> T:
        if self._fetching is None:
            self._fetching = asyncio.ensure_future(self._fetch())
        fetching = self._fetching
        try:
            return await asyncio.shield(fetching)
        finally:
            if fetching.done() and self._fetching is fetching:
                self._fetching = None
