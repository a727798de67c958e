"""Malformed HTTP on a raw socket, against a live `jitney gateway`: too many or too large headers
get a 431, a garbled request line a 400, each with an OpenAI error body that quotes nothing,
nothing in the log, and the gateway keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from gateway.config import MAX_HEADER_LINE_BYTES, MAX_HEADERS
from tests.gateway.helpers import (
    REQUESTS,
    LiveGateway,
    assert_openai_error,
    http,
    parse_raw_response,
    raw_http,
    start_gateway,
)
from tests.services import RedisServer

SECRET = "SECRET-b71c"


@pytest.fixture
def gateway(redis_server: RedisServer) -> Iterator[LiveGateway]:
    gw = start_gateway(redis_server, "--api-keys", "ops:KEY-" + SECRET, "--log-level", "DEBUG")
    yield gw
    gw.proc.stop()


def request(
    port: int, headers: list[str], start_line: str = "POST /v1/completions HTTP/1.1"
) -> bytes:
    body = json.dumps({"prompt": SECRET}).encode()
    head = [start_line, f"Host: 127.0.0.1:{port}", *headers, f"Content-Length: {len(body)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def answer(gateway: LiveGateway, data: bytes) -> tuple[int, dict[str, str], str]:
    status, headers, body = parse_raw_response(raw_http(gateway.port, data))
    text = body.decode()
    assert SECRET not in text
    assert_openai_error(json.loads(text))
    assert headers["content-type"].startswith("application/json")
    return status, headers, text


CASES = [
    ("too many headers", [f"X-Junk-{i}: {SECRET}" for i in range(MAX_HEADERS + 10)], 431),
    ("one huge header", [f"X-Big: {SECRET}{'a' * (MAX_HEADER_LINE_BYTES + 10)}"], 431),
    ("huge Authorization", [f"Authorization: Bearer KEY-{SECRET}{'b' * 20_000}"], 431),
    ("huge header name", [f"X-{SECRET}{'n' * (MAX_HEADER_LINE_BYTES + 10)}: v"], 431),
    ("bad header line", [f"{SECRET} no colon here"], 400),
]


@pytest.mark.parametrize(("case", "headers", "status"), CASES, ids=[c[0] for c in CASES])
def test_header_limits_get_a_json_4xx(
    gateway: LiveGateway,
    redis_server: RedisServer,
    case: str,
    headers: list[str],
    status: int,
) -> None:
    """Over aiohttp's header limits: 431 (or 400 for garbage), an OpenAI body, nothing echoed,
    nothing logged of the header, nothing enqueued, and the gateway still serves."""
    got, _, _ = answer(gateway, request(gateway.port, headers))
    assert got == status, case
    assert gateway.proc.alive()
    assert http(f"{gateway.base}/health")[0] == 200
    assert SECRET not in gateway.proc.output()
    assert redis_server.client().xlen(REQUESTS) == 0


def test_garbled_request_lines_get_400(gateway: LiveGateway) -> None:
    """A request line that is not HTTP, or a URL longer than the line limit."""
    status, _, _ = answer(gateway, f"{SECRET} / HTTP/1.1\r\n\r\n".encode())
    assert status == 400
    long_url = f"POST /v1/{SECRET}{'u' * (MAX_HEADER_LINE_BYTES + 10)} HTTP/1.1"
    status, _, _ = answer(gateway, request(gateway.port, [], start_line=long_url))
    assert status in (414, 431)
    assert http(f"{gateway.base}/health")[0] == 200


def test_announced_huge_body_is_refused_unread(gateway: LiveGateway) -> None:
    """Content-Length over --max-body-bytes: 413 at once, before the body is sent."""
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer KEY-" + SECRET + "\r\n"
        "Content-Type: application/json\r\nContent-Length: 10000000000\r\n\r\n"
    )
    status, _, _ = answer(gateway, head.encode())
    assert status == 413
