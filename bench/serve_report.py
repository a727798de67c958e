"""Tables and charts for `jitney bench serve` reports (one run, or several side by side)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STATS = ("mean", "p50", "p90", "p99")
METRICS = (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"), ("e2e", "e2e_ms"))


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _mode(r: dict[str, Any]) -> str:
    if r.get("concurrency"):
        return f"closed loop, concurrency {r['concurrency']}"
    if r.get("arrivals") == "trace":
        return "open loop, the trace's arrival times"
    return f"open loop, Poisson {r.get('rate')} req/s (seed {r.get('seed')})"


def format_table(r: dict[str, Any]) -> str:
    lines = [
        f"label {r['label']}: {_mode(r)}, model {r['model']} at {r['url']}",
        f"requests            {r['completed']} ok, {r['failed']} failed of {r['num_requests']}",
        f"wall time           {r['wall_s']:.2f} s",
        f"request throughput  {r['request_throughput']:.2f} req/s",
        f"output throughput   {r['output_throughput']:.1f} tok/s "
        f"({r['useful_output_tokens']} useful output tokens)",
        "",
        f"{'ms':<6}" + "".join(f"{s:>10}" for s in STATS),
    ]
    for name, key in METRICS:
        row = r[key]
        lines.append(f"{name:<6}" + "".join(f"{_ms(row[s]):>10}" for s in STATS))
    if r["failed"]:
        lines += ["", "failed:"] + [f"  {n:>4}  {why}" for why, n in r["failures"].items()]
    if backlog := r.get("batch_backlog"):
        lines += [
            "",
            f"batch backlog       {backlog['lines']} lines ({backlog['batch_id']}): "
            f"{backlog['answered_during_run']} answered during the run, "
            f"{backlog['answered_before_run']} before; {backlog['status_at_end']} at the end",
        ]
    return "\n".join(lines)


def load_reports(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    return [json.loads(Path(p).read_text()) for p in paths]


def format_compare(reports: Sequence[dict[str, Any]]) -> str:
    width = max([5, *(len(str(r["label"])) for r in reports)])
    cols = ("req/s", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "TPOT p50", "e2e p50", "e2e p99")
    header = f"{'label':<{width}} " + "".join(f"{c:>10}" for c in cols) + f"{'failed':>8}"
    lines = [header, "-" * len(header), *(_compare_row(r, width) for r in reports)]
    return "\n".join(lines) + "\n(latencies in ms)"


def _compare_row(r: dict[str, Any], width: int) -> str:
    values = [
        f"{r['request_throughput']:.2f}",
        f"{r['output_throughput']:.1f}",
        _ms(r["ttft_ms"]["p50"]),
        _ms(r["ttft_ms"]["p99"]),
        _ms(r["itl_ms"]["p50"]),
        _ms(r["tpot_ms"]["p50"]),
        _ms(r["e2e_ms"]["p50"]),
        _ms(r["e2e_ms"]["p99"]),
    ]
    return f"{r['label']!s:<{width}} " + "".join(f"{v:>10}" for v in values) + f"{r['failed']:>8}"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(r: dict[str, Any], path: str | Path) -> None:
    """Latency CDFs, the ITL histogram, and requests in flight / completed over time."""
    plt = _pyplot()
    ok = [q for q in r["requests"] if q["ok"]]
    fig, (cdf, hist, timeline) = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, key in (("TTFT", "ttft_s"), ("e2e", "e2e_s")):
        xs = sorted(q[key] for q in ok if q[key] is not None)
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            cdf.step(xs, ys, where="post", label=name)
    cdf.set(xlabel="seconds", ylabel="fraction of requests", title="latency CDF")
    cdf.legend()
    gaps = [1000 * g for q in ok for g in q["itl_s"]]
    if gaps:
        hist.hist(gaps, bins=40, color="tab:green")
    hist.set(xlabel="ms", ylabel="gaps", title="inter-token latency")
    sent = [q for q in r["requests"] if q["start_s"] is not None]
    events = sorted(
        [(q["start_s"], 1, 0) for q in sent]
        + [(q["end_s"] if q["end_s"] is not None else r["wall_s"], -1, q["ok"]) for q in sent]
    )
    in_flight, done, xs, flying, completed = 0, 0, [0.0], [0], [0]
    for t, step, ok_end in events:
        in_flight += step
        done += ok_end
        xs.append(t)
        flying.append(in_flight)
        completed.append(done)
    xs.append(max(r["wall_s"], xs[-1]))
    flying.append(in_flight)
    completed.append(done)
    timeline.step(xs, flying, where="post", label="in flight")
    timeline.step(xs, completed, where="post", label="completed")
    timeline.set(xlabel="seconds since start", ylabel="requests", title="requests over time")
    timeline.legend()
    fig.suptitle(
        f"{r['label']}: {r['request_throughput']:.2f} req/s, {r['output_throughput']:.1f} tok/s, "
        f"{r['failed']} failed"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_compare(reports: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Per label: output throughput, and p50/p99 bars of TTFT and e2e."""
    plt = _pyplot()
    labels = [str(r["label"]) for r in reports]
    xs = list(range(len(reports)))
    fig, (tput, ttft, e2e) = plt.subplots(1, 3, figsize=(5 * 3, 4.2))
    tput.bar(xs, [r["output_throughput"] for r in reports], color="tab:blue")
    tput.set(ylabel="useful output tokens/s", title="output throughput")
    for ax, key, title in ((ttft, "ttft_ms", "TTFT"), (e2e, "e2e_ms", "end-to-end latency")):
        for shift, stat in ((-0.2, "p50"), (0.2, "p99")):
            vals = [r[key][stat] or 0.0 for r in reports]
            ax.bar([x + shift for x in xs], vals, width=0.4, label=stat)
        ax.set(ylabel="ms", title=title)
        ax.legend()
    for ax in (tput, ttft, e2e):
        ax.set_xticks(xs, labels, rotation=20 if len(labels) > 3 else 0)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
