"""The engine's configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.speculative_options import FLAT_FIELDS, SpeculativeOptions
from scheduler import POLICIES, SchedulerConfig
from scheduler.config import SCHEDULER_DEFAULTS as SCHED

if TYPE_CHECKING:  # torch loads with the engine, not with the command line's flag parsing
    import torch

DECODE_ATTENTION = ("auto", "triton", "native", "gather")
# Which forward runs the model (vLLM's name): Jitney's own for the Llama family
# (engine/models/llama.py), transformers' model on Jitney's paged attention, or auto: Jitney's
# where the architecture is covered, transformers' elsewhere.
MODEL_IMPLS = ("auto", "jitney", "transformers")
# How Jitney's forward keeps the weights: "none", dense in --dtype (the exact mode); "gguf", the
# GGUF file's own 4- and 8-bit blocks (Q4_0, Q4_1, Q8_0) multiplied by Jitney's CPU kernels;
# "int8", Q8_0 blocks made at load from any covered model's dense weights, the same kernels;
# "auto", gguf where the model is a GGUF file whose blocks the kernels cover (on the CPU), else
# none (engine/runner/model_runner.py resolve_quantization).
QUANTIZATIONS = ("auto", "none", "gguf", "int8")
# How many int8 digits the CPU kernels' integer one passes (AVX-512 VNNI, AMX, AVX2's int16)
# give each activation: 2, about 15 bits (greedy tokens as the dense model's), or 1, llama.cpp's
# Q8 activations (faster past one token, +0.3% perplexity; engine/kernels/csrc/quant_vnni.cpp).
ACTIVATION_DIGITS = (1, 2)
_DTYPES = ("float32", "bfloat16", "float16")
# How /v1/embeddings pools a prompt's final hidden states (engine/pooling.py): the last token's
# (vLLM's default for decoder models) or the mean over the prompt.
POOLING_METHODS = ("last", "mean")
# The largest LoRA rank the kernels take (engine/kernels/csrc/lora_add.cpp kMaxRank).
MAX_LORA_RANK = 1024


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "smollm2-135m"
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    # KV cache budget in bytes ("2GiB"). None: on CUDA a fraction of free memory, on CPU 1GiB.
    kv_cache_memory: str | None = None
    # What the KV pool stores (vLLM's --kv-cache-dtype): "float32", "bfloat16" or "float16";
    # "auto", float16 beside quantized weights on the CPU, else the model's dtype
    # (engine/kv_cache.py kv_storage_dtype; docs/performance.md).
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    batching: str = "continuous"
    # The scheduler's share: its defaults are SchedulerConfig's (one copy of the numbers).
    max_num_seqs: int = SCHED.max_num_seqs
    max_num_batched_tokens: int = SCHED.max_num_batched_tokens
    max_queue_delay: float = SCHED.max_queue_delay  # seconds; dynamic batching only
    reserve_full_length: bool = SCHED.reserve_full_length
    max_preemptions_per_seq: int = SCHED.max_preemptions_per_seq
    # Speculative decoding (scheduler/speculation/; engine/speculative_options.py): its
    # method, drafts, row cap and cost, draft model. The flags name its fields flat
    # (`from_flat`).
    speculative: SpeculativeOptions = field(default_factory=SpeculativeOptions)
    max_model_len: int | None = None  # None: the model's, capped to what the KV cache holds
    enable_prefix_caching: bool = True
    # CUDA graphs for decode-only steps (engine/runner/decode_graphs.py); True: every step eager.
    enforce_eager: bool = False
    # How decode tokens attend: "triton" reads K/V in place (engine/attention/triton_decode.py),
    # "gather" copies blocks then runs SDPA (any device); "auto": triton on CUDA where it runs,
    # else gather.
    decode_attention: str = "auto"
    model_impl: str = "auto"
    quantization: str = "auto"
    # The quantized kernels' int8 digits per activation (ACTIVATION_DIGITS); process-wide: the
    # C++ library has one setting, which the engine sets when it starts.
    activation_digits: int = 2
    # torch.compile the dense forward's layers (docs/performance.md: measured on the CPU, it
    # gains ~15% of a one-sequence step's non-matmul work and loses at batches; off by default).
    compile: bool = False
    cache_dir: str | None = None
    noop_step_ms: float = 0.0  # --model noop only: what its fake forward sleeps per step
    pooling: str = "last"  # embeddings: POOLING_METHODS
    # The chat template in place of the model's own (vLLM's --chat-template, as its text:
    # engine/chat_template.py resolve_chat_template reads the flag); None: the model's.
    chat_template: str | None = None
    # LoRA adapters served beside the base model (vLLM's --lora-modules name=path): PEFT
    # directories or llama.cpp GGUF adapters (engine/lora/), chosen per request by name.
    lora_modules: tuple[tuple[str, str], ...] = ()
    # How many adapters the engine holds at once (the least recently used one that no running
    # request uses makes room), and the largest rank it accepts (vLLM's --max-loras and
    # --max-lora-rank).
    max_loras: int = 4
    max_lora_rank: int = 64

    def __post_init__(self) -> None:
        if self.batching not in POLICIES:
            raise ValueError(f"batching must be one of {sorted(POLICIES)}, got {self.batching!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in _DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be auto or one of {sorted(_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(
                f"decode_attention must be one of {DECODE_ATTENTION}, got {self.decode_attention!r}"
            )
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.quantization not in ("none", "auto") and self.model_impl == "transformers":
            raise ValueError(
                f"quantization {self.quantization} runs on Jitney's forward, "
                "not --model-impl transformers"
            )
        if self.activation_digits not in ACTIVATION_DIGITS:
            raise ValueError(
                f"activation_digits must be one of {ACTIVATION_DIGITS}, "
                f"got {self.activation_digits!r}"
            )
        if self.pooling not in POOLING_METHODS:
            raise ValueError(f"pooling must be one of {POOLING_METHODS}, got {self.pooling!r}")
        if self.chat_template is not None:
            from engine.chat_template import check_chat_template

            check_chat_template(self.chat_template, "chat_template")
        self._check_lora()
        if self.noop_step_ms < 0:
            raise ValueError(f"noop_step_ms must be >= 0, got {self.noop_step_ms}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not isinstance(self.speculative, SpeculativeOptions):
            raise TypeError(
                f"speculative takes a SpeculativeOptions, got {self.speculative!r} (flat "
                "settings such as speculative='ngram': EngineConfig.from_flat)"
            )
        if self.speculative.model is not None and self.batching != "continuous":
            raise ValueError("a draft model speculates under continuous batching only")
        self.scheduler_config()  # validates the scheduler's share

    def _check_lora(self) -> None:
        names = [name for name, _ in self.lora_modules]
        if any(not name or not path for name, path in self.lora_modules):
            raise ValueError("lora_modules takes name=path pairs, each with a name and a path")
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names an adapter twice: {names}")
        if self.max_loras < 1 or not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(
                f"max_loras must be >= 1 and max_lora_rank in [1, {MAX_LORA_RANK}], got "
                f"{self.max_loras} and {self.max_lora_rank}"
            )
        if self.lora_modules and self.compile:
            raise ValueError("--compile compiles the base model's layers; LoRA adapters run eager")

    @classmethod
    def from_flat(cls, **fields: Any) -> EngineConfig:
        """A config from fields named as the flags name them: the speculative settings flat
        (`speculative="ngram", speculative_max_step_tokens=64`: FLAT_FIELDS), the rest as this
        class's own fields."""
        return cls().replace_flat(**fields)

    def replace_flat(self, **fields: Any) -> EngineConfig:
        """This config with `fields` changed, named as `from_flat` takes them."""
        flat = {FLAT_FIELDS[name]: fields.pop(name) for name in list(fields) if name in FLAT_FIELDS}
        speculative = dataclasses.replace(self.speculative, **flat)
        return dataclasses.replace(self, **fields, speculative=speculative)

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def scheduler_config(
        self, max_step_tokens: int | None = None, draft_row_cost: float | None = None
    ) -> SchedulerConfig:
        """The scheduler's settings; `max_step_tokens` and `draft_row_cost`: speculation's row
        cap and row cost as start-up resolved them (None: the configured ones, else the
        defaults)."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_queue_delay=self.max_queue_delay,
            reserve_full_length=self.reserve_full_length,
            max_preemptions_per_seq=self.max_preemptions_per_seq,
            speculative=self.speculative.resolve(self.batching, max_step_tokens, draft_row_cost),
        )
