"""`jitney gateway`: the OpenAI-compatible HTTP front door (aiohttp; never loads torch)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from urllib.parse import urlsplit

from gateway.config import (
    ApiKey,
    GatewayConfig,
    RateLimits,
    default_gateway_id,
    parse_api_keys,
    parse_reasoning_parsers,
)
from jitney.flag_defaults import field_defaults
from protocol import redis_url


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Every default is GatewayConfig's (or RateLimits') own field: stated once, there.
    config, limits = field_defaults(GatewayConfig), field_defaults(RateLimits)
    p.add_argument("--host", default=config["host"])
    p.add_argument("--port", type=int, default=config["port"])
    p.add_argument(
        "--gateway-id",
        default=None,
        help="names this gateway's reply stream "
        "(default: hostname-pid-random; must be unique per process)",
    )
    p.add_argument(
        "--key-prefix", default=config["key_prefix"], help="Redis key prefix of the deployment"
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=config["max_body_bytes"], help="larger bodies get 413"
    )
    p.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=config["max_prompts_per_request"],
        metavar="N",
        help="a /v1/completions list of more prompts is a 400 (each prompt is one queue entry)",
    )
    p.add_argument(
        "--max-queue-len",
        type=int,
        default=config["max_queue_len"],
        help="429 while this many requests wait unread in the queue (all gateways)",
    )
    p.add_argument(
        "--max-queued-tokens",
        type=int,
        default=config["max_queued_tokens"],
        help="429 while this gateway has this many prompt tokens queued and not started",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=config["request_timeout"],
        metavar="SECONDS",
        help="deadline for a request to start; workers drop it as expired after (default: none)",
    )
    p.add_argument(
        "--chat-default-max-tokens",
        type=int,
        default=config["chat_default_max_tokens"],
        help="max_tokens of a chat request that gives none (capped to what fits the context)",
    )
    p.add_argument(
        "--api-keys",
        default=None,
        metavar="KEYS",
        help="comma-separated bearer keys, each KEY or ID:KEY (prefer JITNEY_API_KEYS or a file: "
        "a flag shows in `ps`); none: no auth",
    )
    p.add_argument(
        "--api-keys-file",
        default=None,
        metavar="FILE",
        help="bearer keys, one per line: KEY or ID:KEY, then optional rps=N burst=N tpm=N",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=config["metrics_port"],
        help="serve /metrics only on this port, without auth (default: on --port, behind auth)",
    )
    p.add_argument(
        "--rate-limit-rps",
        type=float,
        default=limits["rps"],
        help="requests per second per API key (per client IP without keys); 0: off",
    )
    p.add_argument(
        "--rate-limit-burst",
        type=int,
        default=limits["burst"],
        help="requests a client may send at once (default: the rps, rounded up)",
    )
    p.add_argument(
        "--rate-limit-tpm",
        type=int,
        default=limits["tpm"],
        help="prompt + max_tokens per minute per API key (per client IP without keys); 0: off",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=config["shutdown_timeout_s"],
        help="seconds a stopping gateway (SIGTERM) gives open requests to finish: /ready and new "
        "requests answer 503 meanwhile",
    )
    p.add_argument(
        "--queue-without-workers",
        action="store_true",
        help="scale to zero: accept requests for a published model while no worker is live (they "
        "wait in the queue) and report ready with Redis alone",
    )
    p.add_argument(
        "--max-file-bytes",
        type=int,
        default=config["max_file_bytes"],
        help="Batch API: largest upload to POST /v1/files (larger: 413)",
    )
    p.add_argument(
        "--batch-max-lines",
        type=int,
        default=config["batch_max_lines"],
        help="Batch API: most requests in one input file",
    )
    p.add_argument(
        "--batch-max-queued",
        type=int,
        default=config["batch_max_queued"],
        help="Batch API pacing: start a batch line only while fewer entries than this wait "
        "unread in the request queue (so interactive requests never wait behind many)",
    )
    p.add_argument(
        "--batch-concurrency",
        type=int,
        default=config["batch_concurrency"],
        help="Batch API: lines this gateway runs at once (0: it runs none)",
    )
    p.add_argument(
        "--batch-lease",
        type=float,
        default=config["batch_lease_s"],
        metavar="SECONDS",
        help="Batch API: a running line's lease (renewed); a dead gateway's lines run again "
        "elsewhere after it",
    )
    p.add_argument(
        "--responses-ttl",
        type=float,
        default=config["responses_ttl_s"],
        metavar="SECONDS",
        help="Responses API: how long a stored response (store: true) can be retrieved and "
        "continued (previous_response_id)",
    )
    p.add_argument(
        "--responses-max-bytes",
        type=int,
        default=config["responses_max_bytes"],
        help="Responses API: largest stored response, with its conversation (a longer "
        "conversation to store is a 400; a larger result is returned with store: false)",
    )
    p.add_argument(
        "--prefix-placement",
        action=argparse.BooleanOptionalAction,
        default=config["prefix_placement"],
        help="enqueue each request on the worker whose prefix cache holds most of its prompt "
        "(workers publish summaries with the same flag), unless it is much busier",
    )
    p.add_argument(
        "--reasoning-parser",
        default="",
        metavar="NAME|MODEL=NAME,...",
        help="split reasoning models' output into reasoning_content and content: deepseek_r1, "
        "qwen3 or granite, for every model, or per model as MODEL=NAME (comma-separated)",
    )
    p.add_argument(
        "--enable-lora-runtime-updates",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's) to API keys "
        "with role=admin in the keys file (without keys they stay off); needs --lora-root",
    )
    p.add_argument(
        "--lora-root",
        default=config["lora_root"],
        metavar="DIR",
        help="the directory every adapter loaded at runtime must lie under (symlinks resolved)",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def load_api_keys(args: argparse.Namespace) -> tuple[ApiKey, ...]:
    keys = []
    if args.api_keys:
        keys += parse_api_keys(args.api_keys.split(","), "--api-keys")
    if args.api_keys_file:
        lines = Path(args.api_keys_file).read_text().splitlines()
        keys += parse_api_keys(lines, "--api-keys-file")
    return tuple(keys)


def run(args: argparse.Namespace) -> int:
    # aiohttp and the tokenizer stack load only here
    from gateway.http.auth import RedactSecrets
    from gateway.http.server import run as run_gateway

    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    log = logging.getLogger("gateway")
    try:
        api_keys = load_api_keys(args)
        config = GatewayConfig(
            host=args.host,
            port=args.port,
            gateway_id=args.gateway_id or default_gateway_id(),
            key_prefix=args.key_prefix,
            max_body_bytes=args.max_body_bytes,
            max_queue_len=args.max_queue_len,
            max_prompts_per_request=args.max_prompts_per_request,
            max_queued_tokens=args.max_queued_tokens,
            request_timeout=args.request_timeout,
            chat_default_max_tokens=args.chat_default_max_tokens,
            api_keys=api_keys,
            metrics_port=args.metrics_port,
            rate_limits=RateLimits(args.rate_limit_rps, args.rate_limit_burst, args.rate_limit_tpm),
            shutdown_timeout_s=args.shutdown_timeout,
            queue_without_workers=args.queue_without_workers,
            max_file_bytes=args.max_file_bytes,
            batch_max_lines=args.batch_max_lines,
            batch_max_queued=args.batch_max_queued,
            batch_concurrency=args.batch_concurrency,
            batch_lease_s=args.batch_lease,
            responses_ttl_s=args.responses_ttl,
            responses_max_bytes=args.responses_max_bytes,
            prefix_placement=args.prefix_placement,
            reasoning_parsers=parse_reasoning_parsers(args.reasoning_parser),
            enable_lora_runtime_updates=args.enable_lora_runtime_updates,
            lora_root=args.lora_root,
        )
    except (OSError, ValueError) as e:  # key errors name the entry, never the key
        log.error("invalid gateway configuration: %s", e)
        return 2
    redact = RedactSecrets([k.key for k in api_keys] + [urlsplit(redis_url()).password or ""])
    for handler in logging.getLogger().handlers:
        handler.addFilter(redact)
    if api_keys:
        log.info(
            "auth on: %d API keys, ids %s", len(api_keys), ",".join(k.key_id for k in api_keys)
        )
    else:
        log.info("auth off: no API keys configured (--api-keys / --api-keys-file)")
    if config.enable_lora_runtime_updates and not any(k.admin for k in api_keys):
        log.warning("LoRA runtime updates: no API key has role=admin, so nobody may use them")
    if config.rate_limits.enabled:
        limits = config.rate_limits
        log.info(
            "rate limits per %s: rps=%g burst=%d tpm=%d",
            "API key" if api_keys else "client IP",
            limits.rps,
            limits.burst,
            limits.tpm,
        )
    run_gateway(config)
    return 0
