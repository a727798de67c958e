"""The models this gateway can serve: ModelCards from Redis, with a tokenizer rebuilt per card.

A model is served while its card exists and a worker serving it has a fresh heartbeat (each
worker heartbeats into its model's `{p}:model_workers:{model}` set too).
Cards are found by a background scan and on a miss (so a worker that just started is found at
once); each is re-read every `card_refresh_s` (a tokenizer JSON can be megabytes) and its
tokenizer rebuilt only when the card changed.
Tokenizing runs on one dedicated thread: it keeps long prompts off the event loop, and HF fast
tokenizers are not safe to call from several threads at once. Detokenizing replies (a few
microseconds a token) runs on the event loop, on a tokenizer instance of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import redis.asyncio as aioredis
from jinja2 import TemplateError
from llguidance import LLTokenizer
from redis.exceptions import RedisError
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from gateway.openai.errors import ApiError, bad_request, model_not_found
from gateway.openai.generation_fields import GenerationFields
from gateway.serving.tasks import cancel_and_wait
from generation import grammar as grammars
from generation.reasoning import ReasoningFormat, ReasoningStream, content_grammar
from protocol import HEARTBEAT_TTL_S, Keys, ModelCard
from protocol.lora_registry import read_registry
from protocol.messages import MESSAGE_FIELD
from protocol.model_card import tokenizer_from_card
from protocol.sampling_defaults import SamplingDefaults

log = logging.getLogger(__name__)

R = TypeVar("R", bound=GenerationFields)
# Prompt tokens read for where a chat's output starts (a reasoning marker the template wrote, and
# the whitespace after it): enough even at a token per character.
PROMPT_TAIL_TOKENS = 64


@dataclass(slots=True)
class ServedModel:
    card: ModelCard
    tokenizer: PreTrainedTokenizerFast  # only on the tokenizer thread
    decoder: Tokenizer  # only on the event loop: the replies' text (generation.detokenizer)
    digest: str  # of the card's encoded form: a changed card rebuilds the tokenizer
    read_at: float  # monotonic seconds
    # llguidance's view of the tokenizer, to compile grammars against (None: it could not be
    # built; grammars are then checked without it). Only on the tokenizer thread.
    lltokenizer: LLTokenizer | None = None
    # The card's, validated when it was read (a card with bad ones is not served).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # How its chat outputs split into reasoning and content (--reasoning-parser); None: not.
    reasoning: ReasoningFormat | None = None
    # The LoRA adapter a request named as its `model` (None: the model itself). A request under
    # an adapter is this model's in every other way: its queue, tokenizer, limits and defaults.
    adapter: str | None = None
    # The fleet's adapters loaded at runtime for this model (protocol/lora_registry.py): name ->
    # path, as the registry's last reading found them.
    runtime_adapters: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The base model's name: its queue's, and what its workers check."""
        return self.card.name

    @property
    def served_name(self) -> str:
        """What the request named, and what its response says: the adapter, else the model."""
        return self.adapter or self.card.name

    @property
    def adapter_names(self) -> list[str]:
        """Every adapter served on this model: its workers' own, then the runtime ones."""
        return [*self.card.adapters, *self.runtime_adapters]

    @property
    def root(self) -> str:
        """What /v1/models says it was made from (vLLM's `root`): a runtime adapter's path, else
        the adapter's or the model's name."""
        return self.runtime_adapters.get(self.adapter or "", self.served_name)

    def under(self, adapter: str) -> ServedModel:
        """This model as a request naming `adapter` gets it (a shallow copy: the same
        tokenizers, so the tokenizer-thread rule holds for it as for the original)."""
        return replace(self, adapter=adapter)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def encode_text(self, text: str) -> list[int]:
        """`text` as it would appear inside a reply: no special tokens added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @property
    def template_has_tools(self) -> bool:
        """Whether the chat template renders a `tools` argument itself."""
        template = self.tokenizer.chat_template
        return isinstance(template, str) and "tools" in template

    def with_defaults(self, request: R, prompts: Sequence[Sequence[int]]) -> R:
        """`request` with this model's sampling defaults in the fields it did not send (the
        request path calls it once its prompts are tokenized, before reading max_tokens): a
        default max_tokens is capped to what fits beside the longest prompt."""
        room = self.card.max_model_len - max(map(len, prompts), default=0)
        return request.with_defaults(self.sampling_defaults, room)

    def grammar_error(self, grammar: str) -> str | None:
        """Why `grammar` does not compile for this model (None: it does)."""
        return grammars.validate(grammar, self.lltokenizer)

    def chat_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """A chat's token ids: the template rendered (with the client's `chat_template_kwargs`),
        then encoded as apply_chat_template's tokenize=True encodes; by default as chat
        completions render it. Every route renders a chat here, on the tokenizer thread."""
        if not self.tokenizer.chat_template:
            raise bad_request(
                f"Model {self.name!r} has no chat template; use /v1/completions.",
                param="messages",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(template_kwargs or {}),
            )
        except (TemplateError, ValueError) as e:  # the template refused the chat
            # The template's own message ("roles must alternate"), never the messages themselves.
            reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise bad_request(
                f"The model's chat template rejected the messages: {reason}", param="messages"
            ) from None
        except (TypeError, ArithmeticError, LookupError, AttributeError):
            # A value the template misused ({{ n + 1 }} with a string): the message may quote
            # the client's kwargs, so it is not repeated.
            what = "the messages or 'chat_template_kwargs'" if template_kwargs else "the messages"
            raise bad_request(
                f"The model's chat template rejected {what}.", param="messages"
            ) from None
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def reasoning_stream(self, prompt_ids: Sequence[int]) -> ReasoningStream | None:
        """The splitter of a chat output after `prompt_ids` (None: no reasoning parser)."""
        if self.reasoning is None:
            return None
        return ReasoningStream.after_prompt(self.reasoning, self._prompt_tail(prompt_ids))

    def content_grammar(self, grammar: str, prompt_ids: Sequence[int]) -> str:
        """A chat's grammar, for its content only: the reasoning before it is not constrained
        (with no reasoning parser, `grammar` itself)."""
        if self.reasoning is None:
            return grammar
        phase = self.reasoning.phase_after(self._prompt_tail(prompt_ids))
        return content_grammar(self.reasoning, phase, grammar)

    def _prompt_tail(self, prompt_ids: Sequence[int]) -> str:
        tail = list(prompt_ids[-PROMPT_TAIL_TOKENS:])
        return self.decoder.decode(tail, skip_special_tokens=False)


def _find(models: Sequence[ServedModel], name: str) -> ServedModel | None:
    """The model called `name`, else the model serving an adapter of that name (a model's own
    name wins over an adapter's)."""
    for model in models:
        if model.name == name:
            return model
    for model in models:
        if name in model.adapter_names:
            return model.under(name)
    return None


def served_adapters(models: Sequence[ServedModel]) -> list[ServedModel]:
    """Every LoRA adapter `models` serve, each under its base model (by name; an adapter named
    as a model, or as an earlier model's adapter, is that one)."""
    taken = {m.name for m in models}
    found: list[ServedModel] = []
    for model in models:
        for adapter in model.adapter_names:
            if adapter not in taken:
                taken.add(adapter)
                found.append(model.under(adapter))
    return sorted(found, key=lambda a: a.served_name)


class ModelRegistry:
    """Liveness (one ZCOUNT per model, pipelined) is re-read at most every `live_s` on the
    request path; the card scan (the `{p}:models` set, then each card's hash) runs in the
    background every `scan_s`, and on a miss at most every `miss_rescan_s`."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        executor: Executor,
        live_s: float = 1.0,
        scan_s: float = 5.0,
        miss_rescan_s: float = 0.5,
        card_refresh_s: float = 30.0,
        require_workers: bool = True,
        reasoning: Callable[[str], ReasoningFormat | None] = lambda model: None,
    ):
        self.redis = redis
        self.keys = keys
        self.executor = executor
        self.live_s = live_s
        self.scan_s = scan_s
        self.miss_rescan_s = miss_rescan_s
        self.card_refresh_s = card_refresh_s
        # False (scale to zero): its requests wait in the queue for the model's first worker.
        self.require_workers = require_workers
        self.reasoning = reasoning  # each model's reasoning parser (GatewayConfig's)
        self._models: dict[str, ServedModel] = {}
        self._live: set[str] = set()  # models with a live worker, as last read
        self._live_at = -float("inf")
        self._scanned_at = -float("inf")
        self._lock = asyncio.Lock()
        # Scans started, and the last one's failure: a request that waited on a scan that
        # failed answers with that failure instead of waiting out a second Redis timeout.
        self._num_scans = 0
        self._scan_error: RedisError | OSError | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._rescan_loop(), name="jitney-model-registry")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def live_models(self, miss: bool = False) -> list[ServedModel]:
        """`miss`: the caller did not find what it needs, so re-read sooner (a worker may have
        just started: its heartbeat or card came after our last look)."""
        miss = miss or not self._models
        await self._rescan_if_older_than(self.miss_rescan_s if miss else self.scan_s * 2)
        if time.monotonic() - self._live_at >= (self.miss_rescan_s if miss else self.live_s):
            names = list(self._models)
            now = time.time()
            pipe = self.redis.pipeline(transaction=False)
            for name in names:
                pipe.zcount(self.keys.model_workers(name), now - HEARTBEAT_TTL_S, "+inf")
            counts = await pipe.execute() if names else []
            self._live = {name for name, n in zip(names, counts, strict=True) if n > 0}
            self._live_at = time.monotonic()
        # Scale to zero: a model whose card is published is served with no live worker.
        return [m for m in self.known_models() if m.name in self._live or not self.require_workers]

    def known_models(self) -> list[ServedModel]:
        """Every model with a card, live or not, by name."""
        return sorted(self._models.values(), key=lambda m: m.name)

    async def resolve(self, name: str | None) -> ServedModel:
        """The model a request names (a LoRA adapter: its base model, `under` it); `None`
        means the only one served."""
        models = await self.live_models()
        if (name is None and not models) or (name is not None and _find(models, name) is None):
            models = await self.live_models(miss=True)
        if name is None:
            if len(models) == 1:
                return models[0]
            if not models:
                raise ApiError(
                    503,
                    "No model is being served (no live worker).",
                    type="service_unavailable",
                    code="no_workers",
                    headers={"Retry-After": "1"},
                )
            raise bad_request("'model' is required: several models are served.", param="model")
        found = _find(models, name)
        if found is None:
            raise model_not_found(name)
        return found

    async def run(self, fn: Any, *args: Any) -> Any:
        """Run a tokenizer call on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _rescan_loop(self) -> None:
        while True:
            # An outage shows as 503s on requests; the next round retries.
            with contextlib.suppress(RedisError, OSError):
                await self._rescan_if_older_than(self.scan_s)
            await asyncio.sleep(self.scan_s / 2)

    async def _rescan_if_older_than(self, max_age_s: float) -> None:
        if time.monotonic() - self._scanned_at < max_age_s:
            return
        # A scan under way when we arrive counts as one we waited for.
        started = self._num_scans - self._lock.locked()
        async with self._lock:  # one scan at a time; waiters then see its result
            if self._num_scans != started and self._scan_error is not None:
                raise RedisError(f"the model registry scan failed: {self._scan_error}")
            if time.monotonic() - self._scanned_at >= max_age_s:
                self._num_scans += 1
                try:
                    await self._rescan()
                except (RedisError, OSError) as exc:
                    self._scan_error = exc
                    raise
                self._scan_error = None

    async def _rescan(self) -> None:
        # The names set, not SCAN: SCAN walks the whole keyspace of a shared Redis.
        names = {name.decode() for name in await self.redis.smembers(self.keys.models)}
        for name in list(self._models):
            if name not in names:
                del self._models[name]
        for name in names:
            cached = self._models.get(name)
            if cached is None or time.monotonic() - cached.read_at > self.card_refresh_s:
                await self._load(name, cached)
        await self._read_runtime_adapters()
        self._scanned_at = time.monotonic()

    async def _read_runtime_adapters(self) -> None:
        """Each model's runtime LoRA adapters (one pipelined HGETALL per model)."""
        models = list(self._models.values())
        pipe = self.redis.pipeline(transaction=False)
        for model in models:
            pipe.hgetall(self.keys.lora_adapters(model.name))
        readings = await pipe.execute() if models else []
        for model, fields in zip(models, readings, strict=True):
            model.runtime_adapters = {n: a.path for n, a in read_registry(fields).items()}

    def rescan_soon(self) -> None:
        """The next request re-reads the cards and adapters (this gateway changed them)."""
        self._scanned_at = -float("inf")

    async def _load(self, name: str, cached: ServedModel | None) -> None:
        fields = await self.redis.hgetall(self.keys.model(name))
        raw = fields.get(MESSAGE_FIELD.encode(), b"")
        digest = hashlib.sha256(raw).hexdigest()
        if cached is not None and cached.digest == digest:
            cached.read_at = time.monotonic()
            return
        try:
            card = ModelCard.decode(fields)
            if not isinstance(card.adapters, list) or not all(
                isinstance(a, str) for a in card.adapters
            ):
                raise ValueError("the card's adapters are not a list of names")
            defaults = SamplingDefaults.from_dict(card.sampling_defaults)
            tokenizer = await self.run(tokenizer_from_card, card)
            decoder = await self.run(Tokenizer.from_str, card.tokenizer_json)
        except Exception as e:  # one bad card must not stop the others
            log.warning("model card unusable model=%s error=%s", name, type(e).__name__)
            self._models.pop(name, None)
            return
        try:
            lltokenizer = await self.run(
                grammars.make_tokenizer, card.tokenizer_json, len(tokenizer), card.eos_token_ids
            )
        except Exception as e:  # structured outputs are then checked without the vocabulary
            log.warning("no llguidance tokenizer model=%s error=%s", name, type(e).__name__)
            lltokenizer = None
        reasoning = self.reasoning(name)
        self._models[name] = ServedModel(
            card, tokenizer, decoder, digest, time.monotonic(), lltokenizer, defaults, reasoning
        )
        log.info("model card loaded model=%s max_model_len=%d", name, card.max_model_len)
