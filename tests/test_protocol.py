"""The wire protocol: messages round-trip, versions are checked, model cards rebuild tokenizers."""

import pytest

from engine.tiny_model import build_tiny_tokenizer
from protocol import (
    CancelMessage,
    Keys,
    ModelCard,
    ProtocolError,
    ReplyMessage,
    RequestMessage,
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
    assert req.sampling_fields.max_tokens == 5 and req.sampling_fields.stop == ["x"]
    reply = ReplyMessage("r1", 3, [7], "hi", finish_reason="stop", prompt_tokens=3)
    assert ReplyMessage.decode(reply.encode()) == reply and reply.is_final
    assert CancelMessage.decode(CancelMessage("r1").encode()).reason == "client_gone"


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


def test_key_names_share_one_prefix():
    """Every key lives under the deployment's prefix."""
    keys = Keys("tenant")
    names = [
        keys.requests,
        keys.replies("g"),
        keys.cancels,
        keys.cancelled("r"),
        keys.workers,
        keys.gateways,
        keys.model("m"),
    ]
    assert all(n.startswith("tenant:") for n in names) and len(set(names)) == len(names)


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
