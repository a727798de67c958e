"""What a lent GPU's few minutes should measure, in one run: `bench/gpu_check.sh OUT_DIR`.

Three sections, each recorded even when another fails (results.json + results.md in OUT_DIR):
1. correctness: on random:tiny, the engine's greedy tokens against transformers (the near-tie
   rule of bench/parity.py) with requests joining mid-run, chunked prefill and a KV pool small
   enough to force preemption; fp32, with n-gram speculation (the default) and without. Then
   bf16: the share of requests whose first 32 tokens equal the fp32 run's. And the host syncs of
   a sampled step's sampler (CUDA only).
2. decode: random:llama-3.1-8b in bf16, every sequence decoding with a 512-token context, at
   batch 1..256: ms per step, eager and with CUDA graphs, next to the weight-read bound (weight
   bytes over the device bandwidth, measured first with a large copy); the decode attention
   that ran (the Triton kernel where `auto` takes it) and, at batch 64, the gather path's step.
3. mixed: 256 requests with mixed-64's output lengths, all at t=0, on random:llama-3.2-1b:
   Jitney continuous against transformers `generate` (static batches) and transformers'
   continuous batching, useful tokens/s and the ratios.
Both files are rewritten after every measurement. Section 2 runs what the targets read first and
starts nothing new past its share of the budget (Budget), so section 3 still runs.
`--device cpu` runs the same code at small shapes (a test in `make test` does), so the script is
known to work before a GPU sees it. It needs only torch, transformers, tokenizers and numpy.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers

from bench.baselines import RunResult, best_hf_cb, run_hf_generate
from bench.offline import TraceRun
from bench.parity import greedy_parity_failure, reference_greedy
from bench.synthetic_trace import MIXED, synthetic_trace
from bench.trace import TraceRequest, trace_requests
from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.models.model_loader import LoadedModel, describe_loaded, load_model
from engine.models.random_models import RANDOM_PREFIX, build_random_model, random_model_config
from engine.sampler import TokenHistory, adjust_logits, sample, with_seed
from engine.speculative_options import SpeculativeOptions
from engine.step_timing import StepTiming, sync_device
from generation.sampling_params import SamplingParams

BF16_AGREEMENT_TOKENS = 32
ROOT = Path(__file__).resolve().parents[1]  # the repository: sync sites are named within it
# Small shapes for --device cpu: the family's layout (GQA, RoPE type, real vocabulary), shrunk.
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


@dataclass(frozen=True, slots=True)
class Profile:
    """The sizes of one run: the real ones on a GPU, small ones on a CPU."""

    dtype: torch.dtype
    decode_model: str
    decode_batches: tuple[int, ...]
    decode_context: int
    decode_steps: int
    decode_prefill_tokens: int  # the token budget of a step while the decode batch prefills
    mixed_model: str
    mixed_requests: int
    mixed_max_output: int | None  # None: mixed-64's own lengths (up to 512)
    hf_batch_size: int
    copy_bytes: int  # the bandwidth probe's buffer
    graph_batch: int  # the small model's decode batch for the graphs-vs-eager comparison
    gather_batch: int  # the decode batch also measured on the gather path (kernel vs gather)
    target_batches: tuple[int, ...]  # the decode batches the targets read: measured first
    budget_s: float | None  # the run's wall-clock budget (Budget); None: no limit
    overrides: dict[str, int] = field(default_factory=dict)
    decode_attention: str = "auto"  # EngineConfig.decode_attention of every Jitney run


GPU_PROFILE = Profile(
    dtype=torch.bfloat16,
    decode_model="llama-3.1-8b",
    decode_batches=(1, 16, 64, 128, 256),
    decode_context=512,
    decode_steps=32,
    decode_prefill_tokens=2048,
    mixed_model="llama-3.2-1b",
    mixed_requests=256,
    mixed_max_output=None,
    hf_batch_size=64,
    copy_bytes=4 << 30,
    graph_batch=16,
    gather_batch=64,
    target_batches=(64, 1),
    budget_s=450,  # the 8 minutes, less a margin for the mixed section's overrun
)
CPU_PROFILE = Profile(
    dtype=torch.float32,
    decode_model="llama-3.1-8b",
    decode_batches=(1, 4, 16),
    decode_context=64,
    decode_steps=4,
    decode_prefill_tokens=256,  # several prefill steps at batch 16, as on a GPU at batch 64
    mixed_model="llama-3.2-1b",
    mixed_requests=8,
    mixed_max_output=12,
    hf_batch_size=4,
    copy_bytes=64 << 20,
    graph_batch=4,
    gather_batch=4,
    target_batches=(4, 1),
    budget_s=None,
    overrides=SMALL,
)


# A section's results so far: written to disk at once, so a run cut short keeps them.
Report = Callable[[dict[str, Any]], None]


@dataclass
class Budget:
    """The run's wall-clock budget. Section 2 starts no new measurement once its share has
    passed (what it skips is listed), so section 3, one run per system, still gets its turn; a
    lent GPU's time is short, and the first run of the script there cannot know its speed."""

    seconds: float | None  # None: no limit
    decode_share: float = 0.6  # of the budget, from the run's start, for sections 1 and 2
    started: float = field(default_factory=time.perf_counter)

    def decode_allows(self) -> bool:
        elapsed = time.perf_counter() - self.started
        return self.seconds is None or elapsed < self.decode_share * self.seconds


# ----- 1. correctness ---------------------------------------------------------------------------
def _correctness_requests(seed: int = 0) -> list[tuple[list[int], int]]:
    """12 (prompt, max_tokens): prompts up to 60 tokens (chunked under a 32-token budget)."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(8, 280) for _ in range(rng.randint(5, 60))], rng.randint(24, 40))
        for _ in range(12)
    ]


def _run_joining(engine: Engine, requests: list[tuple[list[int], int]]) -> list[list[int]]:
    """Half the requests first, the rest after 5 steps (they join a running batch); greedy."""
    outputs: dict[str, list[int]] = {}
    half = len(requests) // 2

    def add(indices: range) -> None:
        for i in indices:
            prompt, n = requests[i]
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            engine.add_request(str(i), prompt, params)
            outputs[str(i)] = []

    add(range(half))
    steps = 0
    while engine.has_unfinished() or len(outputs) < len(requests):
        if steps == 5:
            add(range(half, len(requests)))
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        steps += 1
    return [outputs[str(i)] for i in range(len(requests))]


def _small_pool_engine(loaded: LoadedModel, num_blocks: int, speculative: str = "auto") -> Engine:
    block_size = 16
    config = EngineConfig(
        model=loaded.name,
        device=str(loaded.device),
        kv_cache_memory=str(num_blocks * block_size * loaded.kv_bytes_per_token),
        block_size=block_size,
        max_num_seqs=6,
        max_num_batched_tokens=32,
        speculative=SpeculativeOptions(speculative),
    )
    return Engine(config, loaded=loaded)


def check_correctness(device: torch.device) -> dict[str, Any]:
    """fp32 greedy against transformers with speculation (auto: n-gram) and without, each under
    the near-tie rule; a failure's key names the run ("3" with speculation, "3 plain" without)."""
    requests = _correctness_requests()
    ref = load_model(f"{RANDOM_PREFIX}tiny", device, torch.float32)  # transformers' attention
    wants = [reference_greedy(ref, prompt, n) for prompt, n in requests]
    runs: dict[str, list[list[int]]] = {}
    stats = {}
    for label, speculative in (("", "auto"), (" plain", "none")):
        fp32_model = load_model(f"{RANDOM_PREFIX}tiny", device, torch.float32)
        engine = _small_pool_engine(fp32_model, 20, speculative)
        runs[label] = _run_joining(engine, requests)
        stats[label] = engine.stats
    fp32, plain = runs[""], runs[" plain"]
    failures, exact = {}, 0
    for label, outputs in runs.items():
        for i, ((prompt, _), got, want) in enumerate(zip(requests, outputs, wants, strict=True)):
            exact += not label and got == want
            if (why := greedy_parity_failure(ref, prompt, got, want)) is not None:
                failures[f"{i}{label}"] = why
    preemptions = stats[""].num_preemptions_total
    bf16_engine = _small_pool_engine(load_model(f"{RANDOM_PREFIX}tiny", device, torch.bfloat16), 20)
    bf16 = _run_joining(bf16_engine, requests)
    k = BF16_AGREEMENT_TOKENS
    agree = sum(a[:k] == b[:k] for a, b in zip(fp32, bf16, strict=True))
    return {
        "passed": not failures and preemptions > 0,
        "requests": len(requests),
        "exact_match_generate": exact,
        "near_tie_failures": failures,
        "preemptions": preemptions,
        "speculation": {
            "draft_tokens": stats[""].num_draft_tokens_total,
            "accepted_tokens": stats[""].num_accepted_tokens_total,
            "equal_to_plain": sum(a == b for a, b in zip(fp32, plain, strict=True)),
        },
        "bf16_first_32_agreement": agree / len(requests),
        "sampling_host_syncs": sampling_sync_sites(device),
    }


def count_sampling_syncs(device: torch.device) -> int | None:
    """Host syncs one sampled step's sampler makes (temperature, top-k, top-p, penalties, bias,
    min_tokens) on a CUDA device, by torch's sync debug mode; None elsewhere. One is the
    transfer of the sampled ids back; any more make the host wait on the device mid-step."""
    sites = sampling_sync_sites(device)
    return None if sites is None else len(sites)


def sampling_sync_sites(device: torch.device) -> list[str] | None:
    """count_sampling_syncs's syncs, each as the file:line that made it."""
    if device.type != "cuda":
        return None
    rows, vocab = 8, 32000
    logits = torch.randn(rows, vocab, device=device)
    params = [
        with_seed(
            SamplingParams(
                temperature=0.8,
                top_k=50 * (i % 2),
                top_p=0.9,
                frequency_penalty=0.5,
                repetition_penalty=1.1,
                logit_bias=((7, 2.0),),
                min_tokens=4,
            )
        )
        for i in range(rows)
    ]
    histories = [TokenHistory([1, 2, 3], [4, 5], (2,)) for _ in range(rows)]
    sites: list[str] = []

    def record(message: Warning | str, *args: Any, **kwargs: Any) -> None:
        if "synchroniz" in str(message):  # where in the repository, and where in torch if not
            stack = [f for f in traceback.extract_stack()[:-1] if f.filename != warnings.__file__]
            ours = [f for f in stack if f.filename.startswith(str(ROOT)) and f.name != "record"]
            where = [_site(f) for f in (ours[-1:] + stack[-1:])] if ours else [_site(stack[-1])]
            sites.append(" via ".join(dict.fromkeys(where)))

    torch.cuda.synchronize(device)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        start = len(sites)  # switching the mode on can warn too (seen on torch 2.11): not counted
        try:
            sample(adjust_logits(logits, params, histories), params, [2] * rows)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites[start:]


def _site(frame: traceback.FrameSummary) -> str:
    path = Path(frame.filename)
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return f"{shown}:{frame.lineno} ({frame.name})"


# ----- 2. decode step ---------------------------------------------------------------------------
def measure_bandwidth(device: torch.device, num_bytes: int, repeats: int = 10) -> float:
    """Bytes per second of a device-to-device copy (each byte read once and written once)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync_device(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync_device(device)
    elapsed = time.perf_counter() - start
    del src, dst
    return 2 * num_bytes * repeats / elapsed


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads (a tied embedding counts once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def build_loaded(name: str, device: torch.device, profile: Profile) -> LoadedModel:
    model, tokenizer = build_random_model(name, device, profile.dtype, **profile.overrides)
    return describe_loaded(model, tokenizer, RANDOM_PREFIX + name)


def _decode_step_ms(
    loaded: LoadedModel,
    batch: int,
    profile: Profile,
    enforce_eager: bool,
    decode_attention: str | None = None,
) -> dict[str, Any]:
    """Mean step and forward ms once all `batch` sequences decode at the profile's context
    (with CUDA graphs on a GPU unless `enforce_eager`; the warm step captures the graph), and
    the decode attention that ran. Every timed step decodes all `batch` rows (else it raises):
    the first requests decode while the last prefill, so each asks for enough tokens to outlast
    the prefill steps and the timed ones."""
    ctx, steps = profile.decode_context, profile.decode_steps
    budget = max(profile.decode_prefill_tokens, ctx + batch)
    prefill_steps = -(-batch * ctx // (budget - batch))  # the decodes take part of each budget
    max_tokens = prefill_steps + steps + 4
    config = EngineConfig(
        model=loaded.name,
        device=str(loaded.device),
        kv_cache_memory=str((batch * (ctx + max_tokens) + 64 * 16) * loaded.kv_bytes_per_token),
        max_num_seqs=batch,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
        enforce_eager=enforce_eager,
        decode_attention=decode_attention or profile.decode_attention,
        speculative=SpeculativeOptions("none"),  # plain decode steps: the cost, graphs and all
    )
    engine = Engine(config, loaded=loaded)
    rng = random.Random(batch)
    vocab = loaded.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(256, vocab) for _ in range(ctx)], params)
    started: set[str] = set()
    while len(started) < batch:  # prefill everyone (and one warm decode step)
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    engine.step()
    step_s = 0.0
    phases = StepTiming()
    for _ in range(steps - 1):
        start = time.perf_counter()
        rows = sum(bool(out.new_token_ids) for out in engine.step())
        step_s += time.perf_counter() - start
        phases.add(engine.last_step_timing)
        if rows != batch:
            raise RuntimeError(f"a timed step of batch {batch} decoded {rows} rows")
    n = steps - 1
    contexts = [seq.num_tokens for seq in engine.view.sequences()]
    graphs = engine.view.decode_graphs
    graphed = graphs is not None and graphs.failed is None and graphs.num_steps >= n
    failure = None if graphs is None else graphs.failed
    attention, why_not = engine.decode_attention, engine.decode_kernel_unused_because
    forward_name = engine.view.forward_name
    del engine
    return {
        "forward": forward_name,  # which model path ran ("jitney-none": Jitney's own forward)
        "step_ms": 1000 * step_s / n,
        "forward_ms": 1000 * phases.forward / n,
        # Where the step goes (engine/step_timing.py), each phase's mean ms.
        "phases_ms": {name: 1000 * t / n for name, t in phases.as_dict().items()},
        "graphed": graphed,
        "graph_failure": failure,
        "decode_attention": attention,
        "kernel_unused_because": why_not,
        "contexts": [min(contexts), max(contexts)],
    }


def check_decode(
    device: torch.device, profile: Profile, budget: Budget, report: Report
) -> dict[str, Any]:
    """The section's measurements in the order of `decode_plan`, the targets' first, each
    started only while the budget's decode share lasts; `report` gets the section after each."""
    bandwidth = measure_bandwidth(device, profile.copy_bytes)
    models = {"decode": build_loaded(profile.decode_model, device, profile)}
    weights = weight_bytes(models["decode"].model)
    section: dict[str, Any] = {
        "model": RANDOM_PREFIX + profile.decode_model,
        "dtype": str(profile.dtype).removeprefix("torch."),
        "weight_bytes": weights,
        "bandwidth_gb_s": bandwidth / 1e9,
        "weight_read_bound_ms": 1000 * weights / bandwidth,
        "cuda_graphs": "off the GPU: eager only" if device.type != "cuda" else "not used yet",
        "rows": [],
        "small_model": RANDOM_PREFIX + profile.mixed_model,
        "small_model_rows": [],
        "skipped": [],
        "errors": [],  # measurements that failed (the others still ran)
    }
    failures: list[str] = []
    for what, batch in decode_plan(profile):
        if not budget.decode_allows():
            section["skipped"].append(f"{what} batch {batch}")
            continue
        try:
            failures += _decode_measure(what, batch, section, models, device, profile, bandwidth)
        except Exception as e:  # an OOM at one batch must not lose the other rows
            section["errors"].append(f"{what} batch {batch}: {type(e).__name__}: {e}")
        _free(device)
        if device.type == "cuda":
            kernel = any(r["decode_attention"] == "triton" for r in section["rows"])
            captured = (
                "one per batch, captured at start"
                if kernel
                else "one per (batch, width), captured on first use"
            )
            section["cuda_graphs"] = "; ".join(failures) or captured
        report(section)
    del models
    return section


def _decode_measure(
    what: str,
    batch: int,
    section: dict[str, Any],
    models: dict[str, LoadedModel],
    device: torch.device,
    profile: Profile,
    bandwidth: float,
) -> list[str]:
    """One entry of `decode_plan` into `section`; returns why graphs were given up, if so."""
    if what == "gather":
        row = next((r for r in section["rows"] if r["batch"] == batch), None)
        if row is None or row["decode_attention"] != "triton":
            return []  # no kernel row to compare with (it failed, or gather ran already)
        # What reading K/V in place buys: the same step on the portable gather path.
        gather = _decode_step_ms(
            models["decode"], batch, profile, device.type != "cuda", decode_attention="gather"
        )
        row["gather_step_ms"] = gather["step_ms"]
        return []
    if what not in models:  # the small model, where launch overhead weighs most
        models[what] = build_loaded(profile.mixed_model, device, profile)
    row, failure = _decode_row(models[what], batch, device, profile, bandwidth)
    rows = section["rows" if what == "decode" else "small_model_rows"]
    rows.append(row)
    rows.sort(key=lambda r: r["batch"])
    return [failure] if failure else []


def decode_plan(profile: Profile) -> list[tuple[str, int]]:
    """(what, batch) in the order section 2 measures them: the rows the targets read (the 8B at
    `target_batches`, then the small model at `graph_batch`), then the 8B's other batches; the
    gather path beside the kernel at `gather_batch` as soon as the kernel's row is in."""
    first = [b for b in profile.target_batches if b in profile.decode_batches]
    rest = [b for b in profile.decode_batches if b not in first]
    plan = [("decode", b) for b in first] + [("small", profile.graph_batch)]
    plan += [("decode", b) for b in rest]
    if profile.gather_batch in profile.decode_batches:
        at = max(plan.index(("decode", profile.gather_batch)), len(first)) + 1
        plan.insert(at, ("gather", profile.gather_batch))
    return plan


def _decode_row(
    loaded: LoadedModel, batch: int, device: torch.device, profile: Profile, bandwidth: float
) -> tuple[dict[str, Any], str | None]:
    """One batch's step, eager and (on CUDA) with graphs, against the model's weight-read
    bound; and why graphs were given up, if they were."""
    bound_ms = 1000 * weight_bytes(loaded.model) / bandwidth
    eager = _decode_step_ms(loaded, batch, profile, enforce_eager=True)
    _free(device)
    row = {
        "batch": batch,
        "context": profile.decode_context,
        "forward": eager["forward"],
        "decode_attention": eager["decode_attention"],
        "kernel_unused_because": eager["kernel_unused_because"],
        "eager_step_ms": eager["step_ms"],
        "eager_forward_ms": eager["forward_ms"],
        "eager_phases_ms": eager["phases_ms"],
        "contexts": eager["contexts"],  # the shortest and longest after the timed steps
        "cuda_graph_step_ms": None,
        "gather_step_ms": None,
        "step_over_bound": eager["step_ms"] / bound_ms,
    }
    if device.type != "cuda":
        return row, None
    graphed = _decode_step_ms(loaded, batch, profile, enforce_eager=False)
    if not graphed["graphed"]:
        return row, graphed["graph_failure"]
    row["cuda_graph_step_ms"] = graphed["step_ms"]
    row["cuda_graph_phases_ms"] = graphed["phases_ms"]
    row["step_over_bound"] = graphed["step_ms"] / bound_ms
    row["graph_saving"] = 1 - graphed["step_ms"] / eager["step_ms"]
    return row, None


# ----- 3. mixed trace ---------------------------------------------------------------------------
def mixed_trace(num_requests: int, vocab_size: int, max_output: int | None) -> list[TraceRequest]:
    trace = synthetic_trace(num_requests, MIXED, vocab_size, seed=0)
    requests = trace_requests(trace)
    if max_output is None:
        return requests
    return [replace(r, output_len=min(r.output_len, max_output)) for r in requests]


def check_mixed(device: torch.device, profile: Profile, report: Report) -> dict[str, Any]:
    vocab = int(random_model_config(profile.mixed_model, **profile.overrides).vocab_size)
    requests = mixed_trace(profile.mixed_requests, vocab, profile.mixed_max_output)
    section: dict[str, Any] = {
        "model": RANDOM_PREFIX + profile.mixed_model,
        "requests": len(requests),
        "output_tokens": sum(r.output_len for r in requests),
        "runs": {},
    }
    # Jitney first, transformers' continuous batching (whose speed is least known) last: a run
    # cut short by its time limit keeps what was measured before.
    _record_mixed(section, "jitney-continuous", _mixed_jitney(device, profile, requests), report)
    _free(device)  # the engine built its own model (and patched it); the baselines get another
    ref = build_loaded(profile.mixed_model, device, profile)  # left on transformers' attention
    generate = partial(run_hf_generate, ref, requests, profile.hf_batch_size)
    _record_mixed(section, "hf-generate", _attempt(generate), report)
    # transformers' own defaults only: one run (its candidate search would cost minutes).
    _record_mixed(section, "hf-cb", _attempt(partial(best_hf_cb, ref, requests, [{}])), report)
    return section


def _record_mixed(section: dict[str, Any], name: str, run: RunResult | str, report: Report) -> None:
    """One system's row, and Jitney's ratio over each baseline once both have run."""
    runs = section["runs"]
    if isinstance(run, str):
        runs[name] = {"error": run}
    else:
        runs[name] = {"tokens_per_s": run.tokens_per_s, "wall_s": run.wall_s}
        for key in ("decode_attention", "cuda_graphs", "spec_draft_tokens", "spec_acceptance"):
            if key in run.extra:
                runs[name][key] = run.extra[key]
    jitney = runs.get("jitney-continuous", {}).get("tokens_per_s")
    for baseline in ("hf-generate", "hf-cb"):
        if baseline in runs:
            base = runs[baseline].get("tokens_per_s")
            runs[baseline]["jitney_ratio"] = jitney / base if jitney and base else None
    report(section)


def _mixed_jitney(
    device: torch.device, profile: Profile, requests: list[TraceRequest]
) -> RunResult | str:
    loaded = build_loaded(profile.mixed_model, device, profile)  # the engine patches its model
    config = EngineConfig(
        model=loaded.name,
        device=str(device),
        kv_cache_memory=None if device.type == "cuda" else "256MiB",
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        decode_attention=profile.decode_attention,
    )
    # Token ids out, as the baselines give them (and as a worker runs: gateways detokenize).
    return _attempt(lambda: TraceRun(config, loaded, requests, detokenize=False).run_to_end())


def _attempt(run: Callable[[], RunResult]) -> RunResult | str:
    """A baseline that fails (an API another transformers version lacks) is reported, not fatal."""
    try:
        return run()
    except Exception as e:  # reported in the results
        return f"{type(e).__name__}: {e}"


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----- the run ----------------------------------------------------------------------------------
def environment(device: torch.device) -> dict[str, Any]:
    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "host": platform.node(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_memory_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    return env


SECTIONS = ("correctness", "decode", "mixed")


def run_checks(
    device: torch.device,
    profile: Profile,
    sections: tuple[str, ...],
    done: Callable[[dict[str, Any]], None] = lambda results: None,
) -> dict:
    """Run `sections` in order within the profile's budget; `done(results so far)` after each
    one and after each measurement within one (a section being measured says `"finished":
    false`), so a run cut short by a time limit still leaves what it measured."""
    budget = Budget(profile.budget_s)
    name, start = "", 0.0

    def report(section: dict[str, Any]) -> None:
        results[name] = {**section, "seconds": time.perf_counter() - start, "finished": False}
        done(results)

    checks: dict[str, Callable[[], dict[str, Any]]] = {
        "correctness": lambda: check_correctness(device),
        "decode": lambda: check_decode(device, profile, budget, report),
        "mixed": lambda: check_mixed(device, profile, report),
    }
    results: dict[str, Any] = {"environment": environment(device), "profile": _profile(profile)}
    for name in sections:
        start = time.perf_counter()
        print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
        try:
            results[name] = checks[name]()
        except Exception as e:  # one section's failure must not lose the others, nor its own
            measured = {k: v for k, v in results.get(name, {}).items() if k != "finished"}
            error = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            results[name] = {**measured, **error}
        results[name]["seconds"] = time.perf_counter() - start
        _free(device)
        done(results)
    return results


def _profile(profile: Profile) -> dict[str, Any]:
    data = asdict(profile)
    data["dtype"] = str(profile.dtype).removeprefix("torch.")
    return data


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        f"# GPU check — {env.get('gpu', env['device'])}, {env['date']}",
        "",
        f"torch {env['torch']}, transformers {env['transformers']}, Python {env['python']}",
        "",
    ]
    for name, title, render in (
        ("correctness", "1. Correctness (random:tiny)", _md_correctness),
        ("decode", "2. Decode step", _md_decode),
        ("mixed", "3. Mixed trace, all at t=0", _md_mixed),
    ):
        if name in results:
            section = results[name]
            measured = set(section) - {"error", "trace", "seconds"}
            body = render(section) if measured else []  # what it measured before an error
            if "error" in section:
                body += (
                    ["", f"error: `{section['error']}`"]
                    if body
                    else [f"error: `{section['error']}`"]
                )
            if section.get("finished") is False:
                title += " — cut short: the run stopped here"
            lines += [f"## {title}", "", *body, ""]
    lines.append(f"Sections took {', '.join(_seconds(results))}.")
    return "\n".join(lines) + "\n"


def _md_correctness(c: dict[str, Any]) -> list[str]:
    return [
        f"- greedy vs transformers `generate`, fp32, near-tie rule: "
        f"{'**pass**' if c['passed'] else '**FAIL**'} ({c['requests']} requests, "
        f"{c['exact_match_generate']} token-for-token equal, {c['preemptions']} preemptions)",
        _md_speculation(c.get("speculation")),
        f"- bf16 first-32-token agreement with fp32: {100 * c['bf16_first_32_agreement']:.0f} %",
        f"- host syncs in a sampled step's sampler: {_md_syncs(c.get('sampling_host_syncs'))} "
        "(1 is the sampled ids' transfer)",
    ]


def _md_syncs(sites: list[str] | None) -> str:
    if sites is None:
        return "-"
    return f"{len(sites)}" + (f" ({', '.join(sites)})" if sites else "")


def _md_speculation(spec: dict[str, int] | None) -> str:
    if spec is None:
        return "- speculation: not measured"
    return (
        f"- n-gram speculation (the default) against none: {spec['equal_to_plain']} replies "
        f"equal; {spec['accepted_tokens']} of {spec['draft_tokens']} draft tokens kept"
    )


def _md_decode(d: dict[str, Any]) -> list[str]:
    first = d["rows"][0] if d["rows"] else {}
    attention = first.get("decode_attention", "?")
    if first.get("kernel_unused_because"):
        attention += f" ({first['kernel_unused_because']})"
    lines = [
        f"{d['model']} {d['dtype']}: {d['weight_bytes'] / 1e9:.2f} GB of weights, measured "
        f"bandwidth {d['bandwidth_gb_s']:.0f} GB/s, weight-read bound "
        f"{d['weight_read_bound_ms']:.2f} ms. CUDA graphs: {d['cuda_graphs']}. "
        f"Decode attention: {attention}.",
        "",
        "| batch | context | step ms, eager | forward ms, eager | step ms, CUDA graphs "
        "| best step / bound | step ms, gather path |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        gather = r.get("gather_step_ms")
        lines.append(
            _md_decode_row(r, f"{r['step_over_bound']:.2f}×")
            + (" - |" if gather is None else f" {gather:.2f} |")
        )
    lines += [
        "",
        f"{d['small_model']}, where launch overhead weighs most:",
        "",
        "| batch | context | step ms, eager | forward ms, eager | step ms, CUDA graphs "
        "| saved by graphs |",
        "|---|---|---|---|---|---|",
    ]
    for r in d["small_model_rows"]:
        saving = r.get("graph_saving")
        lines.append(_md_decode_row(r, "-" if saving is None else f"{100 * saving:.0f} %"))
    lines += _md_phases(
        [(str(r["batch"]), r) for r in d["rows"]]
        + [(f"{r['batch']}, {d['small_model']}", r) for r in d["small_model_rows"]]
    )
    for error in d.get("errors", ()):
        lines += ["", f"error: `{error}`"]
    if d.get("skipped"):
        skipped = ", ".join(d["skipped"])
        lines += ["", f"Not measured, past the decode section's time budget: {skipped}."]
    return lines


def _md_phases(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Where each (label, row)'s fastest step went, phase by phase (engine/step_timing.py)."""
    timed = [
        (label, r.get("cuda_graph_phases_ms") or r.get("eager_phases_ms")) for label, r in rows
    ]
    timed = [(label, phases) for label, phases in timed if phases]
    if not timed:
        return []
    names = [n for n in timed[0][1] if any(phases[n] for _, phases in timed)]
    lines = [
        "",
        "Where the step goes, ms (with CUDA graphs where they ran; forward waits for its kernels):",
        "",
        "| batch | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for label, phases in timed:
        lines.append(f"| {label} | " + " | ".join(f"{phases[n]:.2f}" for n in names) + " |")
    return lines


def _md_decode_row(r: dict[str, Any], last: str) -> str:
    graphed = r["cuda_graph_step_ms"]
    return (
        f"| {r['batch']} | {r['context']} | {r['eager_step_ms']:.2f} | "
        f"{r['eager_forward_ms']:.2f} | {'-' if graphed is None else f'{graphed:.2f}'} | {last} |"
    )


def _md_mixed(m: dict[str, Any]) -> list[str]:
    lines = [
        f"{m['model']}, {m['requests']} requests, {m['output_tokens']} output tokens.",
        "",
        "| system | useful tokens/s | Jitney ratio |",
        "|---|---|---|",
    ]
    for name, run in m["runs"].items():
        if "error" in run:
            lines.append(f"| {name} | error: `{run['error'][:120]}` | |")
        else:
            ratio = run.get("jitney_ratio")
            shown = "" if ratio is None else f"{ratio:.2f}×"
            lines.append(f"| {name} | {run['tokens_per_s']:.1f} | {shown} |")
    jitney = m["runs"].get("jitney-continuous", {})
    if "decode_attention" in jitney:
        lines += [
            "",
            f"Jitney: decode attention {jitney['decode_attention']}, "
            f"CUDA graphs {jitney.get('cuda_graphs')}, "
            f"{jitney.get('spec_draft_tokens', 0)} draft tokens verified"
            + (
                ""
                if jitney.get("spec_acceptance") is None
                else f" ({100 * jitney['spec_acceptance']:.0f} % kept)"
            )
            + ".",
        ]
    return lines


def _seconds(results: dict[str, Any]) -> list[str]:
    return [f"{name} {results[name]['seconds']:.1f} s" for name in SECTIONS if name in results]


def write_results(out: Path, results: dict[str, Any]) -> None:
    """Both files, each replaced whole (a run killed mid-write leaves the previous version)."""
    for name, text in (
        ("results.md", markdown(results)),
        ("results.json", json.dumps(results, indent=2, default=str)),
    ):
        partial = out / f".{name}.partial"
        partial.write_text(text)
        partial.replace(out / name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="where results.json and results.md go")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (small shapes)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma list of sections")
    p.add_argument(
        "--decode-batches",
        default=None,
        help="comma list of section 2's batch sizes (default: the profile's, 1..256 on a GPU)",
    )
    p.add_argument(
        "--decode-attention",
        choices=("auto", "triton", "gather"),
        default="auto",
        help="the engine's decode attention (auto: the Triton kernel on CUDA where it runs)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="the run's wall-clock budget: section 2 starts nothing new past 60%% of it "
        "(default: 450 on a GPU, none on a CPU; 0: none)",
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --device cpu for the small run", file=sys.stderr)
        return 2
    sections = tuple(s for s in args.sections.split(",") if s)
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {unknown}; choose from {SECTIONS}")
    profile = GPU_PROFILE if device.type == "cuda" else CPU_PROFILE
    profile = replace(profile, decode_attention=args.decode_attention)
    if args.budget_s is not None:
        if args.budget_s < 0:
            p.error(f"--budget-s takes seconds >= 0, got {args.budget_s}")
        profile = replace(profile, budget_s=args.budget_s or None)
    if args.decode_batches:
        try:
            batches = tuple(int(b) for b in args.decode_batches.split(","))
        except ValueError:
            batches = ()
        if not batches or min(batches) < 1:
            p.error(f"--decode-batches takes positive integers, got {args.decode_batches!r}")
        profile = replace(profile, decode_batches=batches)
    torch.manual_seed(0)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = run_checks(device, profile, sections, lambda partial: write_results(out, partial))
    print(markdown(results))
    failed = [s for s in sections if "error" in results[s] or results[s].get("errors")]
    if "correctness" in sections and not results["correctness"].get("passed"):
        failed.append("correctness")
    if failed:
        print(f"gpu_check: failed: {', '.join(sorted(set(failed)))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
