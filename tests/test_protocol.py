"""The wire protocol: messages round-trip, versions are checked, model cards rebuild tokenizers,
the request queue's entries and script calls keep their layout."""

import json
import re

import pytest
from redis.crc import key_slot

from engine.models.tiny_model import build_tiny_tokenizer
from protocol import (
    REPLY_STREAM_MAXLEN,
    WORKER_GROUP,
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
from protocol.queue import (
    DRR_QUANTUM,
    READ_ALL,
    Queue,
    addressing,
    backlog_call,
    dead_letter_fields,
    encode_entry,
    enqueue_call,
    entry_cost,
    heartbeat_call,
    publish_call,
    read_call,
    read_reply,
)
from protocol.queue import scripts as queue_scripts
from protocol.queue.calls import lookup_call, place_call
from protocol.queue.placement import UNREAD_COUNT_BOUND, SummaryUpdate


def test_the_package_exposes_its_modules_exports_and_no_stdlib_module():
    """protocol/__init__.py star-imports keys and messages: only their `__all__` comes through,
    so `protocol.json` or `protocol.os` does not resolve, and every module on the package is a
    protocol submodule."""
    import types

    import protocol
    from protocol import keys, messages

    for name, value in vars(protocol).items():
        if isinstance(value, types.ModuleType):
            assert value.__name__ == f"protocol.{name}", name
    exported = {
        name
        for name, value in vars(protocol).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert exported == set(keys.__all__) | set(messages.__all__)
    for stdlib in ("json", "os", "re", "struct", "base64", "binascii", "dataclass", "Any"):
        assert not hasattr(protocol, stdlib), stdlib


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


def test_a_request_s_adapter_and_a_card_s_adapters_travel_and_older_messages_decode():
    """`lora` and `adapters` round-trip; a message written before them gets their defaults."""
    req = RequestMessage("r1", "m", [1], {}, "jitney:replies:g1", "g1", 1.0, lora="sql")
    assert RequestMessage.decode(req.encode()).lora == "sql"
    older = {
        "v": "1",
        "m": json.dumps({k: v for k, v in json.loads(req.encode()["m"]).items() if k != "lora"}),
    }
    assert RequestMessage.decode(older).lora is None
    card = ModelCard("m", 64, [2], "{}", adapters=["sql", "chat"])
    assert ModelCard.decode(card.encode()).adapters == ["sql", "chat"]
    fields = json.loads(card.encode()["m"])
    del fields["adapters"]
    assert ModelCard.decode({"v": "1", "m": json.dumps(fields)}).adapters == []


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
        prediction_token_ids=(7, 8, 9),
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
        ({"prediction_token_ids": [3, -1]}, "prediction_token_ids must be >= 0"),
        ({"prediction_token_ids": "abc"}, "prediction_token_ids must be a list of integers"),
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
        keys.requests("m", 3, "k", worker="w1"),
        keys.queue_owners("m"),
        keys.prefix_summary("w1"),
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


QUEUE_KEYS = Keys()


def test_a_request_entry_carries_its_message_and_cost_and_is_read_back_leniently():
    """encode_entry adds the fair-share cost to the message's fields; the worker reads the cost
    and the addressing without validating the rest, and a broken entry reads as nothing."""
    req = RequestMessage("r1", "m", [1, 2], {}, QUEUE_KEYS.replies("g1"), "g1", 0.0)
    fields = {k.encode(): v.encode() for k, v in encode_entry(req, 40).items()}
    assert set(fields) == {b"v", b"m", b"c"} and RequestMessage.decode(fields) == req
    assert entry_cost(fields) == 40 and addressing(fields) == ("r1", QUEUE_KEYS.replies("g1"))
    for broken in ({}, {b"m": b"{", b"c": b"x"}, {b"m": b"[1]", b"c": b"-3"}):
        assert entry_cost(broken) == 0 and addressing(broken) == ("", "")
    dead = dead_letter_fields(fields, "1-2", "poison")
    assert dead == {**fields, "entry_id": "1-2", "reason": "poison"}


def test_queue_scripts_name_the_entry_fields_the_ends_write():
    """The scripts' field placeholders are all filled in: the enqueue script writes the fields
    encode_entry makes, the read script charges the cost field, publish writes a reply batch."""
    for name in ("ENQUEUE", "BACKLOG", "READ", "PUBLISH", "HEARTBEAT"):
        assert "$" not in getattr(queue_scripts, name), name
    assert "'*', 'v', ARGV[4], 'm', ARGV[5], 'c', ARGV[6]" in queue_scripts.ENQUEUE
    assert "fields[i] == 'c'" in queue_scripts.READ
    assert queue_scripts.PUBLISH.count("'*', 'v', v, 'b', b)") == 2


def test_queue_script_calls_lay_out_keys_and_argv_as_the_scripts_read_them():
    """Each builder's KEYS and ARGV, in the order scripts.py documents."""
    k, model = QUEUE_KEYS, "m"
    queue = Queue(priority=-5, share="key1", weight=3)
    fields = encode_entry(RequestMessage("r", model, [1], {}, "x", "g", 0.0), 7)
    call = enqueue_call(k, model, queue, fields, prompt_tokens=1)
    stream = k.requests(model, -5, "key1")
    assert call.keys == [k.queues(model), k.queue_weights(model), stream, k.queued_tokens(model)]
    assert call.args == [-5, 3, WORKER_GROUP, fields["v"], fields["m"], "7", 1]
    call = backlog_call(k, model, 11)
    assert call == (
        [k.queues(model), k.requests(model), k.queued_tokens(model)],
        [WORKER_GROUP, 11],
    )
    call = read_call(k, model, "w1", 4)
    assert call.keys == [
        k.queues(model),
        k.queue_weights(model),
        k.queue_deficits(model),
        k.requests(model),
    ]
    assert call.args == [WORKER_GROUP, "w1", 4, READ_ALL, DRR_QUANTUM]
    assert read_call(k, model, "w1", 4, below=0).args[3] == 0
    call = heartbeat_call(k, "w1", model, "card", 12.5)
    assert call.keys == [k.fenced("w1"), k.workers, k.model("card"), k.model_workers(model)]
    assert call.args == ["w1", 12.5]


def test_publish_call_writes_one_entry_per_reply_stream_then_acks_then_refunds():
    """A step's replies go one batch per stream in order (NOMKSTREAM for a gone gateway's),
    then each ack, then each refund; a fenced worker's flag is the first key."""
    k, gone, live = QUEUE_KEYS, QUEUE_KEYS.replies("gone"), QUEUE_KEYS.replies("live")
    a0, b0, a1 = ReplyMessage("a", 0), ReplyMessage("b", 0), ReplyMessage("a", 1)
    replies = [(live, a0), (gone, b0), (live, a1)]
    call = publish_call(k, "w1", "m", replies, {gone}, [("q", "1-0")], [("q", 5)])
    assert call.keys == [k.fenced("w1"), k.queue_deficits("m")]
    batches = [encode_replies([a0, a1]), encode_replies([b0])]
    assert call.args == [
        *(WORKER_GROUP, REPLY_STREAM_MAXLEN),
        *("R", live, 0, batches[0]["v"], batches[0]["b"]),
        *("R", gone, 1, batches[1]["v"], batches[1]["b"]),
        *("A", "q", "1-0"),
        *("F", "q", 5),
    ]


def test_the_read_script_s_reply_becomes_queues_and_entries():
    """READ returns its queues flat with their priorities and each entry's fields flat."""
    reply = [[b"q0", b"0", b"q1", b"-3"], [[b"q1", b"5-1", [b"v", b"1", b"c", b"9"]]]]
    assert read_reply(reply) == ({"q0": 0, "q1": -3}, [("q1", "5-1", {b"v": b"1", b"c": b"9"})])


def test_placement_calls_lay_out_keys_and_argv_as_the_scripts_read_them():
    """PLACE is ENQUEUE's call plus the owners hash, the target's own stream and summary, and
    the target's id; LOOKUP pairs each worker's summary with its own stream of the queue; READ
    with placement adds the owners hash and the own-stream mark, summaries' prefix, steal bound
    and flag; a summary update is publish's `S` operation; the heartbeat renews the summary.
    LOOKUP names the request's LoRA adapter ('' for none) before the hashes."""
    k, model = QUEUE_KEYS, "m"
    queue = Queue(priority=2, share="key1", weight=3)
    fields = encode_entry(RequestMessage("r", model, [1], {}, "x", "g", 0.0), 7)
    stream, own = k.requests(model, 2, "key1"), k.requests(model, 2, "key1", worker="w1")
    assert own == stream + ":w:w1" == queue.stream(k, model, "w1")
    call = place_call(k, model, queue, "w1", fields, prompt_tokens=1)
    enqueue = enqueue_call(k, model, queue, fields, prompt_tokens=1)
    assert call.keys == [*enqueue.keys, k.queue_owners(model), own, k.prefix_summary("w1")]
    assert call.args == [*enqueue.args, "w1"]
    call = lookup_call(k, model, queue, ["w1", "w2"], [b"h1", b"h2"])
    assert call.keys == [k.prefix_summary("w1"), own, k.prefix_summary("w2"), stream + ":w:w2"]
    assert call.args == [WORKER_GROUP, UNREAD_COUNT_BOUND, "", b"h1", b"h2"]
    call = lookup_call(k, model, queue, ["w1"], [b"h1"], adapter="sql")
    assert call.args == [WORKER_GROUP, UNREAD_COUNT_BOUND, "sql", b"h1"]
    call = read_call(k, model, "w1", 4, placed=True, steal=True, steal_after_ms=250)
    assert call.keys == [*read_call(k, model, "w1", 4).keys, k.queue_owners(model)]
    assert call.args[5:] == [":w:", k.prefix_summary(""), 250, 1]
    update = SummaryUpdate("s", 5000, True, [b"a" * 8], [b"b" * 8, b"c" * 8], {"room": 3})
    call = publish_call(k, "w1", model, [], set(), [], [], update)
    assert call.args[2:] == ["S", "s", 5000, 1, 1, 2, 1, b"a" * 8, b"b" * 8, b"c" * 8, "room", 3]
    assert publish_call(k, "w1", model, [], set(), [], [], SummaryUpdate("s", 1)).args[2:] == []
    call = heartbeat_call(k, "w1", model, "card", 12.5, summary_ttl_ms=5000)
    assert call.keys[-1] == k.prefix_summary("w1") and call.args == ["w1", 12.5, 5000]
