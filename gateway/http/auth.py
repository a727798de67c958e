"""Bearer API keys: who is calling, checked in constant time, and secrets kept out of logs.

Every route needs `Authorization: Bearer <key>` once keys are configured, except PUBLIC_PATHS
(probes must work without secrets; the live view's data-free page). A request's identity
(`Client`) is stored on the request for the rate limiter, the metrics (key id label) and the
logs; the key itself is never stored.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.config import ApiKey, GatewayConfig, RateLimits
from gateway.openai.errors import ApiError
from gateway.serving.gateway_metrics import GatewayMetrics

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# /ui is the live view's static page (no data: a browser cannot send a key when it navigates;
# the page sends one for /ui/events, which is behind the keys like every other route).
PUBLIC_PATHS = frozenset({"/health", "/ready", "/ui"})
_SCHEME = "bearer"


@dataclass(frozen=True, slots=True)
class Client:
    key_id: str | None  # the API key's id; None when the gateway has no keys
    bucket: str  # the rate-limit bucket: the key id, or "ip:<address>" without keys
    limits: RateLimits
    priority: int = 0  # its requests' priority when they name none
    weight: int | None = None  # its fair-share weight (ApiKey.weight)
    admin: bool = False  # its key has role=admin (ApiKey.admin)


CLIENT: web.RequestKey[Client] = web.RequestKey("jitney_client", Client)


class Authenticator:
    """Compares a presented key with every configured key, in time that does not depend on
    which key (if any) matched or how much of it: each comparison is `hmac.compare_digest` of
    two SHA-256 digests (equal lengths, so the key's length leaks nothing either)."""

    def __init__(self, keys: Iterable[ApiKey]):
        self._digests = [(k, hashlib.sha256(k.key.encode()).digest()) for k in keys]

    def identify(self, presented: str) -> ApiKey | None:
        try:
            # aiohttp decodes header bytes as UTF-8 with surrogateescape; this undoes it.
            digest = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
        except UnicodeEncodeError:
            return None
        found = None
        for key, expected in self._digests:
            if hmac.compare_digest(digest, expected):
                found = key  # no break: every key is compared, whichever matches
        return found


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == _SCHEME and token else None


def unauthorized(missing: bool) -> ApiError:
    message = (
        "Missing API key: send it as 'Authorization: Bearer <key>'."
        if missing
        else "Invalid API key."
    )
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def auth_middleware(config: GatewayConfig, metrics: GatewayMetrics) -> Middleware:
    """Stores the request's Client; with keys configured, refuses non-public routes without a
    valid key (401). Without keys every client is anonymous, rate-limited by its IP."""
    authenticator = Authenticator(config.api_keys) if config.api_keys else None
    limits = {k.key_id: config.limits_for(k) for k in config.api_keys}

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if authenticator is None:
            request[CLIENT] = Client(None, f"ip:{request.remote}", config.rate_limits)
        elif request.path not in PUBLIC_PATHS:
            token = bearer_token(request.headers.get("Authorization"))
            key = authenticator.identify(token) if token is not None else None
            if key is None:
                reason = "missing" if token is None else "invalid"
                metrics.auth_failures.labels(reason).inc()
                raise unauthorized(missing=token is None)
            request[CLIENT] = Client(
                key.key_id, key.key_id, limits[key.key_id], key.priority, key.weight, key.admin
            )
        return await handler(request)

    return authenticate


class RedactSecrets(logging.Filter):
    """Replaces every configured secret (API keys, the Redis password) in a log record, should
    one ever reach a message or a traceback. Attach to the handlers (filters on a logger do
    not see records propagated from child loggers)."""

    def __init__(self, secrets: Iterable[str]):
        super().__init__()
        self.secrets = sorted({s for s in secrets if s}, key=len, reverse=True)

    def _redact(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "[redacted]")
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secrets:
            return True
        record.msg = self._redact(record.getMessage())
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self._redact(record.exc_text)
        return True
