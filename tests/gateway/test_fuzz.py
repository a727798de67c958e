"""Property-based fuzzing of a LIVE `jitney gateway` (real Redis, a thread playing the worker).

At least 2,000 generated bodies: valid-shaped with bad (or good) values, random JSON, random
bytes, deep nesting, huge numbers and bodies, unicode with lone surrogates. Over all of them:
no 5xx, the process stays up, every 4xx is an OpenAI error body that quotes nothing of the
input, and the request stream holds exactly one entry per accepted (200) request's prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from http.client import HTTPConnection
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import ModelCard
from tests.gateway.helpers import (
    AnsweringWorker,
    LiveGateway,
    assert_openai_error,
    enqueued_total,
    http,
    publish_card,
    start_gateway,
)
from tests.services import RedisServer, wait_for

SECRET = "SECRET-d4e5"  # planted in every string a body carries; no error may repeat it
MAX_BODY = 65_536
EXAMPLES = 2_000
# A 200 there is one queue entry per prompt (per input: embeddings).
ENQUEUING = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses")
ROUTES = (*ENQUEUING, "/tokenize", "/detokenize")


@dataclass
class Live:
    server: RedisServer
    gateway: LiveGateway
    worker: AnsweringWorker


@pytest.fixture(scope="module")
def live(card: ModelCard) -> Iterator[Live]:
    server = RedisServer().start()
    r = server.client()
    publish_card(r, replace(card, embedding_size=4))  # the answering worker's vectors' size
    worker = AnsweringWorker(r).__enter__()
    # A reasoning parser: chat and Responses answers ("ok") go through the reasoning split.
    flags = ("--max-body-bytes", str(MAX_BODY), "--reasoning-parser", "deepseek_r1")
    gateway = start_gateway(server, *flags)

    def ready() -> bool:
        assert gateway.proc.alive(), gateway.proc.output()
        return http(f"{gateway.base}/ready")[0] == 200

    try:
        wait_for(ready, 60, "gateway ready")
        yield Live(server, gateway, worker)
    finally:
        gateway.proc.stop()
        worker.__exit__()
        server.close()


# --- strategies ---------------------------------------------------------------------------------

marked = st.text(max_size=30).map(lambda s: SECRET + s)
surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1)
unicode = st.one_of(
    marked,
    st.text(st.characters(exclude_categories=[]), max_size=30).map(lambda s: SECRET + s),
    st.tuples(marked, surrogates).map("".join),
)
huge_int = st.integers(min_value=-(10**40), max_value=10**40)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 100), huge_int, st.floats(), marked, unicode
)
random_json = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(marked, inner, max_size=4),
    max_leaves=12,
)
token_ids = st.lists(st.integers(-3, 300) | huge_int, max_size=12)
prompt = st.one_of(
    marked,
    unicode,
    st.just(""),
    token_ids,
    st.lists(marked, max_size=3),
    st.lists(token_ids, max_size=3),
    st.text(min_size=100, max_size=400).map(lambda s: SECRET + s),  # over the context window
    random_json,
)
number = st.one_of(st.none(), st.floats(-2, 3), st.integers(-3, 5), st.floats(), huge_int, marked)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", SECRET])},
    optional={
        "content": st.one_of(
            unicode,
            st.none(),
            st.integers(),
            st.lists(
                st.fixed_dictionaries({"type": st.sampled_from(["text", SECRET]), "text": unicode}),
                max_size=3,
            ),
        ),
        "name": unicode | st.integers(),
        "reasoning_content": unicode | random_json,
    },
)
sampling: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(st.just("tiny"), marked, unicode, st.integers(), st.just("")),
    "max_tokens": st.one_of(st.integers(-2, 80), huge_int, st.floats(), marked, st.booleans()),
    "max_completion_tokens": st.integers(-2, 80) | huge_int,
    "temperature": number,
    "top_p": number,
    "top_k": st.integers(-3, 100) | huge_int | marked,
    "seed": huge_int | st.floats() | marked,
    "n": st.integers(-1, 3),
    "stop": st.one_of(
        marked,
        unicode,
        st.lists(unicode, max_size=20),
        st.text(min_size=250, max_size=300),
        st.lists(st.just(""), max_size=2),
        st.integers(),
    ),
    "stop_token_ids": st.lists(st.integers(-1, 500) | huge_int, max_size=300) | marked,
    "ignore_eos": st.booleans() | marked,
    "stream": st.booleans() | marked | st.none(),
    "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans() | marked}),
    "logprobs": st.booleans() | st.integers(0, 3),
    "echo": st.booleans(),
    "tools": st.just([]) | random_json,
    "response_format": st.just({"type": "text"}) | random_json,
    "presence_penalty": number,
    "frequency_penalty": number,
    "repetition_penalty": number,
    "logit_bias": st.dictionaries(st.integers(-1, 400).map(str) | marked, number, max_size=4)
    | random_json,
    "min_tokens": st.integers(-2, 80) | marked,
    "prediction": st.one_of(
        random_json,
        st.fixed_dictionaries(
            {"type": st.sampled_from(["content", SECRET])},
            optional={
                "content": st.one_of(
                    unicode,
                    st.text(min_size=100, max_size=400).map(lambda s: SECRET + s),
                    st.lists(
                        st.fixed_dictionaries(
                            {"type": st.sampled_from(["text", SECRET]), "text": unicode}
                        ),
                        max_size=3,
                    ),
                    random_json,
                )
            },
        ),
    ),
    # /tokenize and /detokenize
    "add_special_tokens": st.booleans() | marked,
    "return_token_strs": st.booleans() | st.integers(),
    "add_generation_prompt": st.booleans() | marked,
    "continue_final_message": st.booleans() | marked,
    "chat_template_kwargs": st.dictionaries(marked, random_json, max_size=3) | random_json,
    "tokens": token_ids | random_json,
    # /v1/embeddings
    "encoding_format": st.sampled_from(["float", "base64", SECRET]) | random_json,
    "dimensions": st.integers(-2, 6) | huge_int | marked | st.floats(),
    "user": unicode | st.integers() | st.none(),
    "normalize": st.booleans() | marked,
    SECRET: random_json,
}
completion = st.fixed_dictionaries({"prompt": prompt}, optional=sampling)
chat = st.fixed_dictionaries(
    {"messages": st.lists(message, max_size=4) | random_json}, optional=sampling
)

# Mostly good values, so the later checks (model lookup, context window, enqueueing) run too.
good = {
    "model": st.sampled_from(["tiny", SECRET]),
    "max_tokens": st.integers(1, 70),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "stop": st.lists(marked, max_size=3),
    "stream": st.booleans(),
    "seed": st.integers(0, 2**32),
    "prediction": st.fixed_dictionaries({"type": st.just("content"), "content": unicode}),
}
good_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]), "content": unicode}
)
prompts = st.lists(unicode, min_size=2, max_size=3) | st.lists(token_ids, min_size=2, max_size=3)
plausible = st.fixed_dictionaries({"prompt": unicode | token_ids | prompts}, optional=good) | (
    st.fixed_dictionaries(
        {"messages": st.lists(good_message, min_size=1, max_size=3)}, optional=good
    )
)
detokenizable = st.fixed_dictionaries({"tokens": token_ids}, optional=good)
embedding = st.fixed_dictionaries({"input": prompt}, optional=sampling)
embeddable = st.fixed_dictionaries(
    {"input": unicode | token_ids | prompts},
    optional={**good, "encoding_format": st.sampled_from(["float", "base64"])},
)
# /v1/responses: input items of every type (and others), the API's own fields
input_item = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            ["message", "function_call", "function_call_output", "reasoning", SECRET]
        )
    },
    optional={
        "role": st.sampled_from(["user", "assistant", "developer", SECRET]),
        "content": unicode | st.lists(random_json, max_size=2),
        "call_id": unicode | st.integers(),
        "name": unicode,
        "arguments": unicode | random_json,
        "output": unicode | random_json,
        "encrypted_content": st.none() | unicode,
        "summary": random_json,
    },
)
responses_fields: dict[str, st.SearchStrategy[Any]] = {
    "instructions": unicode | random_json,
    "max_output_tokens": st.integers(-2, 80) | huge_int | marked,
    "text": st.fixed_dictionaries(
        {
            "format": st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "json_object", "json_schema", SECRET])},
                optional={"schema": random_json, "name": unicode, "strict": st.booleans()},
            )
        }
    )
    | random_json,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | random_json,
    "store": st.booleans() | marked,
    "previous_response_id": marked | st.just("resp_" + "0" * 32),
    "metadata": st.dictionaries(marked, unicode, max_size=3) | random_json,
    "background": st.booleans() | marked,
    "truncation": st.sampled_from(["auto", "disabled"]) | marked,
    "include": random_json,
}
responses = st.fixed_dictionaries(
    {"input": st.lists(input_item, max_size=3) | unicode | random_json},
    optional={**sampling, **responses_fields},
)
answerable = st.fixed_dictionaries(
    {"input": unicode | st.lists(good_message, min_size=1, max_size=2)},
    optional={
        **{k: v for k, v in good.items() if k != "max_tokens"},
        "max_output_tokens": st.integers(1, 30),
        "store": st.booleans(),
    },
)


def encode(obj: Any, ascii_only: bool) -> bytes:
    # surrogatepass: a lone surrogate becomes invalid UTF-8 bytes when not escaped as \\uD800
    return json.dumps(obj, ensure_ascii=ascii_only, allow_nan=True).encode("utf-8", "surrogatepass")


def num_entries(body: bytes, route: str) -> int:
    """Queue entries of an accepted request: one per prompt (input) of a list."""
    prompt = json.loads(body).get("input" if route == "/v1/embeddings" else "prompt")
    several = isinstance(prompt, list) and all(isinstance(p, str | list) for p in prompt)
    return len(prompt) if several and len(prompt) > 1 else 1


shaped = st.builds(
    encode,
    st.one_of(
        completion,
        chat,
        plausible,
        plausible,
        detokenizable,
        embedding,
        embeddable,
        responses,
        answerable,
        answerable,
        random_json,
    ),
    st.booleans(),
)
bodies = st.one_of(
    shaped,
    shaped,
    shaped,
    st.binary(max_size=300),
    st.builds(lambda d: b"[" * d, st.integers(1, 200_000)),  # nesting past the recursion limit
    st.builds(
        lambda d: b'{"prompt": "x", "tools": ' + b"[" * d + b"]" * d + b"}", st.integers(500, 5_000)
    ),
    st.builds(
        lambda n: b'{"prompt": "x", "max_tokens": ' + b"9" * n + b"}", st.integers(4_000, 6_000)
    ),  # more digits than Python parses
    st.builds(
        lambda n: json.dumps({"prompt": SECRET + "a" * n}).encode(),
        st.integers(MAX_BODY, 4 * MAX_BODY),
    ),  # over --max-body-bytes
    st.builds(lambda s: s.encode("utf-16"), st.just('{"prompt": "' + SECRET + '"}')),
)


# --- the property -------------------------------------------------------------------------------


@dataclass
class Tally:
    sent: int = 0
    accepted: int = 0
    statuses: dict[int, int] = field(default_factory=dict)


class Client:
    """One keep-alive connection (http.client reconnects when the server says it will close)."""

    def __init__(self, port: int):
        self.conn = HTTPConnection("127.0.0.1", port, timeout=60)

    def post(self, route: str, body: bytes) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"}
        self.conn.request("POST", route, body=body, headers=headers)
        response = self.conn.getresponse()
        return response.status, response.read()


def test_fuzzed_bodies_never_crash_and_never_enqueue_rejects(live: Live) -> None:
    tally = Tally()
    client = Client(live.gateway.port)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(route=st.sampled_from(ROUTES), body=bodies)
    def send(route: str, body: bytes) -> None:
        status, raw = client.post(route, body)
        tally.sent += 1
        tally.statuses[status] = tally.statuses.get(status, 0) + 1
        assert status < 500, (status, raw[:300], body[:300])
        if status == 200:
            tally.accepted += num_entries(body, route) if route in ENQUEUING else 0
            return
        text = raw.decode()
        assert SECRET not in text, (status, text[:300])
        assert_openai_error(json.loads(text))

    try:
        send()
    finally:
        client.conn.close()
    assert tally.sent >= EXAMPLES, tally
    assert live.gateway.proc.alive(), live.gateway.proc.output()[-3000:]
    assert http(f"{live.gateway.base}/health")[0] == 200
    assert enqueued_total(live.server.client()) == tally.accepted, tally
    assert tally.accepted > 0 and tally.statuses.get(400, 0) > EXAMPLES // 2, tally
    print(f"fuzz: {tally}")


def test_fuzzed_response_ids_are_404s(live: Live) -> None:
    """GET and DELETE /v1/responses/{id} with ids of any shape: a 404 (or a 400 for a query
    option) in OpenAI's error body, quoting nothing."""
    conn = HTTPConnection("127.0.0.1", live.gateway.port, timeout=60)

    @settings(max_examples=100, deadline=None, derandomize=True, database=None)
    @given(
        method=st.sampled_from(["GET", "DELETE"]),
        response_id=st.text(min_size=1, max_size=60).map(lambda s: SECRET + s),
        query=st.sampled_from(["", "?stream=true", "?include[]=x", "?stream=false"]),
    )
    def send(method: str, response_id: str, query: str) -> None:
        conn.request(method, "/v1/responses/" + quote(response_id, safe="") + query)
        response = conn.getresponse()
        raw = response.read().decode()
        assert response.status in (400, 404), (response.status, raw[:300])
        assert SECRET not in raw
        assert_openai_error(json.loads(raw))

    try:
        send()
    finally:
        conn.close()


# --- the LoRA runtime routes (their own gateway: admin key, flag, a root) -----------------------

ADMIN_KEY = "admin-key-7f3a"
LORA_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
lora_path = st.one_of(
    st.sampled_from(["sql", "sql/", "../", "/etc", "sql/../..", "escape", "/"]),
    unicode,
    random_json,
)
lora_body = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "lora_name": st.sampled_from(["sql", "a b", "x=y", ""]) | unicode | random_json,
            "lora_path": lora_path,
            "base_model_name": st.sampled_from(["tiny"]) | marked | random_json,
            "lora_int_id": st.integers() | marked,
            SECRET: random_json,
        },
    ).map(lambda d: json.dumps(d).encode()),
    random_json.map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=200),
)


def test_fuzzed_lora_adapter_bodies_never_crash(live: Live, tmp_path_factory) -> None:
    """400 examples on /v1/load_lora_adapter and /v1/unload_lora_adapter with the admin key:
    no 5xx, every error an OpenAI body quoting nothing, the gateway still up."""
    root = tmp_path_factory.mktemp("lora-root")
    (root / "sql").mkdir()
    (root / "escape").symlink_to("/etc")
    flags = ("--api-keys", f"ops:{ADMIN_KEY} role=admin", "--enable-lora-runtime-updates")
    gateway = start_gateway(live.server, *flags, "--lora-root", str(root), name="lora-gateway")
    conn = HTTPConnection("127.0.0.1", gateway.port, timeout=60)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_KEY}"}

    @settings(max_examples=400, deadline=None, derandomize=True, database=None)
    @given(route=st.sampled_from(LORA_ROUTES), body=lora_body)
    def send(route: str, body: bytes) -> None:
        conn.request("POST", route, body=body, headers=headers)
        response = conn.getresponse()
        raw = response.read().decode(errors="replace")
        assert response.status < 500, (response.status, raw[:300], body[:300])
        if response.status != 200:
            assert SECRET not in raw, raw[:300]
            assert_openai_error(json.loads(raw))

    try:
        send()
        assert gateway.proc.alive(), gateway.proc.output()[-3000:]
    finally:
        conn.close()
        gateway.proc.stop()
