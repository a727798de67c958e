"""`jitney worker`: serve one model from the Redis request stream (one process per GPU/CPU).

Redis comes from REDIS_URL (password and TLS in the URL). SIGTERM/SIGINT: /ready turns 503, stop
reading, finish in-flight requests within --shutdown-timeout, hand the rest back for another
worker to continue, exit 0; a second signal hands back at once.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import socket
import sys

from jitney.commands.engine_args import add_engine_arguments, engine_config_from_args
from jitney.flag_defaults import field_defaults
from protocol import Keys

logger = logging.getLogger("jitney.worker")

LOG_LEVELS = ("debug", "info", "warning", "error")
METRICS_PORT = 9100  # `jitney up` gives worker i this + i


def add_arguments(p: argparse.ArgumentParser) -> None:
    from worker.service_config import ServiceConfig  # no torch: flag parsing stays light

    service = field_defaults(ServiceConfig)
    p.add_argument(
        "--worker-id",
        default=None,
        help="this worker's consumer name in the group (default: <hostname>-<pid>)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=METRICS_PORT,
        help="/metrics port; 0 picks a free one (logged)",
    )
    p.add_argument(
        "--key-prefix",
        default=field_defaults(Keys)["prefix"],
        help="Redis key prefix (deployments can share a Redis)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients give in `model` (default: the --model name); it also names the "
        "request stream this worker reads (that model's)",
    )
    p.add_argument(
        "--idle-block-ms",
        type=int,
        default=service["idle_block_ms"],
        help="how long an idle worker blocks on the request stream per read",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=service["shutdown_timeout_s"],
        help="seconds a stopping worker gives in-flight requests before aborting them",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=service["stall_timeout_s"],
        help="seconds without the engine loop coming round (a hung step) after which the worker "
        "stops renewing its lease, so other workers take its requests over",
    )
    p.add_argument(
        "--vllm-metrics",
        action="store_true",
        help="also export the metrics under vLLM's names (vllm:num_requests_waiting, ...), for "
        "dashboards and autoscaling rules written for vLLM",
    )
    p.add_argument(
        "--prefix-placement",
        action=argparse.BooleanOptionalAction,
        default=service["prefix_placement"],
        help="publish a summary of the prefix cache, so gateways place requests on the worker "
        "holding their prompt's start, and read this worker's own streams",
    )
    p.add_argument(
        "--placement-steal-ms",
        type=int,
        default=service["placement_steal_ms"],
        help="take an entry placed on another worker that it has not read within this long",
    )
    p.add_argument(
        "--log-level", choices=LOG_LEVELS, default="info", help="debug logs every request"
    )
    add_generation_config_arguments(p)
    add_engine_arguments(p)


def add_generation_config_arguments(p: argparse.ArgumentParser) -> None:
    """The sampling defaults' flags (worker.generation_defaults); `jitney up` passes them on."""
    from worker.service_config import ServiceConfig

    service = field_defaults(ServiceConfig)
    p.add_argument(
        "--generation-config",
        default=service["generation_config"],
        metavar="auto|vllm|DIR",
        help="the sampling defaults for fields a request leaves out: auto, the model's "
        "generation_config.json (and SmolLM2's recommended temperature 0.2, top_p 0.9); vllm, "
        "the API's own; or DIR's generation_config.json",
    )
    p.add_argument(
        "--override-generation-config",
        default=service["override_generation_config"],
        metavar="JSON",
        help="a JSON object of sampling defaults that win over the file's, e.g. "
        '{"temperature": 0.5}; keys: temperature, top_p, top_k, repetition_penalty, '
        "max_new_tokens",
    )


def generation_config_argv(args: argparse.Namespace) -> list[str]:
    """Those flags of `args` as a command line, where they differ from their defaults."""
    from worker.service_config import ServiceConfig

    service = field_defaults(ServiceConfig)
    argv: list[str] = []
    for flag in ("generation_config", "override_generation_config"):
        if getattr(args, flag) != service[flag]:
            argv += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    return argv


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)
    # Our own events at the chosen level; libraries (redis-py, transformers) only warn.
    logging.getLogger("jitney").setLevel(args.log_level.upper())
    # Only what the checks of the flags need comes before them: a bad flag is refused in a moment,
    # not after the seconds torch and transformers take to import.
    from engine.threads import apply_threads, resolve_threads
    from worker.log_fields import kv
    from worker.metrics_server import bind_metrics_port
    from worker.service_config import ServiceConfig

    worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    try:
        config = ServiceConfig(
            worker_id,
            args.idle_block_ms,
            args.shutdown_timeout,
            args.stall_timeout,
            generation_config=args.generation_config,
            override_generation_config=args.override_generation_config,
            prefix_placement=args.prefix_placement,
            placement_steal_ms=args.placement_steal_ms,
        )
        engine_config = engine_config_from_args(args)
        threads = resolve_threads(args.threads)  # a bad OMP_NUM_THREADS is refused here
    except ValueError as e:
        logger.error("cannot_start %s", kv(error=e))
        return 2
    try:
        metrics_server = bind_metrics_port(args.metrics_port)
    except OSError as e:  # the port is taken: say which, no traceback
        logger.error("cannot_start %s", kv(metrics_port=args.metrics_port, error=e.strerror))
        return 2
    from engine.llm_engine import Engine
    from protocol import NOOP_MODEL, redacted, redis_url
    from protocol.model_card import card_from_tokenizer
    from worker import generation_defaults
    from worker.engine_loop import StepFailuresExceeded, WorkerService
    from worker.failpoints import Failpoints
    from worker.metrics import WorkerMetrics
    from worker.redis_io import WorkerRedis

    apply_threads(threads)
    logger.info(threads.describe())
    try:
        engine = Engine(engine_config)  # the loader logs each stage
    except ValueError as e:  # what needs the model: max_model_len does not fit the KV budget
        logger.error("cannot_start %s", kv(error=e))
        return 2
    except KeyboardInterrupt:
        return 130
    print(engine.capacity.table(), file=sys.stderr, flush=True)
    loaded = engine.loaded
    served = args.served_model_name or loaded.name
    if loaded.name == NOOP_MODEL and served != NOOP_MODEL:  # it must announce itself as noop
        logger.error("cannot_start %s", kv(error="--model noop cannot take a served name"))
        return 2
    try:
        defaults = generation_defaults.resolve(
            config.generation_config, config.generation_override, loaded.generation_config
        )
    except ValueError as e:  # the file holds a bad value
        logger.error("cannot_start %s", kv(error=e))
        return 2
    logger.info(
        "sampling_defaults %s",
        kv(source=config.generation_config, **defaults.to_dict()),
    )
    card = card_from_tokenizer(
        served, loaded.tokenizer, engine.max_model_len, list(engine.eos_token_ids), defaults
    )
    card.embedding_size = engine.embedding_size  # /v1/embeddings checks `dimensions` by it
    card.adapters = list(engine.adapter_names)  # a request naming one runs on this model's queue
    if served in card.adapters:  # a request naming it would get the base model: say so now
        logger.error(
            "cannot_start %s", kv(error=f"a LoRA adapter is named {served!r}, as the model")
        )
        return 2
    metrics = WorkerMetrics(served, worker_id)
    if card.adapters:
        metrics.lora.enable(engine_config.max_loras)
    view = engine.view
    metrics.describe_engine(view.forward_name, view.kv_cache_dtype, view.block_size)
    port = metrics.serve(metrics_server, vllm_names=args.vllm_metrics)
    keys = Keys(args.key_prefix)
    io = WorkerRedis.connect(
        redis_url(),
        keys,
        worker_id,
        served,
        args.idle_block_ms,
        config.prefix_placement,
        config.placement_steal_ms,
    )
    logger.info(
        "worker_starting %s",
        kv(
            worker=worker_id,
            model=served,
            metrics_port=port,
            redis=redacted(redis_url()),  # no password in logs
            key_prefix=args.key_prefix,
        ),
    )
    failpoints = Failpoints.from_env()
    if failpoints.armed:
        logger.warning("failpoints_armed %s", kv(failpoints=failpoints))
    service = WorkerService(engine, io, config, metrics, card, failpoints)
    metrics.ready = lambda: service.ready
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: service.request_stop())
    # This process serves its one engine until it exits: what start-up built (the model's
    # modules, the tokenizer's vocabulary, the service's tables) leaves the collector's
    # generations, so no full collection walks it between steps (one held a one-user SmolLM2
    # decode for about 50 ms; perf: gc_collect_main). Frozen objects are never collected, so
    # only a process whose engine lives as long as it may freeze (Engine itself does not).
    gc.freeze()
    try:
        service.run()
    except StepFailuresExceeded as e:  # the device is broken: exit so the supervisor restarts us
        logger.error("exiting %s", kv(error=e))
        return 1
    return 0
