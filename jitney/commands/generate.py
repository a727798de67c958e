"""`jitney generate`: run the engine offline on a few prompts and print the answers."""

from __future__ import annotations

import argparse
import gc
import sys
import time

from jitney.commands.engine_args import add_engine_arguments, engine_config_from_args

EXAMPLES = """\
examples:
  jitney generate "What is the capital of France?" "Write a haiku about the sea."
  jitney generate --model ./base --lora-modules sql=./sql-lora chat=./chat-lora --lora sql \\
      "List the tables."

--lora-modules takes every word up to the next flag: give the prompts before it, after another
flag (--lora NAME above), or after `--` (... --lora-modules sql=./sql-lora -- "a prompt").
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter  # the examples as written
    p.epilog = EXAMPLES
    p.add_argument("prompts", nargs="+", help="user messages (chat template applied) or raw text")
    p.add_argument(
        "--lora",
        metavar="NAME",
        default=None,
        help="run the prompts under this LoRA adapter (a --lora-modules name); without it, the "
        "base model",
    )
    p.add_argument(
        "--raw",
        action="store_true",
        help="send the prompts as plain text, not as chat messages (a base model has no template)",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_arguments(p)


def run(args: argparse.Namespace) -> int:
    from engine.threads import apply_threads, resolve_threads
    from generation import SamplingParams

    try:  # before torch is imported and the model loads: a bad value fails in a moment
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=tuple(args.stop),
        )
        config = engine_config_from_args(args)  # bad engine flags too
        check_lora(args.lora, [name for name, _ in config.lora_modules])
        threads = resolve_threads(args.threads)  # and a bad OMP_NUM_THREADS
    except ValueError as e:
        raise SystemExit(f"generate: {e}") from None
    if not args.raw and config.chat_template is None:
        from engine.chat_template import has_chat_template

        if has_chat_template(config.model) is False:  # read from its files: nothing loads
            raise SystemExit(no_template(config.model))

    from engine.llm_engine import Engine

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    apply_threads(threads)
    progress(threads.describe())

    engine = Engine(config, progress=progress)
    tok = engine.loaded.tokenizer
    if args.raw:
        prompts = [tok.encode(p) for p in args.prompts]
    elif not tok.chat_template:  # what the files did not tell before the load
        raise SystemExit(no_template(config.model))
    else:
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            for p in args.prompts
        ]
    start = time.perf_counter()
    results = engine.generate(prompts, params, lora=args.lora)
    elapsed = time.perf_counter() - start
    for prompt, res in zip(args.prompts, results, strict=True):
        print(f"### {prompt}\n{res.text}\n[{len(res.token_ids)} tokens, {res.finish_reason}]\n")
    total = sum(len(r.token_ids) for r in results)
    print(f"{total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tokens/s)", file=sys.stderr)
    # The process ends here. Its objects frozen, the interpreter's collections at exit skip
    # them: they walked torch's and the model's objects again and again, 0.5 s of every run.
    gc.freeze()
    return 0


def check_lora(name: str | None, served: list[str]) -> None:
    """`--lora` names one of `--lora-modules` (ValueError, before the model loads)."""
    if name is not None and name not in served:
        listed = ", ".join(served) if served else "none given"
        raise ValueError(f"--lora {name!r} is not one of --lora-modules ({listed})")


def no_template(model: str) -> str:
    return (
        f"generate: {model} has no chat template (a base model?), so the prompts cannot be "
        "sent as chat messages: add --raw to send them as plain text, or --chat-template FILE "
        "to give it a template"
    )
