"""`jitney bench busy`: how much of its quiet speed each system keeps beside a spinning process.

A real machine is rarely quiet (a browser, a neighbour on the VM's host, other pods on the node,
`make up`'s own gateway and Redis). Each case below is measured quiet and beside one spinner
(bench/spinner.py: `python -c "while True: pass"`, pinned to a CPU or left to the scheduler), in
rounds that alternate which comes first (quiet then busy, busy then quiet, ...), so a drift of the
machine falls on both alike. A case's figure is useful output tokens/s; its ratio is the median
of the rounds' busy/quiet ratios.

Cases: two workloads, one user (a 134-token prompt, 256 tokens) and the mixed trace (64 requests
at once), each
- offline: Jitney's engine in this process (bench/offline.py's TraceRun, speculation off unless
  asked, as against llama.cpp's engine), and `llama-batched-bench` for one user (it runs no trace);
- through the service: `jitney up` as a user starts it, and `llama-server`, each with its own
  defaults, loaded over the streamed OpenAI API by bench/serve.py (one user: one request; mixed:
  all at once). A service keeps its caches across rounds (prefix cache, reply history): one
  unmeasured pass of each case warms them first, so every measured round finds the same.
llama.cpp runs when its binaries are given, on the same GGUF file and thread count.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import llama_cpp
from bench.processes import jitney_up
from bench.serve import run_serve
from bench.spinner import Spinner
from bench.synthetic_trace import synthetic_trace
from bench.trace import TraceRequest, trace_requests
from launch.private_redis import free_port

if TYPE_CHECKING:  # torch: imported once a run needs it, so the CLI's flags stay light
    from engine.config import EngineConfig
    from engine.models.model_loader import LoadedModel

ONE_USER, MIXED = "one-user", "mixed"
WORKLOADS = (ONE_USER, MIXED)
OFFLINE, SERVICE = "offline", "service"
PATHS = (OFFLINE, SERVICE)
JITNEY, LLAMA = "jitney", "llama.cpp"
QUIET, BUSY = "quiet", "busy"


class BusyBenchError(RuntimeError):
    """A measurement failed (a request failed through a service, llama.cpp did not run)."""


@dataclass(frozen=True, slots=True)
class BusySetup:
    threads: int  # Jitney offline's and llama.cpp's (the service's worker resolves its own)
    rounds: int = 3
    spinner_cpu: int | None = None  # None: the spinner is not pinned
    workloads: tuple[str, ...] = WORKLOADS
    paths: tuple[str, ...] = PATHS
    one_user_prompt_len: int = 134
    one_user_tokens: int = 256
    max_tokens: int | None = None  # caps every request's output (small runs)
    service_flags: tuple[str, ...] = ()  # `jitney up`'s engine flags
    llama_bin_dir: str | None = None
    llama_gguf: str | None = None
    max_duration: float = 900.0  # seconds per measurement through a service


@dataclass(slots=True)
class Case:
    """One system, path and workload; `measure` runs it once and returns useful tokens/s."""

    system: str
    path: str
    workload: str
    measure: Callable[[], float]
    quiet: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.system} {self.path} {self.workload}"

    @property
    def ratios(self) -> list[float]:
        return [b / q if q > 0 else math.nan for q, b in zip(self.quiet, self.busy, strict=True)]

    def summary(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "path": self.path,
            "workload": self.workload,
            "quiet_tokens_per_s": [round(x, 2) for x in self.quiet],
            "busy_tokens_per_s": [round(x, 2) for x in self.busy],
            "quiet_median": round(statistics.median(self.quiet), 2),
            "busy_median": round(statistics.median(self.busy), 2),
            "ratios": [round(r, 3) for r in self.ratios],
            "ratio": round(statistics.median(self.ratios), 3),
        }


def one_user_requests(setup: BusySetup, vocab_size: int) -> list[TraceRequest]:
    """The one-user workload: a random prompt of the set length (seeded), then its tokens."""
    n = setup.one_user_prompt_len
    tokens = _capped(setup.one_user_tokens, setup)
    return trace_requests(synthetic_trace(1, tokens, vocab_size, prompt_len=(n, n)))


def capped_requests(requests: Sequence[TraceRequest], setup: BusySetup) -> list[TraceRequest]:
    return [replace(r, output_len=_capped(r.output_len, setup)) for r in requests]


def _capped(tokens: int, setup: BusySetup) -> int:
    return tokens if setup.max_tokens is None else min(tokens, setup.max_tokens)


def run_rounds(
    cases: Sequence[Case],
    setup: BusySetup,
    spinners: list[dict[str, Any]],
    say: Callable[[str], None],
) -> None:
    """`setup.rounds` rounds, each measuring every case quiet and busy, the order alternating
    by round; each busy measurement has a spinner of its own, recorded in `spinners`."""
    for r in range(1, setup.rounds + 1):
        order = (QUIET, BUSY) if r % 2 else (BUSY, QUIET)
        for case in cases:
            for phase in order:
                if phase == BUSY:
                    with Spinner(setup.spinner_cpu) as spinner:
                        value = case.measure()
                    assert spinner.record is not None
                    spinners.append({"round": r, "case": case.name, **spinner.record.to_dict()})
                    case.busy.append(value)
                else:
                    value = case.measure()
                    case.quiet.append(value)
                say(f"round {r} {case.name} {phase}: {value:.1f} tokens/s")


def offline_cases(
    setup: BusySetup,
    config: EngineConfig,
    loaded: LoadedModel,
    workloads: dict[str, list[TraceRequest]],
) -> list[Case]:
    from bench.offline import TraceRun

    def jitney(requests: list[TraceRequest]) -> Callable[[], float]:
        return lambda: TraceRun(config, loaded, requests).run_to_end().tokens_per_s

    cases = [Case(JITNEY, OFFLINE, name, jitney(reqs)) for name, reqs in workloads.items()]
    if setup.llama_bin_dir and ONE_USER in workloads:
        (request,) = workloads[ONE_USER]
        bin_dir, gguf = setup.llama_bin_dir, setup.llama_gguf or ""

        def llama() -> float:
            row = llama_cpp.batched_bench(
                bin_dir, gguf, len(request.prompt_ids), request.output_len, setup.threads
            )
            return row.tokens_per_s

        cases.append(Case(LLAMA, OFFLINE, ONE_USER, llama))
    return cases


def service_cases(
    system: str, url: str, setup: BusySetup, workloads: dict[str, list[TraceRequest]]
) -> list[Case]:
    def through(requests: list[TraceRequest], one_user: bool) -> Callable[[], float]:
        def measure() -> float:
            report = asyncio.run(
                run_serve(
                    url,
                    requests,
                    rate=None if one_user else math.inf,
                    concurrency=1 if one_user else None,
                    max_duration=setup.max_duration,
                )
            )
            if report["failed"]:
                raise BusyBenchError(f"{system}: requests failed: {report['failures']}")
            return float(report["output_throughput"])

        return measure

    return [
        Case(system, SERVICE, name, through(reqs, name == ONE_USER))
        for name, reqs in workloads.items()
    ]


@contextmanager
def llama_service(
    setup: BusySetup, workloads: dict[str, list[TraceRequest]], workdir: str
) -> Iterator[str]:
    """llama-server with a slot per request of the largest workload, each slot long enough for
    the longest request."""
    requests = [r for reqs in workloads.values() for r in reqs]
    slots = max(len(reqs) for reqs in workloads.values())
    per_slot = max(len(r.prompt_ids) + r.output_len for r in requests) + 16
    with llama_cpp.llama_server(
        setup.llama_bin_dir or "",
        setup.llama_gguf or "",
        setup.threads,
        slots,
        slots * per_slot,
        free_port(),
        Path(workdir) / "llama-server.log",
    ) as url:
        yield url


def run_busy_bench(
    setup: BusySetup,
    config: EngineConfig,
    loaded: LoadedModel,
    workloads: dict[str, list[TraceRequest]],
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every case of the setup: offline ones first (interleaved in rounds), then each service
    started, warmed, measured in rounds and stopped in turn."""
    spinners: list[dict[str, Any]] = []
    done: list[Case] = []
    if OFFLINE in setup.paths:
        cases = offline_cases(setup, config, loaded, workloads)
        run_rounds(cases, setup, spinners, say)
        done += cases
    if SERVICE in setup.paths:
        with ExitStack() as stack:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="jitney-busy-"))
            services = [(JITNEY, lambda: jitney_up(list(setup.service_flags), workdir))]
            if setup.llama_bin_dir:
                services.append((LLAMA, lambda: llama_service(setup, workloads, workdir)))
            for system, start in services:
                with start() as url:
                    say(f"{system} service up at {url}")
                    cases = service_cases(system, url, setup, workloads)
                    for case in cases:  # warm its caches: every measured round finds the same
                        case.measure()
                    run_rounds(cases, setup, spinners, say)
                done += cases
    return {
        "rounds": setup.rounds,
        "threads": setup.threads,
        "spinner": {"cpu": setup.spinner_cpu, "runs": spinners},
        "workloads": {
            name: {"requests": len(reqs), "output_tokens": sum(r.output_len for r in reqs)}
            for name, reqs in workloads.items()
        },
        "cases": [case.summary() for case in done],
    }


def format_table(report: dict[str, Any]) -> str:
    header = (
        f"{'system':<10} {'path':<8} {'workload':<9} {'quiet tok/s':>11} {'busy tok/s':>11} "
        f"{'busy/quiet':>10}"
    )
    lines = [header, "-" * len(header)]
    for c in report["cases"]:
        lines.append(
            f"{c['system']:<10} {c['path']:<8} {c['workload']:<9} {c['quiet_median']:>11.1f} "
            f"{c['busy_median']:>11.1f} {c['ratio']:>10.2f}"
        )
    spinner = report["spinner"]
    where = "not pinned" if spinner["cpu"] is None else f"pinned to CPU {spinner['cpu']}"
    lines.append(
        f"medians of {report['rounds']} round(s); busy: one spinner, {where}; "
        f"{report['threads']} thread(s)"
    )
    return "\n".join(lines)
