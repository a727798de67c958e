"""`jitney bench report`: the key serving series from Prometheus over a time range, as PNG + JSON.

It asks Prometheus' HTTP API (`query_range`) for what shows how the batch behaved: sequences and
tokens per step, queue delay p50/p99, KV cache usage, running vs waiting (with the request
stream's lag, where a continuous worker leaves what it cannot start yet) and output tokens/s.
The rate window follows Grafana's `$__rate_interval` (max(4 × scrape interval, step + scrape
interval)), so the picture matches the dashboard.

Standard library only (matplotlib is imported when drawing): `jitney bench` builds this parser
for every bench subcommand, so importing this module must stay cheap.

The report also records the machine's load average at its start and end: on a busy machine the
scrapes and the workers it watched ran late, and the numbers should say so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.provenance import load_average, recorded_command

DEFAULT_PROMETHEUS = "http://localhost:9090"
DEFAULT_SCRAPE_S = 15.0  # Prometheus' default, when no target reports its interval
MAX_POINTS = 600  # per line: plenty for a chart, far below Prometheus' 11,000 limit


@dataclass(frozen=True, slots=True)
class Line:
    legend: str  # str.format over the series' labels, e.g. "mean {worker}"
    expr: str  # PromQL; {sel} is the model/worker matcher, {w} the rate window


@dataclass(frozen=True, slots=True)
class KeySeries:
    key: str
    title: str
    unit: str
    lines: tuple[Line, ...]


def _mean_per_step(metric: str) -> str:
    # Mean over the steps in the window (sum/count of the histogram), not a sampled gauge: a
    # scrape sees one step in hundreds.
    return (
        f"sum by (worker) (rate({metric}_sum{{sel}}[{{w}}])) "
        f"/ sum by (worker) (rate({metric}_count{{sel}}[{{w}}]))"
    )


def _quantile(q: float, metric: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{sel}}[{{w}}])))"


KEY_SERIES: tuple[KeySeries, ...] = (
    KeySeries(
        "batch_size",
        "batch size (sequences per step)",
        "sequences",
        (Line("mean {worker}", _mean_per_step("jitney_batch_size")),),
    ),
    KeySeries(
        "batch_tokens",
        "batch tokens (tokens per step)",
        "tokens",
        (Line("mean {worker}", _mean_per_step("jitney_batch_tokens")),),
    ),
    KeySeries(
        "queue_delay",
        "queue delay (enqueue → first scheduled)",
        "seconds",
        (
            Line("p50", _quantile(0.5, "jitney_queue_delay_seconds")),
            Line("p99", _quantile(0.99, "jitney_queue_delay_seconds")),
        ),
    ),
    KeySeries(
        "kv_cache_usage",
        "KV cache usage",
        "ratio",
        (Line("{worker}", "max by (worker) (jitney_kv_cache_usage_ratio{sel})"),),
    ),
    KeySeries(
        "running_waiting",
        "running vs waiting",
        "requests",
        (
            Line("running", "sum(jitney_requests_running{sel})"),
            Line("waiting (read by a worker)", "sum(jitney_requests_waiting{sel})"),
            # Every gateway reports the same stream-wide value: max, not sum.
            Line("queue lag (in the streams)", "sum(max by (model) (jitney_queue_lag))"),
        ),
    ),
    KeySeries(
        "output_tokens",
        "output tokens/s",
        "tokens/s",
        (Line("{worker}", "sum by (worker) (rate(jitney_generation_tokens_total{sel}[{w}]))"),),
    ),
)


# ----- time arguments ----------------------------------------------------------------------
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """'90s', '10m', '1.5h' -> seconds."""
    m = _DURATION.match(text.strip())
    if not m:
        raise ValueError(f"not a duration: {text!r} (e.g. 90s, 10m, 1h)")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def parse_time(text: str) -> float:
    """Unix seconds, or ISO 8601 (local time when no offset is given) -> unix seconds."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ValueError(f"not a time: {text!r} (unix seconds or ISO 8601)") from None


def prom_duration(seconds: float) -> str:
    """Seconds -> a PromQL duration (whole milliseconds: PromQL has no fractions)."""
    return f"{max(1, round(seconds * 1000))}ms"


# ----- Prometheus ---------------------------------------------------------------------------
class PrometheusError(RuntimeError):
    pass


class Prometheus:
    """A minimal client of Prometheus' HTTP API (GET only)."""

    def __init__(self, url: str, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.timeout = timeout

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.url}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as e:  # 400/422 carry Prometheus' own error message
            try:
                body = json.load(e)
            except ValueError:
                raise PrometheusError(f"{url}: HTTP {e.code}") from None
        except (OSError, ValueError) as e:
            raise PrometheusError(f"{self.url}: {e}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr} | ({} if at is None else {"time": f"{at:.3f}"})
        return self.get("/api/v1/query", **params)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return self.get(
            "/api/v1/query_range",
            query=expr,
            start=f"{start:.3f}",
            end=f"{end:.3f}",
            step=f"{step:g}",
        )["result"]

    def scrape_interval(self) -> float:
        """The longest scrape interval among active targets (Prometheus' default if none says)."""
        targets = self.get("/api/v1/targets", state="active")["activeTargets"]
        found = []
        for t in targets:
            try:
                found.append(parse_duration(t.get("scrapeInterval", "")))
            except ValueError:
                continue
        return max(found, default=DEFAULT_SCRAPE_S)


# ----- the report ---------------------------------------------------------------------------
def _selector(model: str, worker: str) -> str:
    def quote(s: str) -> str:
        return json.dumps(s)  # a PromQL string literal accepts JSON's escapes

    return f"{{model=~{quote(model)},worker=~{quote(worker)}}}"


def _legend(template: str, labels: dict[str, str]) -> str:
    class Missing(dict[str, str]):
        def __missing__(self, key: str) -> str:
            return "-"

    return template.format_map(Missing(labels)).strip()


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def collect(
    prom: Prometheus,
    start: float,
    end: float,
    step: float | None = None,
    rate_window: float | None = None,
    model: str = ".*",
    worker: str = ".*",
) -> dict[str, Any]:
    """Query every key series over [start, end]; returns the JSON-ready report."""
    if end <= start:
        raise ValueError(f"the range is empty: start {start} >= end {end}")
    scrape = prom.scrape_interval()
    step = step or max(scrape, math.ceil((end - start) / MAX_POINTS))
    window = rate_window or max(4 * scrape, step + scrape)
    sel, w = _selector(model, worker), prom_duration(window)
    series: dict[str, Any] = {}
    for ks in KEY_SERIES:
        lines = []
        for line in ks.lines:
            expr = line.expr.replace("{sel}", sel).replace("{w}", w)
            for result in prom.query_range(expr, start, end, step):
                points = [
                    [round(float(t) - start, 3), None if not math.isfinite(v) else v]
                    for t, raw in result["values"]
                    for v in (float(raw),)
                ]
                name = _legend(line.legend, result["metric"])
                lines.append({"name": name, "expr": expr, "points": points})
        series[ks.key] = {"title": ks.title, "unit": ks.unit, "lines": lines}
    return {
        "prometheus": prom.url,
        "start": start,
        "end": end,
        "start_utc": datetime.fromtimestamp(start, UTC).isoformat(timespec="seconds"),
        "duration_s": round(end - start, 3),
        "step_s": step,
        "scrape_interval_s": scrape,
        "rate_window": w,
        "model": model,
        "worker": worker,
        "series": series,
        "summary": summarize(series),
    }


def summarize(series: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Per key series and line: mean, max and number of points with a value."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for key, s in series.items():
        out[key] = {}
        for line in s["lines"]:
            vs = [v for _, v in line["points"] if _finite(v)]
            if vs:
                out[key][line["name"]] = {
                    "mean": round(sum(vs) / len(vs), 4),
                    "max": round(max(vs), 4),
                    "points": len(vs),
                }
    return out


def empty_series(report: dict[str, Any]) -> list[str]:
    """Key series without a single value in the range."""
    return [key for key, lines in report["summary"].items() if not lines]


def format_summary(report: dict[str, Any]) -> str:
    rows = [
        f"{report['start_utc']} + {report['duration_s']:g} s, step {report['step_s']:g} s, "
        f"rate window {report['rate_window']}, from {report['prometheus']}",
    ]
    if load := report.get("load_average"):
        rows.append(
            f"load average (1/5/15 min) at start {_triple(load['start'])}, "
            f"at end {_triple(load['end'])}, on {load['cpus']} CPUs"
        )
    rows += [
        f"{'series':<24} {'line':<28} {'mean':>10} {'max':>10}",
    ]
    for key, lines in report["summary"].items():
        if not lines:
            rows.append(f"{key:<24} {'(no data)':<28}")
        for name, s in lines.items():
            rows.append(f"{key:<24} {name[:28]:<28} {s['mean']:>10.3g} {s['max']:>10.3g}")
    return "\n".join(rows)


def _triple(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def plot(
    report: dict[str, Any],
    path: str | Path,
    title: str | None = None,
    max_num_seqs: int | None = None,
) -> None:
    """One panel per key series, seconds since the range's start on every x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5), sharex=True)
    for ax, ks in zip(axes.flat, KEY_SERIES, strict=True):
        s = report["series"][ks.key]
        for line in s["lines"]:
            xs = [t for t, _ in line["points"]]
            ys = [math.nan if v is None else v for _, v in line["points"]]
            if ks.key == "kv_cache_usage":
                ys = [100 * y for y in ys]
            ax.plot(xs, ys, label=line["name"], linewidth=1.4)
        if ks.key == "batch_size" and max_num_seqs:
            # Not exported: the operator knows it. Shows whether the batch stays full.
            ax.axhline(max_num_seqs, color="grey", linestyle="--", label="max_num_seqs")
        unit = "%" if ks.key == "kv_cache_usage" else ks.unit
        ax.set(title=ks.title, ylabel=unit)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper right")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for ax in axes[-1]:
        ax.set_xlabel("seconds since start")
    fig.suptitle(
        title
        or f"Jitney key series, {report['start_utc']} + {report['duration_s']:g} s "
        f"({_scope(report)}, rate window {report['rate_window']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _scope(report: dict[str, Any]) -> str:
    model = "all models" if report["model"] == ".*" else f"model {report['model']}"
    return model + ("" if report["worker"] == ".*" else f", worker {report['worker']}")


def write_json(report: dict[str, Any], path: str | Path) -> None:
    # allow_nan=False: a NaN that slipped through fails here instead of writing invalid JSON.
    Path(path).write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")


# ----- the command --------------------------------------------------------------------------
def add_report_arguments(sub: argparse._SubParsersAction) -> None:
    rep = sub.add_parser(
        "report",
        help="the key series (batch, queue delay, KV, running/waiting) from Prometheus as PNG+JSON",
        description="Query a Prometheus that scrapes Jitney over a time range for batch size, "
        "batch tokens, queue delay p50/p99, KV cache usage, running vs waiting and the limits "
        "that bounded the steps; write them as a chart and JSON.",
    )
    rep.add_argument("--prometheus", default=DEFAULT_PROMETHEUS, help="Prometheus base URL")
    when = rep.add_mutually_exclusive_group()
    when.add_argument("--last", default=None, help="the last DURATION (e.g. 10m; default 15m)")
    when.add_argument("--start", default=None, help="range start: unix seconds or ISO 8601")
    rep.add_argument("--end", default=None, help="range end (with --start; default now)")
    rep.add_argument("--step", type=float, default=None, help="seconds between points")
    rep.add_argument(
        "--rate-window", default=None, help="rate() window, e.g. 30s (default like Grafana's)"
    )
    rep.add_argument("--model", default=".*", help="model label regex")
    rep.add_argument("--worker", default=".*", help="worker label regex")
    rep.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="the workers' slots, drawn as a reference line on the batch-size chart",
    )
    rep.add_argument("--title", default=None, help="chart title")
    rep.add_argument("--output", default="bench-report.json", help="report JSON")
    rep.add_argument("--plot", default="bench-report.png", help="chart PNG ('' for none)")


def run_report(args: argparse.Namespace) -> int:
    load_at_start = load_average()
    try:
        end = parse_time(args.end) if args.end else time.time()
        last = parse_duration(args.last or "15m")
        start = parse_time(args.start) if args.start else end - last
        window = parse_duration(args.rate_window) if args.rate_window else None
        report = collect(
            Prometheus(args.prometheus), start, end, args.step, window, args.model, args.worker
        )
    except (ValueError, PrometheusError) as e:
        raise SystemExit(f"bench report: {e}") from None
    report["load_average"] = {
        "start": load_at_start,
        "end": load_average(),
        "cpus": os.cpu_count(),
    }
    report["command"] = recorded_command()
    print(format_summary(report))
    write_json(report, args.output)
    print(f"wrote {args.output}", file=sys.stderr)
    if args.plot:
        plot(report, args.plot, args.title, args.max_num_seqs)
        print(f"wrote {args.plot}", file=sys.stderr)
    if missing := empty_series(report):
        print(f"no data in the range for: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0
