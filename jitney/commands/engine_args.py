"""The engine flags, shared by every command that runs a model (generate, bench, worker, up)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from jitney.commands.lora_args import add_lora_arguments, lora_fields
from jitney.flag_defaults import field_defaults
from scheduler import POLICIES

if TYPE_CHECKING:
    from engine.config import EngineConfig


GIVEN_FLAGS = "given_engine_flags"


class _StoreNotingGiven(argparse.Action):
    """Stores the value and notes that the flag was on the command line, so that
    --speculative-config refuses a field its own flag also sets even when the flag repeats its
    default (`--speculative auto` beside an object that sets `method`)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[no-untyped-def]
        setattr(namespace, self.dest, values)
        given = getattr(namespace, GIVEN_FLAGS, None) or set()
        setattr(namespace, GIVEN_FLAGS, given | {self.dest})


def engine_flag_defaults() -> dict[str, object]:
    """Every engine flag's default by its flat name: EngineConfig's own fields, and its
    speculative settings' (SpeculativeOptions) under the flags' names (FLAT_FIELDS)."""
    from engine.config import EngineConfig
    from engine.speculative_options import FLAT_FIELDS, SpeculativeOptions

    speculative = field_defaults(SpeculativeOptions)
    flat = {name: speculative[field] for name, field in FLAT_FIELDS.items()}
    return {**field_defaults(EngineConfig), **flat}


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    # Every default is EngineConfig's own field (its batching fields are SchedulerConfig's), so a
    # bare Engine and `jitney worker` without flags cannot disagree. Imported here, not at the
    # top: importing this module alone loads nothing of the engine.
    from engine.config import (
        ACTIVATION_DIGITS,
        DECODE_ATTENTION,
        MODEL_IMPLS,
        POOLING_METHODS,
        QUANTIZATIONS,
    )
    from engine.speculative_options import SPECULATIVE_CHOICES

    engine = engine_flag_defaults()
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=engine["model"],
        help="smollm2-135m (default), tiny-random, a Hugging Face model directory, a .gguf file, "
        "or real-size random weights: random:llama-3.2-1b, random:llama-3.1-8b, random:qwen3-8b "
        "(random:tiny = tiny-random); noop is NO MODEL (load testing only: meaningless tokens)",
    )
    g.add_argument(
        "--noop-step-ms",
        type=float,
        default=engine["noop_step_ms"],
        metavar="MS",
        help="--model noop only (LOAD TESTING, never production): the fake forward's duration",
    )
    g.add_argument(
        "--device", default=engine["device"], help="auto (cuda if available), cpu, cuda, cuda:N"
    )
    g.add_argument(
        "--dtype",
        default=engine["dtype"],
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on cuda, float32 on cpu",
    )
    g.add_argument(
        "--kv-cache-memory",
        default=engine["kv_cache_memory"],
        metavar="BYTES",
        help="KV cache budget, e.g. 2GiB (default: cpu 1GiB; cuda: free memory × "
        "--gpu-memory-utilization after loading the model)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default=engine["kv_cache_dtype"],
        choices=["auto", "float32", "bfloat16", "float16"],
        help="what the KV cache stores (auto: the model's dtype); bfloat16 or float16 halve a "
        "float32 model's K/V: twice the tokens per budget, faster long-context decode",
    )
    g.add_argument("--gpu-memory-utilization", type=float, default=engine["gpu_memory_utilization"])
    g.add_argument(
        "--block-size", type=int, default=engine["block_size"], help="tokens per KV block"
    )
    g.add_argument("--batching", choices=sorted(POLICIES), default=engine["batching"])
    g.add_argument("--max-num-seqs", type=int, default=engine["max_num_seqs"], help="batch slots")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=engine["max_num_batched_tokens"],
        help="per-step token budget (decodes + prefill chunks)",
    )
    g.add_argument(
        "--max-queue-delay",
        type=float,
        default=engine["max_queue_delay"],
        help="dynamic batching: seconds the oldest request may wait for a full batch",
    )
    g.add_argument(
        "--reserve",
        action="store_true",
        help="reserve prompt + max_tokens of KV at admission (never preempt)",
    )
    g.add_argument(
        "--max-preemptions-per-seq",
        type=int,
        default=engine["max_preemptions_per_seq"],
        metavar="N",
        help="a sequence preempted N times is spared as a victim while others can be preempted",
    )
    g.add_argument(
        "--speculative",
        action=_StoreNotingGiven,
        choices=SPECULATIVE_CHOICES,
        default=engine["speculative"],
        help="speculative decoding: ngram verifies prompt-lookup drafts beside the batch's "
        "decodes (small batches; the same tokens, fewer steps); draft: a draft model's "
        "(--speculative-model, which implies it); none: off; auto: draft with a draft model, "
        "else ngram under continuous batching",
    )
    g.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='vLLM\'s speculative decoding object, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 5, "prompt_lookup_max": 4}\': its keys set the flags of '
        "the same names (method ngram or draft_model: --speculative; model: "
        "--speculative-model); a key Jitney cannot honour is refused, not dropped",
    )
    g.add_argument(
        "--speculative-model",
        action=_StoreNotingGiven,
        default=engine["speculative_model"],
        metavar="MODEL",
        help="speculative decoding with a draft model (any --model spec) that shares the "
        "target's tokenizer: it proposes greedily on its own KV pool, the target verifies",
    )
    g.add_argument(
        "--speculative-kv-cache-memory",
        default=engine["speculative_kv_cache_memory"],
        metavar="SIZE",
        help="the draft model's KV pool, taken out of the KV budget (default: an eighth of it)",
    )
    g.add_argument(
        "--num-speculative-tokens",
        action=_StoreNotingGiven,
        type=int,
        default=engine["num_speculative_tokens"],
        metavar="K",
        help="the most draft tokens one sequence verifies per step",
    )
    g.add_argument(
        "--prompt-lookup-max",
        action=_StoreNotingGiven,
        type=int,
        default=engine["prompt_lookup_max"],
        metavar="N",
        help="ngram: the longest tail looked up earlier in the sequence",
    )
    g.add_argument(
        "--prompt-lookup-min",
        action=_StoreNotingGiven,
        type=int,
        default=engine["prompt_lookup_min"],
        metavar="N",
        help="ngram: the shortest tail looked up",
    )
    g.add_argument(
        "--no-prompt-lookup-resume",
        action="store_true",
        help="ngram: only the tail's own n-grams (by default a copy an edit interrupted, whose "
        "last token matches nowhere, is also taken up again after the token it replaced)",
    )
    g.add_argument(
        "--speculative-history-tokens",
        type=int,
        default=engine["speculative_history_tokens"],
        metavar="N",
        help="ngram: the latest N tokens of finished replies whose n-grams are also looked up "
        "(0: a sequence's own text only)",
    )
    g.add_argument(
        "--speculative-max-step-tokens",
        type=int,
        default=engine["speculative_max_step_tokens"],
        metavar="N",
        help="drafts only while a step's rows (drafts included) stay within N: past the rows "
        "a step reads the weights for at about one row's cost, rejected drafts cost (default: "
        "the rows one pass of the CPU kernels serves, 4-8 by ISA, where the weights are "
        "quantized; else 8; a GPU gains to far more)",
    )
    g.add_argument(
        "--speculative-disable-by-batch-size",
        action=_StoreNotingGiven,
        type=int,
        default=engine["speculative_disable_by_batch_size"],
        metavar="N",
        help="no drafts while more than N sequences are running (vLLM's disable_by_batch_size; "
        "by default only the row cap, --speculative-max-step-tokens, stops them)",
    )
    g.add_argument(
        "--speculative-draft-row-cost",
        type=float,
        default=engine["speculative_draft_row_cost"],
        metavar="C",
        help="what one more row costs as a share of a one-row step: drafts are verified only "
        "while their measured odds of being kept pay for their rows (default: measured from "
        "the engine's own decode steps, starting from the CPU kernel level's figure where the "
        "weights are quantized, 0.1-0.11 on AVX-512 and AMX, 0.22-0.25 on AVX2, else 0.1; a "
        "number fixes it; 0: every draft the other limits allow)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=engine["max_model_len"],
        help="context window (default: the model's, capped to the KV cache)",
    )
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: decode-only steps run eagerly like every other step",
    )
    g.add_argument(
        "--decode-attention",
        choices=DECODE_ATTENTION,
        default=engine["decode_attention"],
        help="decode attention: triton reads K/V in place (CUDA), native reads them in place "
        "with Jitney's C++ kernel (CPU, float32), gather copies blocks then runs SDPA (any "
        "device); auto: triton on CUDA, native on a CPU, where each runs; else gather",
    )
    g.add_argument(
        "--model-impl",
        choices=MODEL_IMPLS,
        default=engine["model_impl"],
        help="which forward runs the model: jitney (its own, for the Llama family: Llama, "
        "SmolLM2, Qwen2, Qwen3, Mistral), transformers (the reference), auto: jitney where the "
        "architecture is covered, else transformers",
    )
    g.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=engine["quantization"],
        help="gguf: keep a GGUF model's own 4/8-bit blocks (Q4_0, Q4_1, Q8_0) and multiply them "
        "with Jitney's CPU kernels (Jitney's forward, CPU; float32 activations, bf16 tiles for "
        "batched steps where the CPU has AMX); int8: Q8_0 blocks made at load from any covered "
        "model's weights, the same kernels; none: dense weights in --dtype (the exact mode); "
        "auto: gguf for a GGUF model the kernels cover, else none",
    )
    g.add_argument(
        "--activation-digits",
        type=int,
        choices=ACTIVATION_DIGITS,
        default=engine["activation_digits"],
        help="int8 digits per activation in the CPU kernels' integer products (AVX-512 VNNI, "
        "AMX, AVX2): 2, about 15 bits, greedy tokens as the dense model's; 1, llama.cpp's Q8 "
        "activations: 1.5x the tokens/s of a 64-request trace on a Zen 4, +0.3%% "
        "perplexity, 3%% of greedy tokens unlike the dense model's (docs/performance.md)",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the dense forward's layers (--quantization none; inductor's code is "
        "cached under the cache dir, so only the first start pays). Off by default: on the CPU "
        "it was measured to gain at one sequence and lose at batches (docs/performance.md)",
    )
    g.add_argument(
        "--cache-dir",
        default=engine["cache_dir"],
        help="model cache: GGUF tokenizers, GGUF files converted for transformers or the exact "
        "mode (JITNEY_CACHE_DIR)",
    )
    g.add_argument(
        "--chat-template",
        default=engine["chat_template"],
        metavar="FILE",
        help="the chat template to render chats with, in place of the model's own (a base "
        "model has none): a Jinja file, or the template itself inline (vLLM's flag)",
    )
    g.add_argument(
        "--threads",
        type=thread_count,
        default=None,
        metavar="N",
        help="compute threads (torch's pool, which the CPU kernels use); default: "
        "OMP_NUM_THREADS if set, else the physical cores among the CPUs this process may run "
        "on, capped by its cgroup CPU quota (a container's limit); the start-up log says which",
    )
    g.add_argument(
        "--pooling",
        choices=POOLING_METHODS,
        default=engine["pooling"],
        help="/v1/embeddings: the last token's final hidden state (vLLM's default for decoder "
        "models: in a causal model only it has seen the whole input) or the mean over the input",
    )
    add_lora_arguments(g, engine)


def thread_count(text: str) -> int:
    """--threads' type: a clear refusal of 0, a negative or a fraction, before torch loads."""
    from engine.threads import parse_thread_count

    try:
        return parse_thread_count(text, name="the thread count")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def engine_config_from_args(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    from engine.config import EngineConfig

    fields = dict(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        batching=args.batching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_queue_delay=args.max_queue_delay,
        reserve_full_length=args.reserve,
        max_preemptions_per_seq=args.max_preemptions_per_seq,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_max=args.prompt_lookup_max,
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_resume=not args.no_prompt_lookup_resume,
        speculative_history_tokens=args.speculative_history_tokens,
        speculative_max_step_tokens=args.speculative_max_step_tokens,
        speculative_disable_by_batch_size=args.speculative_disable_by_batch_size,
        speculative_draft_row_cost=args.speculative_draft_row_cost,
        speculative_model=args.speculative_model,
        speculative_kv_cache_memory=args.speculative_kv_cache_memory,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        enforce_eager=args.enforce_eager,
        decode_attention=args.decode_attention,
        model_impl=args.model_impl,
        quantization=args.quantization,
        activation_digits=args.activation_digits,
        compile=args.compile,
        cache_dir=args.cache_dir,
        noop_step_ms=args.noop_step_ms,
        pooling=args.pooling,
        chat_template=_chat_template(args.chat_template),
        **lora_fields(args),
    )
    if args.speculative_config is not None:
        fields.update(_speculative_config_fields(args))
    fields.update(overrides)
    return EngineConfig.from_flat(**fields)


def _chat_template(value: str | None) -> str | None:
    """--chat-template's template text (ValueError: unreadable, or not a template)."""
    if value is None:
        return None
    from engine.chat_template import resolve_chat_template

    return resolve_chat_template(value)


def _speculative_config_fields(args: argparse.Namespace) -> dict[str, object]:
    """--speculative-config's fields (flat names); a field its own flag also sets is refused
    (which wins would be a guess)."""
    from engine.speculative_config_json import speculative_config_fields

    fields = speculative_config_fields(args.speculative_config)
    defaults = engine_flag_defaults()
    given = getattr(args, GIVEN_FLAGS, None) or set()
    for field in fields:
        if field in given or getattr(args, field) != defaults[field]:
            raise ValueError(
                f"--speculative-config sets {field}; leave out --{field.replace('_', '-')}"
            )
    return fields


def engine_args_to_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of `args` as a command line, to start a worker with the same engine."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(parser)
    argv: list[str] = []
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or value is None or value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(value, list):  # nargs="+": every item, as the flag reads it (str)
            argv += [flag, *map(str, value)]
        elif action.nargs != 0:
            argv += [flag, str(value)]
        elif value:
            argv.append(flag)
    return argv
