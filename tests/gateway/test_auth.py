"""API keys against live `jitney gateway` processes: every route but /health and /ready needs a
key, 401s are OpenAI bodies with WWW-Authenticate, key ids (never keys) reach metrics and logs,
/metrics can move to its own port, and secrets are redacted from logs."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from gateway.config import ApiKey, GatewayConfig, RateLimits, parse_api_keys
from gateway.http.auth import RedactSecrets
from tests.gateway.helpers import (
    LiveGateway,
    MakeClient,
    assert_openai_error,
    http,
    start_gateway,
)
from tests.services import JitneyProcess, RedisServer, free_port, wait_for

ALICE = "KEY-alice-0f9e8d7c6b5a"
BOB = "KEY-bob-1a2b3c4d5e6f"
ANON = "KEY-anon-99887766"  # given without an id: its id is derived
ANON_ID = hashlib.sha256(ANON.encode()).hexdigest()[:8]
SECRETS = (ALICE, BOB, ANON)


def auth(key: str, scheme: str = "Bearer") -> dict[str, str]:
    return {"Authorization": f"{scheme} {key}"}


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text(f"# comment\n\nbob:{BOB} rps=100\n{ANON}\n")
    return path


@pytest.fixture
def gateway(redis_server: RedisServer, keys_file: Path) -> Iterator[LiveGateway]:
    """Keys from the environment and from a file; DEBUG logs (one line per request)."""
    env = {"JITNEY_API_KEYS": f"alice:{ALICE}", "JITNEY_API_KEYS_FILE": str(keys_file)}
    gw = start_gateway(redis_server, "--log-level", "DEBUG", env=env)
    yield gw
    gw.proc.stop()


def assert_401(status: int, headers: dict[str, str], body: bytes, missing: bool) -> None:
    assert status == 401
    assert headers["WWW-Authenticate"] == "Bearer"
    out = json.loads(body)
    assert_openai_error(out)
    assert out["error"]["code"] == "invalid_api_key"
    assert out["error"]["type"] == "invalid_request_error"
    assert ("Missing" in out["error"]["message"]) is missing
    assert not any(s in body.decode() for s in SECRETS)


# (headers, reported as missing rather than invalid)
WRONG = [
    (auth(ALICE[:-1]), False),
    (auth(ALICE + "x"), False),
    (auth(ALICE.upper()), False),
    (auth(f"{BOB},{ALICE}"), False),
    (auth(ALICE, "Basic"), True),
    ({"Authorization": ALICE}, True),
    (auth(""), True),
    ({"X-Api-Key": ALICE}, True),
]


def test_every_route_but_health_and_ready_needs_a_key(gateway: LiveGateway) -> None:
    """No key or a wrong one: 401 on /v1/*, /metrics and unknown routes; public probes open."""
    base = gateway.base
    assert http(f"{base}/health")[0] == 200
    assert http(f"{base}/ready")[0] == 503  # no worker, but not a 401
    body = json.dumps({"prompt": "hi"}).encode()
    for method, path in [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/metrics"),
        ("GET", "/no/such/route"),
    ]:
        data = body if method == "POST" else None
        assert_401(*http(base + path, method, data), missing=True)
        for headers, missing in WRONG:
            assert_401(*http(base + path, method, data, headers), missing=missing)
    # The right keys, from the environment, the file, with an id and without; scheme in any case.
    for key in (ALICE, BOB, ANON):
        assert http(f"{base}/v1/models", headers=auth(key))[0] == 200
    assert http(f"{base}/v1/models", headers=auth(ALICE, "bearer"))[0] == 200
    status, _, out = http(f"{base}/v1/completions", "POST", b"{", auth(ALICE))
    assert status == 400 and json.loads(out)["error"]["code"] == "invalid_json"


def test_key_ids_in_metrics_and_logs_never_keys(gateway: LiveGateway) -> None:
    """jitney_api_key_requests_total{key_id,status} counts per key id (derived for a key given
    without one); 401s count by reason; no key appears in /metrics or in the log."""
    base = gateway.base
    for _ in range(2):
        http(f"{base}/v1/models", headers=auth(ALICE))
    http(f"{base}/v1/models", headers=auth(ANON))
    http(f"{base}/v1/models", headers=auth("KEY-wrong"))
    http(f"{base}/v1/models")
    status, _, raw = http(f"{base}/metrics", headers=auth(BOB))
    assert status == 200
    text = raw.decode()
    assert 'jitney_api_key_requests_total{key_id="alice",status="200"} 2.0' in text
    assert f'jitney_api_key_requests_total{{key_id="{ANON_ID}",status="200"}} 1.0' in text
    assert 'jitney_auth_failures_total{reason="invalid"} 1.0' in text
    assert 'jitney_auth_failures_total{reason="missing"} 1.0' in text
    assert 'jitney_http_requests_total{route="/v1/models",status="401"} 2.0' in text
    gateway.proc.stop()
    log = gateway.proc.output()
    assert "key_id=alice" in log and f"key_id={ANON_ID}" in log and "ids alice,bob," in log
    for secret in (*SECRETS, "KEY-wrong"):
        assert secret not in text and secret not in log


def test_metrics_port_serves_metrics_alone_without_auth(
    redis_server: RedisServer, keys_file: Path
) -> None:
    """--metrics-port: /metrics there without a key (and nothing else); gone from the API port."""
    metrics_port = free_port()
    gw = start_gateway(
        redis_server, "--api-keys-file", str(keys_file), "--metrics-port", str(metrics_port)
    )
    try:
        http(f"{gw.base}/v1/models", headers=auth(BOB))
        status, headers, raw = http(f"http://127.0.0.1:{metrics_port}/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain")
        assert 'jitney_api_key_requests_total{key_id="bob",status="200"} 1.0' in raw.decode()
        assert http(f"http://127.0.0.1:{metrics_port}/v1/models")[0] == 404
        assert_401(*http(f"{gw.base}/metrics"), missing=True)
        assert http(f"{gw.base}/metrics", headers=auth(BOB))[0] == 404
    finally:
        gw.proc.stop()


def test_bad_keys_file_stops_start_without_printing_keys(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """An unusable keys file: exit code 2, the entry named by position, the key never shown."""
    for content in (f"bad id!:{ALICE}\n", f"a:{ALICE}\na:{BOB}\n", f"a:{ALICE} rps=x\n"):
        path = tmp_path / "keys"
        path.write_text(content)
        args = ["gateway", "--port", str(free_port()), "--api-keys-file", str(path)]
        proc = JitneyProcess(args, {"REDIS_URL": redis_server.url})
        wait_for(lambda proc=proc: not proc.alive(), 60, "gateway to refuse its keys")
        assert proc.proc.returncode != 0
        output = proc.output()
        assert ALICE not in output and BOB not in output
        assert "entry" in output or "unique" in output


def test_redis_password_is_not_logged(redis_server: RedisServer) -> None:
    """A REDIS_URL password never reaches the log, even when Redis refuses it."""
    password = "PASSWORD-5e2d"
    url = f"redis://:{password}@127.0.0.1:{redis_server.port}/0"
    gw = start_gateway(redis_server, "--log-level", "DEBUG", env={"REDIS_URL": url})
    try:
        http(f"{gw.base}/ready")
        http(f"{gw.base}/v1/completions", "POST", b'{"prompt": "hi"}')
    finally:
        gw.proc.stop()
    assert password not in gw.proc.output()


def test_parse_api_keys_forms() -> None:
    """KEY, ID:KEY, options; a key with ':' needs an id; ids are checked."""
    keys = parse_api_keys(["k1", "ops:k:2 tpm=100 rps=2", " ", "# c"], "test")
    assert [(k.key_id, k.key) for k in keys] == [
        (hashlib.sha256(b"k1").hexdigest()[:8], "k1"),
        ("ops", "k:2"),
    ]
    limits = GatewayConfig(api_keys=tuple(keys), rate_limits=RateLimits(rps=10, tpm=5)).limits_for
    assert limits(keys[0]) == RateLimits(rps=10, burst=10, tpm=5)  # the defaults
    assert limits(keys[1]) == RateLimits(rps=2, burst=2, tpm=100)  # burst follows its own rps
    assert "k:2" not in repr(keys[1])  # the key is not in the repr (configs get logged)
    for bad in ["ops:", "b@d:SEKRIT", "a:SEKRIT tpm=", "a:SEKRIT nope=1", "a:SEKRIT rps=1 rps=2"]:
        with pytest.raises(ValueError, match="entry 2") as e:
            parse_api_keys(["# first", bad], "test")
        assert "SEKRIT" not in str(e.value)


def test_redact_filter_scrubs_messages_and_tracebacks() -> None:
    """The log filter replaces secrets in formatted messages and exception text."""
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "key=%s", (ALICE,), None)
    try:
        raise RuntimeError(BOB)
    except RuntimeError:
        import sys

        record.exc_info = sys.exc_info()
    RedactSecrets([ALICE, BOB, ""]).filter(record)
    formatted = logging.Formatter().format(record)
    assert ALICE not in formatted and BOB not in formatted and "[redacted]" in formatted


async def test_no_keys_means_open_routes(served: Any, make_client: MakeClient) -> None:
    """Without keys nothing asks for one (the in-process app, as every other test runs it)."""
    client: TestClient[Any, Any] = await make_client()
    assert (await client.get("/v1/models")).status == 200
    assert (await client.get("/metrics")).status == 200


async def test_keys_in_process_config(served: Any, make_client: MakeClient) -> None:
    """GatewayConfig(api_keys=...) alone turns auth on; /health stays public."""
    client: TestClient[Any, Any] = await make_client(api_keys=(ApiKey("a", ALICE),))
    assert (await client.get("/health")).status == 200
    response = await client.get("/v1/models")
    assert response.status == 401 and response.headers["WWW-Authenticate"] == "Bearer"
    assert (await client.get("/v1/models", headers=auth(ALICE))).status == 200
