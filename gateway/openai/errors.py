"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}`.

Messages are written by us, never built from the request body: an error must not echo input back
(a 100 MB prompt must not come back as a 100 MB error).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

INVALID_REQUEST = "invalid_request_error"


class ApiError(Exception):
    """Raised anywhere in a handler; the error middleware turns it into the JSON body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return web.json_response(
            self.body(), status=self.status, headers=self.headers, dumps=_dumps
        )


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def model_not_found(name: str) -> ApiError:
    # The name is not repeated: an error never echoes input (GET /v1/models lists the names).
    return ApiError(
        404,
        "The requested model does not exist or no live worker serves it; see GET /v1/models.",
        param="model",
        code="model_not_found",
    )


def shutting_down() -> ApiError:
    return ApiError(
        503,
        "This gateway is shutting down; retry the request.",
        type="service_unavailable",
        code="shutting_down",
        headers={"Retry-After": "1", "Connection": "close"},
    )


def redis_unavailable() -> ApiError:
    return ApiError(
        503,
        "The request queue (Redis) is unavailable; retry shortly.",
        type="service_unavailable",
        code="queue_unavailable",
        headers={"Retry-After": "1"},
    )


def internal_error() -> ApiError:
    return ApiError(500, "Internal server error.", type="server_error", code="internal_error")
