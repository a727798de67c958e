"""`jitney gateway`: the OpenAI-compatible HTTP front door (aiohttp; never loads torch)."""

from __future__ import annotations

import argparse
import logging

from gateway.config import GatewayConfig, MiB, default_gateway_id


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--gateway-id",
        default=None,
        help="names this gateway's reply stream "
        "(default: hostname-pid-random; must be unique per process)",
    )
    p.add_argument("--key-prefix", default="jitney", help="Redis key prefix of the deployment")
    p.add_argument("--max-body-bytes", type=int, default=MiB, help="larger bodies get 413")
    p.add_argument(
        "--max-queue-len",
        type=int,
        default=256,
        help="429 while this many requests wait unread in the queue (all gateways)",
    )
    p.add_argument(
        "--max-queued-tokens",
        type=int,
        default=262_144,
        help="429 while this gateway has this many prompt tokens queued and not started",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="deadline for a request to start; workers drop it as expired after (default: none)",
    )
    p.add_argument(
        "--chat-default-max-tokens",
        type=int,
        default=512,
        help="max_tokens of a chat request that gives none (capped to what fits the context)",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def run(args: argparse.Namespace) -> int:
    from gateway.app import run as run_gateway  # aiohttp and the tokenizer stack load only here

    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    config = GatewayConfig(
        host=args.host,
        port=args.port,
        gateway_id=args.gateway_id or default_gateway_id(),
        key_prefix=args.key_prefix,
        max_body_bytes=args.max_body_bytes,
        max_queue_len=args.max_queue_len,
        max_queued_tokens=args.max_queued_tokens,
        request_timeout=args.request_timeout,
        chat_default_max_tokens=args.chat_default_max_tokens,
    )
    run_gateway(config)
    return 0
