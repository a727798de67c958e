"""What tracing costs a worker's step: the loop's per-step work with tracing off and on.

`python -m research.tracing_cost [--model tiny-random] [--seats 32] [--steps 300] [--rounds 3]`:
an engine kept full of requests (prompts of 16-64 tokens, 8-48 output tokens each, a new one
as soon as one ends: chunked prefills, first tokens and finishes in most steps) runs the steps
as the worker loop does (engine step, `WorkerTraces.on_step`, the request book, whose ends make
the spans), in rounds alternating off and on. On, spans go over OTLP/HTTP to a receiver running
as a process of its own (tests/otlp_receiver.py), from the SDK's batch processor thread as in a
worker; a flush ends each round, so the export's work is counted in it. Printed per mode: the
wall time of a step, the process's CPU time per step (every thread: the exporter's too), the
loop's work outside `Engine.step`; and per finished request what tracing added, in the loop
and in all. The same seeded work in both modes. Wall times on a shared machine are noisy: the
CPU figures are the steadier ones.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.provenance import recorded_command
from engine.config import EngineConfig
from engine.llm_engine import Engine
from generation.sampling_params import SamplingParams
from protocol import Keys, RequestMessage
from protocol.tracing import WORKER_SERVICE, flush, make_tracer
from worker.metrics import WorkerMetrics
from worker.redis_io import EntryRef
from worker.request_book import RequestBook, TrackedRequest
from worker.tracing import WorkerTraces

REPO_ROOT = Path(__file__).resolve().parents[1]
STREAM = Keys("bench").requests("bench")  # what the spans name as the request stream
# A client's trace each request continues, as a gateway's enqueue span would hand it on.
PARENT = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


@dataclass(slots=True)
class Round:
    steps: int = 0
    step_s: float = 0.0  # the whole of each step: engine, tracing hooks, book
    book_s: float = 0.0  # the part outside Engine.step
    finished: int = 0
    cpu_s: float = 0.0  # the process's CPU time (every thread: the exporter's too)

    def add(self, other: Round, cpu_s: float) -> None:
        self.steps += other.steps
        self.step_s += other.step_s
        self.book_s += other.book_s
        self.finished += other.finished
        self.cpu_s += cpu_s


def admit(
    engine: Engine, book: RequestBook, request_id: str, prompt: list[int], params: SamplingParams
) -> None:
    """A request read and started as worker/intake.py does it (without Redis)."""
    msg = RequestMessage(
        request_id, engine.config.model, prompt, params.to_dict(), "r", "g", time.time()
    )
    msg.trace_context = dict(PARENT)
    request = TrackedRequest(EntryRef(STREAM, request_id), "r", time.monotonic())
    request.trace = book.open_trace(msg, STREAM, request.enqueue_time)
    engine.add_request(request_id, prompt, params, request.enqueue_time)
    request.open_choices = params.n
    book.track(request_id, request)


def step(engine: Engine, book: RequestBook, into: Round) -> None:
    """One step as worker/engine_loop.py's `_step` runs it; the outbox is dropped."""
    start = time.monotonic()
    outputs = engine.step()
    now = time.monotonic()
    if book.traces is not None:
        book.traces.on_step(engine.view, engine.stats, outputs, start, now)
    before = len(book.tracked)
    book.on_step(outputs, engine.view.first_scheduled_time, start, now)
    book.clear_outbox()
    end = time.monotonic()
    into.steps += 1
    into.step_s += end - start
    into.book_s += end - now
    into.finished += before - len(book.tracked)


def run_round(engine: Engine, traces: WorkerTraces | None, seats: int, steps: int) -> Round:
    book = RequestBook(WorkerMetrics(engine.config.model, "bench"), traces=traces)
    rng = random.Random(7)  # the same requests in every round
    result, n = Round(), 0
    while result.steps < steps:
        while len(book.tracked) < seats:
            prompt = [rng.randrange(3, 250) for _ in range(rng.randrange(16, 65))]
            params = SamplingParams(max_tokens=rng.randrange(8, 49), ignore_eos=True)
            admit(engine, book, f"req-{n}", prompt, params)
            n += 1
        step(engine, book, result)
    for request_id in list(book.tracked):  # what is left ends here (aborted), not measured
        for out in engine.abort(request_id):
            book.finish(out, time.monotonic())
    return result


def start_receiver(port: int) -> subprocess.Popen[bytes]:
    # The receiver is a test helper (tests/ is not installed): run it from the repository root.
    args = [sys.executable, "-m", "tests.otlp_receiver", "--port", str(port)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, cwd=REPO_ROOT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the OTLP receiver did not start")


def measure(model: str, seats: int, steps: int, rounds: int, port: int) -> dict[str, object]:
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{port}"
    receiver = start_receiver(port)
    try:
        tracer = make_tracer(WORKER_SERVICE, instance_id="bench")
        assert tracer is not None
        # No prefix cache: every round, whichever comes first, computes the same prompts.
        config = EngineConfig(
            model=model, max_num_seqs=seats, kv_cache_memory="1GiB", enable_prefix_caching=False
        )
        engine = Engine(config)
        for traces in (None, WorkerTraces(tracer, model)):  # warm both paths
            run_round(engine, traces, seats, 20)
        flush()
        off, on = Round(), Round()
        for _ in range(rounds):  # interleaved: drift on a shared machine falls on both
            for into, traces in ((off, None), (on, WorkerTraces(tracer, model))):
                cpu = time.process_time()
                r = run_round(engine, traces, seats, steps)
                flush()  # the export's own work (encoding, HTTP) is counted in its round
                into.add(r, time.process_time() - cpu)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as response:
            received = json.load(response)
    finally:
        receiver.kill()
        receiver.wait()

    def per_step_ms(r: Round, seconds: float) -> float:
        return 1000 * seconds / r.steps

    return {
        "model": model,
        "seats": seats,
        "steps_per_mode": off.steps,
        "requests_finished_per_mode": off.finished,
        "step_ms_off": per_step_ms(off, off.step_s),
        "step_ms_on": per_step_ms(on, on.step_s),
        "cpu_ms_per_step_off": per_step_ms(off, off.cpu_s),
        "cpu_ms_per_step_on": per_step_ms(on, on.cpu_s),
        "loop_us_per_step_off": 1000 * per_step_ms(off, off.book_s),
        "loop_us_per_step_on": 1000 * per_step_ms(on, on.book_s),
        # Per request: in the loop (span making), and all of it (the exporter thread's too).
        "loop_us_per_request": 1e6 * (on.book_s - off.book_s) / on.finished,
        "cpu_us_per_request": 1e6 * (on.cpu_s - off.cpu_s) / on.finished,
        "spans_received": received["spans"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--seats", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300, help="steps per round and mode")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=43180, help="the receiver's port")
    args = parser.parse_args()
    result = measure(args.model, args.seats, args.steps, args.rounds, args.port)
    result["load_average"] = os.getloadavg()[0]
    result["command"] = recorded_command(["python", "-m", "research.tracing_cost", *sys.argv[1:]])
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
