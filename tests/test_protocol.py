"""The wire protocol: messages round-trip, versions are checked, model cards rebuild tokenizers."""

import json
import re

import pytest
from redis.crc import key_slot

from engine.tiny_model import build_tiny_tokenizer
from protocol import (
    CancelMessage,
    Keys,
    ModelCard,
    ProtocolError,
    ReplyMessage,
    RequestMessage,
    SamplingParams,
    decode_replies,
    encode_replies,
)
from protocol.model_card import card_from_tokenizer, tokenizer_from_card


def test_messages_round_trip_through_stream_fields():
    """encode() gives str fields; decode() accepts them as Redis returns them (bytes)."""
    req = RequestMessage(
        "r1",
        "tiny-random",
        [1, 2, 3],
        {"max_tokens": 5, "stop": ["x"]},
        "jitney:replies:g1",
        "g1",
        1700000000.5,
        deadline=None,
    )
    raw = {k.encode(): v.encode() for k, v in req.encode().items()}
    assert RequestMessage.decode(raw) == req
    assert req.sampling_params == SamplingParams(max_tokens=5, stop=("x",))
    reply = ReplyMessage("r1", 3, [7], "hi", finish_reason="stop", prompt_tokens=3)
    assert ReplyMessage.decode(reply.encode()) == reply and reply.is_final
    assert CancelMessage.decode(CancelMessage("r1").encode()).reason == "client_gone"


def test_sampling_params_travel_as_a_dict_and_come_back_equal():
    """to_dict is plain JSON (lists, floats); from_dict gives back the same frozen value."""
    params = SamplingParams(
        max_tokens=9,
        temperature=1,
        top_p=0.5,
        top_k=3,
        seed=2**64 - 1,
        stop=("a", "b"),
        stop_token_ids=(4,),
        ignore_eos=True,
        n=3,
        prompt_logprobs=2,
        grammar='{"grammars": []}',
    )
    wire = json.loads(json.dumps(params.to_dict()))
    assert wire["stop"] == ["a", "b"] and isinstance(wire["temperature"], float)
    assert SamplingParams.from_dict(wire) == params
    assert SamplingParams.from_dict({}) == SamplingParams()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"max_tokens": True}, "max_tokens must be an integer, got bool"),
        ({"max_tokens": "5"}, "max_tokens must be an integer, got str"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k must be an integer"),
        ({"seed": 1.5}, "seed must be an integer or null"),
        ({"seed": 2**64}, "seed must fit in 64 bits"),
        ({"stop": "x"}, "stop must be a list of strings"),
        ({"stop": [""]}, "stop strings must be non-empty"),
        ({"stop": [1]}, "stop must be a list of strings"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids must be >= 0"),
        ({"stop_token_ids": [[1]]}, "stop_token_ids must be a list of integers"),
        ({"ignore_eos": 1}, "ignore_eos must be a boolean"),
        ({"n": 0}, "n must be in [1, 16]"),
        ({"n": 17}, "n must be in [1, 16]"),
        ({"prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20]"),
        ({"grammar": ""}, "grammar must be non-empty"),
        ({"grammar": 3}, "grammar must be a string or null"),
        ({"temprature": 1}, "unknown sampling field"),
        ([1, 2], "sampling must be an object"),
    ],
)
def test_bad_sampling_fields_are_refused_naming_the_field(data, message):
    """Out-of-range, ill-typed and unknown fields raise ValueError (the worker's error reply)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams.from_dict(data)


def test_wrong_version_or_garbage_is_refused():
    """A reader refuses what it cannot read instead of guessing."""
    fields = CancelMessage("r1").encode()
    with pytest.raises(ProtocolError, match="version"):
        CancelMessage.decode({**fields, "v": "99"})
    with pytest.raises(ProtocolError, match="malformed"):
        CancelMessage.decode({**fields, "m": "{not json"})
    with pytest.raises(ProtocolError, match="missing"):
        CancelMessage.decode({"v": "1"})
    with pytest.raises(ProtocolError, match="malformed"):
        RequestMessage.decode(CancelMessage("r1").encode())  # required fields missing


def test_key_names_share_one_prefix_as_a_cluster_hash_tag():
    """Every key lives under the deployment's prefix, which is a Redis Cluster hash tag: all of a
    deployment's keys map to one slot (one shard), so its scripts never cross slots."""
    keys = Keys("tenant")
    names = [
        keys.requests("m"),
        keys.requests("other"),
        keys.queued_tokens("m"),
        keys.model_workers("m"),
        keys.replies("g"),
        keys.cancels,
        keys.cancelled("r"),
        keys.workers,
        keys.gateways,
        keys.model("m"),
    ]
    assert all(n.startswith("{tenant}:") for n in names) and len(set(names)) == len(names)
    assert len({key_slot(n.encode()) for n in names}) == 1
    assert key_slot(Keys("other").workers.encode()) != key_slot(keys.workers.encode())
    # A prefix that names its own tag keeps it (several prefixes on one chosen slot).
    assert Keys("{shard-a}:tenant").workers == "{shard-a}:tenant:workers"


def test_model_card_rebuilds_the_same_tokenizer():
    """A gateway's tokenizer from the card encodes text and chats exactly like the worker's."""
    tok = build_tiny_tokenizer()
    card = ModelCard.decode(card_from_tokenizer("tiny", tok, 2048, [2, 0]).encode())
    rebuilt = tokenizer_from_card(card)
    text = "héllo wörld 日本 🚀 the and of"
    assert rebuilt.encode(text) == tok.encode(text)
    chat = [{"role": "user", "content": "hi there"}]
    kwargs = {"add_generation_prompt": True, "tokenize": True, "return_dict": False}
    assert rebuilt.apply_chat_template(chat, **kwargs) == tok.apply_chat_template(chat, **kwargs)
    assert rebuilt.eos_token == tok.eos_token and card.max_model_len == 2048


def test_redis_url_is_redacted_for_logs():
    """A password in REDIS_URL never reaches a log line."""
    from protocol import redacted

    assert redacted("rediss://:s3cret@redis.example:6380/0") == "rediss://redis.example:6380/0"
    assert redacted("redis://user:pw@localhost/1") == "redis://localhost/1"
    sentinel = "redis+sentinel://:pw@s1:26379,s2:26379/mymaster/0"
    assert redacted(sentinel) == "redis+sentinel://s1:26379,s2:26379/mymaster/0"


def test_a_worker_step_s_replies_travel_as_one_compact_entry():
    """encode_replies: one stream entry for several replies, each without its default fields;
    decode_replies reads it back, and a single-reply entry too."""
    replies = [
        ReplyMessage("a", 0, [1, 2]),
        ReplyMessage("b", 3, [4], finish_reason="stop", completion_tokens=4, index=1),
    ]
    entry = encode_replies(replies)
    assert set(entry) == {"v", "b"} and "prompt_logprobs" not in entry["b"]
    assert decode_replies(entry) == replies
    assert decode_replies(replies[0].encode()) == replies[:1]
    with pytest.raises(ProtocolError, match="protocol version"):
        decode_replies({**entry, "v": "99"})
    for bad in ("{", '{"a": 1}', "[1]"):
        with pytest.raises(ProtocolError):
            decode_replies({"v": entry["v"], "b": bad})
