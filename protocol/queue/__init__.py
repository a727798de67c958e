"""The request-queue contract, imported by both ends: gateways enqueue, workers read and answer.

A model's requests wait in streams, one per priority and fair-share key (`Keys.requests`), read
by the consumer group `workers`. Its pieces, each spelled once:
- `entry.py`: which queue a request goes to (`Queue`) and an entry's fields (`encode_entry`,
  `entry_cost`, `addressing`, the dead-letter form);
- `scripts.py`: every Lua script that touches a request or reply stream (enqueue, the backlog
  reading, the deficit-round-robin read, publish/ack/refund, the fenced heartbeat, placement's
  lookup and place);
- `calls.py`: each script's KEYS and ARGV, built from typed values, and the read's reply;
- `placement.py`: prefix-aware placement's part (a worker's own stream of each queue, its prefix
  summary, the steal bound), which the scripts above carry when it is on.
The I/O itself (register the scripts, one call per round trip) stays at each end.
"""

from protocol.queue import scripts
from protocol.queue.calls import (
    DRR_QUANTUM,
    READ_ALL,
    ReadReply,
    ScriptCall,
    backlog_call,
    enqueue_call,
    heartbeat_call,
    publish_call,
    read_call,
    read_reply,
)
from protocol.queue.entry import (
    COST_FIELD,
    DEFAULT_QUEUE,
    ENTRY_ID_FIELD,
    REASON_FIELD,
    Addressing,
    Fields,
    Queue,
    addressing,
    dead_letter_fields,
    encode_entry,
    entry_cost,
)

__all__ = [
    "COST_FIELD",
    "DEFAULT_QUEUE",
    "DRR_QUANTUM",
    "ENTRY_ID_FIELD",
    "READ_ALL",
    "REASON_FIELD",
    "Addressing",
    "Fields",
    "Queue",
    "ReadReply",
    "ScriptCall",
    "addressing",
    "backlog_call",
    "dead_letter_fields",
    "encode_entry",
    "enqueue_call",
    "entry_cost",
    "heartbeat_call",
    "publish_call",
    "read_call",
    "read_reply",
    "scripts",
]
