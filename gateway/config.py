"""Gateway configuration: one frozen dataclass, checked once, filled by `jitney gateway`."""

from __future__ import annotations

import hashlib
import math
import os
import re
import secrets
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field

from generation.reasoning import ReasoningFormat, reasoning_format
from protocol import PRIORITIES, redis_url
from protocol.queue.placement import PLACEMENT_DEFAULT

MiB = 1024 * 1024
# aiohttp's parser limits, stated here so they are ours: a longer header line or request line,
# or more header fields, gets a 431 before any handler runs.
MAX_HEADER_LINE_BYTES = 8190
MAX_HEADERS = 128
KEY_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def default_gateway_id() -> str:
    """Unique per process: a restarted gateway must not read its predecessor's reply stream."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(frozen=True, slots=True)
class RateLimits:
    """Token buckets per client (API key, or client IP without keys); 0 turns a limit off."""

    rps: float = 0.0  # requests per second refilled...
    burst: int = 0  # ...into a bucket this large (0: ceil(rps), at least 1)
    tpm: int = 0  # prompt + max_tokens per minute, charged at admission

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rps) and self.rps >= 0) or self.burst < 0 or self.tpm < 0:
            raise ValueError("rate limits must be finite and >= 0")
        if self.burst == 0 and self.rps > 0:
            object.__setattr__(self, "burst", max(1, math.ceil(self.rps)))

    @property
    def enabled(self) -> bool:
        return self.rps > 0 or self.tpm > 0

    def with_overrides(self, overrides: Iterable[tuple[str, float]]) -> RateLimits:
        given = dict(overrides)
        values = {"rps": self.rps, "burst": self.burst, "tpm": self.tpm, **given}
        if "rps" in given and "burst" not in given:
            values["burst"] = 0  # derived from the key's own rps
        return RateLimits(**values)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_id: str  # what logs and metrics show; never the key
    key: str = field(repr=False)
    # Per-key rate limits (rps, burst, tpm) over the gateway's --rate-limit-* defaults.
    overrides: tuple[tuple[str, float], ...] = ()
    priority: int = 0  # the key's requests' priority when they name none (lower is first)
    # Fair share: a key with a weight has its own queue per priority, and the queues of one
    # priority get tokens in proportion to their weights. Without one, its requests share the
    # priority's common queue (weight 1) with every other key without one.
    weight: int | None = None
    # `role=admin` in the keys file: it may also load and unload LoRA adapters at runtime
    # (with --enable-lora-runtime-updates). A key without a role is a plain one.
    admin: bool = False


def derived_key_id(key: str) -> str:
    """A short, non-reversible id for a key given without one: the first 8 hex of its sha256."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


def parse_api_keys(entries: Iterable[str], source: str) -> list[ApiKey]:
    """One key per entry: `KEY` or `ID:KEY`, then optional `rps=N burst=N tpm=N` overrides, a
    default `priority=N`, a fair-share `weight=N` and `role=admin` (or `role=user`, the default).

    Blank entries and `#` comments are skipped. Errors name the entry's position, never its
    text (it holds a secret)."""
    keys = []
    for n, entry in enumerate(entries, 1):
        words = entry.split()
        if not words or words[0].startswith("#"):
            continue
        head, *options = words
        key_id, sep, key = head.partition(":")
        if not sep:
            key_id, key = derived_key_id(head), head
        elif not KEY_ID.fullmatch(key_id):
            raise ValueError(f"{source} entry {n}: the id before ':' must match {KEY_ID.pattern}")
        if not key:
            raise ValueError(f"{source} entry {n}: empty key")
        where = f"{source} entry {n}"
        roles = [o.partition("=")[2] for o in options if o.startswith("role=")]
        if len(roles) > 1 or any(r not in ROLES for r in roles):
            raise ValueError(f"{where}: role must be one of {', '.join(ROLES)} (at most once)")
        values = _options([o for o in options if not o.startswith("role=")], where)
        priority = int(values.pop("priority", 0))
        if priority not in PRIORITIES:
            raise ValueError(f"{where}: priority must be in [{PRIORITIES[0]}, {PRIORITIES[-1]}]")
        weight = None if "weight" not in values else int(values.pop("weight"))
        if weight is not None and not 1 <= weight <= MAX_WEIGHT:
            raise ValueError(f"{where}: weight must be in [1, {MAX_WEIGHT}]")
        RateLimits(**values)  # type: ignore[arg-type]  # checks the values now, not per request
        admin = roles == ["admin"]
        keys.append(ApiKey(key_id, key, tuple(values.items()), priority, weight, admin))
    return keys


_OPTIONS = ("rps", "burst", "tpm", "priority", "weight")
ROLES = ("user", "admin")
MAX_WEIGHT = 1000


def _options(options: list[str], where: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for option in options:
        name, _, value = option.partition("=")
        if name not in _OPTIONS or name in values:
            raise ValueError(
                f"{where}: options are rps=N, burst=N, tpm=N, priority=N, weight=N, "
                "role=user|admin (each at most once)"
            )
        try:
            values[name] = float(value) if name == "rps" else int(value)
        except ValueError:
            raise ValueError(f"{where}: {name} must be a number") from None
    return values


def parse_reasoning_parsers(value: str) -> tuple[tuple[str, str], ...]:
    """`--reasoning-parser`: `NAME` (every model) and/or `MODEL=NAME` entries, comma-separated;
    as (model, parser) pairs, "" for every model not named."""
    pairs = []
    for entry in filter(None, (e.strip() for e in value.split(","))):
        model, _, name = entry.rpartition("=")
        pairs.append((model, name))
    return tuple(pairs)


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
    # Prompts in one /v1/completions list (each is a queue entry of its own); more is a 400.
    max_prompts_per_request: int = 128
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
    # After SIGTERM: open requests get this long to finish while /ready and new requests answer
    # 503 (a rolling update); what is still open then is cancelled (workers free its slots).
    shutdown_timeout_s: float = 30.0
    # Scale to zero: accept (queue) requests for a published model while no worker is live, and
    # be ready with Redis alone, so an autoscaler watching the queue can start the first worker.
    queue_without_workers: bool = False
    # Bearer keys; empty: no auth. /health and /ready are always public.
    api_keys: tuple[ApiKey, ...] = ()
    # Serve /metrics on this port only, without auth (None: on the main port, behind auth).
    metrics_port: int | None = None
    rate_limits: RateLimits = field(default_factory=RateLimits)
    max_header_line_bytes: int = MAX_HEADER_LINE_BYTES
    max_headers: int = MAX_HEADERS
    # Batch API. Uploads (POST /v1/files) may be this large, with at most this many lines.
    max_file_bytes: int = 100 * MiB
    batch_max_lines: int = 50_000
    # Pacing: this gateway starts a batch line only while fewer than this many entries (of any
    # kind) wait unread in the request stream, so an interactive request arriving never queues
    # behind more than a few batch lines (the stream is FIFO; priorities act once read).
    batch_max_queued: int = 4
    # Batch lines this gateway runs at once (0: this gateway runs none).
    batch_concurrency: int = 64
    # A claimed line's lease, renewed while it runs: a dead gateway's lines run again after it.
    batch_lease_s: float = 30.0
    # How often an idle runner looks for batches with work (busy: every BATCH_TICK_S).
    batch_poll_s: float = 1.0
    # Prefix-aware placement: enqueue a request on the worker whose prefix cache holds most of
    # its prompt, unless that worker is much busier (gateway/serving/placement.py).
    prefix_placement: bool = PLACEMENT_DEFAULT
    # Responses API: a stored response (store: true, the default) expires after this long, and
    # one whose record (response and conversation) is larger than this is not stored.
    responses_ttl_s: float = 24 * 3600.0
    responses_max_bytes: int = 4 * MiB
    # Reasoning parsers (generation.reasoning): (model, parser name) pairs, model "" for every
    # model not named; a model without one has its output returned unsplit.
    reasoning_parsers: tuple[tuple[str, str], ...] = ()
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), for admin keys only
    # (with no keys they stay off), reading adapters only under `lora_root`.
    enable_lora_runtime_updates: bool = False
    lora_root: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.metrics_port is not None and (
            not 0 < self.metrics_port < 65536 or self.metrics_port == self.port
        ):
            raise ValueError(f"metrics port must be in 1..65535 and not {self.port}")
        ids = [k.key_id for k in self.api_keys]
        if len(set(ids)) != len(ids):
            raise ValueError("API key ids must be unique")
        if len({k.key for k in self.api_keys}) != len(self.api_keys):
            raise ValueError("the same API key is configured twice")
        if not self.gateway_id or any(c.isspace() for c in self.gateway_id):
            raise ValueError(f"gateway id must be non-empty without spaces: {self.gateway_id!r}")
        if not self.key_prefix:
            raise ValueError("key prefix must be non-empty")
        for name in (
            "max_body_bytes",
            "max_queue_len",
            "max_queued_tokens",
            "max_prompts_per_request",
            "retry_after_s",
            "max_file_bytes",
            "batch_max_lines",
            "batch_max_queued",
            "responses_max_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_concurrency < 0:
            raise ValueError(f"batch concurrency must be >= 0, got {self.batch_concurrency}")
        if self.batch_lease_s <= 0 or self.batch_poll_s <= 0:
            raise ValueError("batch lease and poll interval must be > 0")
        if not self.responses_ttl_s > 0:
            raise ValueError(f"responses TTL must be > 0, got {self.responses_ttl_s}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"request timeout must be > 0, got {self.request_timeout}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown timeout must be >= 0, got {self.shutdown_timeout_s}")
        if self.chat_default_max_tokens < 1 or self.completion_default_max_tokens < 1:
            raise ValueError("default max_tokens must be >= 1")
        models = [model for model, _ in self.reasoning_parsers]
        if len(set(models)) != len(models):
            raise ValueError("a model is given two reasoning parsers")
        for _, name in self.reasoning_parsers:
            reasoning_format(name)  # a ValueError naming the known parsers
        if self.enable_lora_runtime_updates and not self.lora_root:
            raise ValueError("--enable-lora-runtime-updates needs --lora-root (where adapters lie)")
        if self.reply_block_ms / 1000 >= self.redis_timeout_s:
            raise ValueError(
                f"reply block ({self.reply_block_ms} ms) must be shorter than the Redis socket "
                f"timeout ({self.redis_timeout_s} s), or every idle XREAD times out"
            )

    def reasoning_format(self, model: str) -> ReasoningFormat | None:
        """The reasoning parser of `model`'s output (None: its output is not split)."""
        parsers = dict(self.reasoning_parsers)
        name = parsers.get(model, parsers.get(""))
        return None if name is None else reasoning_format(name)

    def limits_for(self, key: ApiKey | None) -> RateLimits:
        return self.rate_limits.with_overrides(key.overrides) if key else self.rate_limits

    @property
    def rate_limited(self) -> bool:
        return any(self.limits_for(k).enabled for k in (None, *self.api_keys))
