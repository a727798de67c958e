"""`jitney dead-letters`: the requests workers gave up on (each failed MAX_DELIVERIES times).

Lists what an operator needs to find the cause in the workers' `step_failed` logs — when, which
request, its model, its size and why — never the prompt itself. `--purge` empties the stream
once they have been looked at.
"""

from __future__ import annotations

import argparse
import json
import time

from jitney.flag_defaults import field_defaults
from protocol import Keys, ProtocolError, RequestMessage, redacted, redis_url
from protocol.queue import REASON_FIELD
from protocol.redis_client import sync_client


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--key-prefix",
        default=field_defaults(Keys)["prefix"],
        help="Redis key prefix of the deployment",
    )
    p.add_argument("--count", type=int, default=50, help="show at most this many, newest first")
    p.add_argument("--purge", action="store_true", help="delete them after listing")


def run(args: argparse.Namespace) -> int:
    keys = Keys(args.key_prefix)
    client = sync_client(redis_url(), socket_timeout=5, socket_connect_timeout=5)
    entries = client.xrevrange(keys.dead_letters, count=args.count)
    total = client.xlen(keys.dead_letters)
    print(f"{total} dead-lettered request(s) in {keys.dead_letters} at {redacted(redis_url())}")
    if entries:
        print(f"{'when (UTC)':20} {'request':38} {'model':16} {'prompt':>6} {'max':>5}  reason")
    for entry_id, fields in entries:
        print(_row(entry_id.decode(), fields))
    if args.purge and total:
        client.delete(keys.dead_letters)
        print(f"purged {total}")
    return 0


def _row(entry_id: str, fields: dict[bytes, bytes]) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(int(entry_id.split("-")[0]) / 1000))
    reason = fields.get(REASON_FIELD.encode(), b"").decode(errors="replace")
    try:
        msg = RequestMessage.decode(fields)
        max_tokens = json.dumps(msg.sampling.get("max_tokens"))
        return (
            f"{when:20} {msg.request_id:38} {msg.model:16} {len(msg.prompt_token_ids):>6} "
            f"{max_tokens:>5}  {reason}"
        )
    except (ProtocolError, AttributeError, TypeError):
        return f"{when:20} {'(unreadable entry)':38} {'':16} {'':>6} {'':>5}  {reason}"
