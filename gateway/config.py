"""Gateway configuration: one frozen dataclass, checked once, filled by `jitney gateway`."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field

from jitney.protocol import redis_url

MiB = 1024 * 1024


def default_gateway_id() -> str:
    """Unique per process: a restarted gateway must not read its predecessor's reply stream."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    gateway_id: str = field(default_factory=default_gateway_id)
    key_prefix: str = "jitney"
    redis_url: str = field(default_factory=redis_url)
    max_body_bytes: int = MiB
    # Backlog bounds (429 above them): entries nobody has read yet, across all gateways, and
    # prompt tokens this gateway enqueued that no worker has started yet.
    max_queue_len: int = 256
    max_queued_tokens: int = 262_144
    # Seconds a request may wait in the queue before workers drop it as "expired"; None: forever.
    request_timeout: float | None = None
    # Chat requests without max_tokens get min(this, what fits in the context window).
    chat_default_max_tokens: int = 512
    completion_default_max_tokens: int = 16
    # NOTE: every Redis call is bounded by redis_timeout_s (plus one quick retry), so a dead or
    # stalled Redis gives a 503 within a few seconds instead of a hung request.
    redis_timeout_s: float = 2.0
    redis_max_connections: int = 64
    # The reply reader blocks this long per XREAD; it must stay below redis_timeout_s.
    reply_block_ms: int = 1000
    # A started request with no reply for this long is cancelled and answered 504 (a worker
    # that died with nobody to reclaim its work must not hold a client forever).
    reply_idle_timeout_s: float = 300.0
    # How long a backlog reading (XINFO GROUPS) is reused: the 429 check stays cheap under load.
    backlog_cache_s: float = 0.1
    retry_after_s: int = 1
    # SSE comment sent when a stream has been silent this long, so proxies keep it open.
    sse_keepalive_s: float = 15.0

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if not self.gateway_id or any(c.isspace() for c in self.gateway_id):
            raise ValueError(f"gateway id must be non-empty without spaces: {self.gateway_id!r}")
        if not self.key_prefix:
            raise ValueError("key prefix must be non-empty")
        for name in ("max_body_bytes", "max_queue_len", "max_queued_tokens", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"request timeout must be > 0, got {self.request_timeout}")
        if self.chat_default_max_tokens < 1 or self.completion_default_max_tokens < 1:
            raise ValueError("default max_tokens must be >= 1")
        if self.reply_block_ms / 1000 >= self.redis_timeout_s:
            raise ValueError(
                f"reply block ({self.reply_block_ms} ms) must be shorter than the Redis socket "
                f"timeout ({self.redis_timeout_s} s), or every idle XREAD times out"
            )
