"""Every dashboard query, the alert rules and `jitney bench report` against a real Prometheus
(Debian's) scraping a live `jitney up` every second (its gateway and two tiny-random workers, on a
redis-server the test starts), under a short burst of streaming requests."""

from __future__ import annotations

import asyncio
import json
import math
import random
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.prom_report import KEY_SERIES, Prometheus, PrometheusError
from bench.serve import run_serve
from bench.trace import TraceRequest
from jitney.cli import main
from protocol import Keys
from tests.observability.helpers import (
    PrometheusServer,
    label_values,
    load_dashboard,
    metric_names,
    panel_exprs,
    promtool,
    rule_groups,
    substitute,
    variable_queries,
    write_rules_file,
)
from tests.services import TRANSIENT, JitneyProcess, RedisServer, free_port, wait_for

pytestmark = pytest.mark.slow

WORKERS = 2
MAX_NUM_SEQS = 4  # small, so the load fills every batch and queues up in the stream
CLIENTS = 3 * MAX_NUM_SEQS
RATE_WINDOW = "4s"  # Grafana's $__rate_interval at a 1 s scrape interval: 4 × 1 s
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROMETHEUS_DOWN = (*TRANSIENT, PrometheusError)  # the client wraps connection errors in it


@dataclass
class Live:
    prometheus: PrometheusServer
    api: Prometheus
    start: float  # unix seconds: just before the first request
    end: float  # after the last request ended and Prometheus scraped the final counters
    served: dict[str, Any]  # `bench serve`'s report of the burst
    workers: list[str]  # the worker ids `jitney up` started (hostname-pid)
    rules_error: str | None  # why the alert rules were not loaded into Prometheus


def burst(n: int = 60, seed: int = 7) -> list[TraceRequest]:
    """Prompts inside the tiny model's vocabulary, outputs long enough to keep batches busy."""
    rng = random.Random(seed)
    return [
        TraceRequest(
            request_id=str(i),
            prompt_ids=[rng.randrange(3, 281) for _ in range(rng.randrange(8, 48))],
            output_len=rng.randrange(80, 200),
        )
        for i in range(n)
    ]


def load_rules(tmp: Path) -> tuple[list[Path], str | None]:
    """The PrometheusRule's groups as a rule file for Prometheus, when it passes promtool."""
    try:
        path = write_rules_file(tmp / "rules.yml")
    except Exception as e:  # missing or malformed: the rules test reports it
        return [], f"{type(e).__name__}: {e}"
    check = promtool("check", "rules", str(path))
    return ([path], None) if check.returncode == 0 else ([], check.stdout + check.stderr)


def scalar(api: Prometheus, expr: str) -> float:
    result = api.query(expr)
    return float(result[0]["value"][1]) if result else math.nan


def free_port_pair() -> int:
    """A port whose successor is free too: `jitney up` gives worker i metrics port + i. Taken
    below the kernel's ephemeral range, so neither `free_port()` (bind to port 0) nor an outgoing
    connection (Prometheus scraping before the workers listen) can take the second port between
    this check and the worker's bind (CI once lost worker 1's port that way)."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ranges.read_text().split()[0]) if ranges.exists() else 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10_000, low - 1)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no two adjacent free ports below the ephemeral range")


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    server = RedisServer().start()
    port, metrics_port = free_port(), free_port_pair()
    worker_ports = [metrics_port + i for i in range(WORKERS)]
    up = JitneyProcess(
        [
            "up",
            "--workers",
            str(WORKERS),
            "--model",
            "tiny-random",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--kv-cache-memory",
            "16MiB",
        ],
        {"REDIS_URL": server.url, "OMP_NUM_THREADS": "1"},
        name="obs-up",
    )
    base = f"http://127.0.0.1:{port}"
    # The rules are loaded when they pass promtool; if not, only the rules test fails (below).
    rules, rules_error = load_rules(tmp_path_factory.mktemp("rules"))
    prometheus = PrometheusServer(
        {
            "jitney-gateway": [f"127.0.0.1:{port}"],
            "jitney-worker": [f"127.0.0.1:{p}" for p in worker_ports],
        },
        rule_files=rules,
    )
    try:
        prometheus.start()

        def ready() -> bool:
            assert up.alive(), up.output()
            urls = [f"{base}/ready", *(f"http://127.0.0.1:{p}/ready" for p in worker_ports)]
            return all(answers(u) for u in urls)

        wait_for(ready, 120, "jitney up: the gateway and both workers ready")
        workers = sorted(w.decode() for w in server.client().zrange(Keys().workers, 0, -1))
        assert len(workers) == WORKERS, workers
        api = prometheus.api()
        wait_for(
            lambda: scalar(api, "sum(up)") == 1 + WORKERS,
            30,
            "prometheus scraping all",
            transient=PROMETHEUS_DOWN,
        )
        start = time.time()
        # Closed loop with more clients than the two workers have slots: every batch stays
        # full and the rest waits in the stream, whatever the speed of this machine.
        served = asyncio.run(run_serve(base, burst(), concurrency=CLIENTS, label="observe"))
        assert served["failed"] == 0, served["failures"]
        # The final counters must be in Prometheus before anything is queried: the tokens the
        # workers report equal what the clients received.
        wait_for(
            lambda: scalar(api, "sum(jitney_generation_tokens_total)") == served["output_tokens"],
            30,
            "prometheus to scrape the final token counts",
            transient=PROMETHEUS_DOWN,
        )
        yield Live(prometheus, api, start - 2, time.time() + 1, served, workers, rules_error)
    finally:
        prometheus.close()
        up.stop(signal.SIGTERM, timeout=90)
        server.close()


def has_data(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(v)) for series in result for _, v in series["values"])


def test_every_panel_query_returns_data(live):
    """Each target, with the variables on "All" and on one model and worker, returns at least
    one finite value over the burst (a NaN-only quantile or an empty result fails)."""
    selections = {
        "all": {"model": ".*", "worker": ".*"},
        "one": {"model": "tiny-random", "worker": live.workers[1]},
    }
    empty = []
    exprs = panel_exprs(load_dashboard())
    for (where, expr), (name, values) in zip(
        exprs * 2, [s for s in selections.items() for _ in exprs], strict=True
    ):
        query = substitute(expr, values | {"__rate_interval": RATE_WINDOW})
        if not has_data(live.api.query_range(query, live.start, live.end, 1)):
            empty.append(f"{where} [{name}]: {query}")
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_variables_list_the_live_models_and_workers(live):
    seen = {}
    for name, query in variable_queries(load_dashboard()).items():
        selector, label = label_values(query)
        series = live.api.get(
            "/api/v1/series",
            **{"match[]": substitute(selector, {"model": ".*"})},
            start=str(live.start),
            end=str(live.end),
        )
        seen[name] = {s[label] for s in series}
    assert seen == {"model": {"tiny-random"}, "worker": set(live.workers)}


def test_live_metric_names_match_the_registries(live):
    """What Prometheus scraped is what the dashboard queries (no series renamed on the way)."""
    live_names = set(live.api.get("/api/v1/label/__name__/values"))
    wanted = set().union(*(metric_names(e) for _, e in panel_exprs(load_dashboard())))
    assert wanted <= live_names, f"not scraped: {sorted(wanted - live_names)}"


def test_alert_rules_load_and_evaluate_on_live_metrics(live):
    groups = rule_groups()  # fails clearly when the PrometheusRule is missing
    assert live.rules_error is None, f"the rules were not loaded: {live.rules_error}"
    live_names = set(live.api.get("/api/v1/label/__name__/values"))
    alerts = [r for g in groups for r in g["rules"] if "alert" in r]
    recorded = {r["record"] for g in groups for r in g["rules"] if "record" in r}
    for rule in alerts:
        missing = metric_names(str(rule["expr"])) - live_names - recorded
        assert not missing, f"alert {rule['alert']}: no such series on Prometheus: {missing}"
        live.api.query(str(rule["expr"]))  # raises PrometheusError when it does not evaluate

    def loaded_rules() -> list[dict[str, Any]]:
        return [r for g in live.api.get("/api/v1/rules")["groups"] for r in g["rules"]]

    def evaluated() -> bool:  # a lastEvaluation of "0001-01-01..." means not yet
        loaded = loaded_rules()
        return bool(loaded) and all(r["lastEvaluation"] > "2000" for r in loaded)

    wait_for(evaluated, 30, "every rule evaluated once", transient=PROMETHEUS_DOWN)
    loaded = loaded_rules()
    assert sorted(r["name"] for r in loaded if r["type"] == "alerting") == sorted(
        r["alert"] for r in alerts
    )
    broken = {r["name"]: r.get("lastError") for r in loaded if r["health"] != "ok"}
    assert not broken, f"rules failing on the live Prometheus: {broken}"


def test_bench_report_draws_the_key_series(live, tmp_path: Path, capsys):
    out, png = tmp_path / "report.json", tmp_path / "report.png"
    argv = [
        "bench",
        "report",
        "--prometheus",
        live.prometheus.url,
        "--start",
        str(live.start),
        "--end",
        str(live.end),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--output",
        str(out),
        "--plot",
        str(png),
    ]
    assert main(argv) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 20_000
    report = json.loads(out.read_text())
    assert report["scrape_interval_s"] == 1 and report["rate_window"] == "4000ms"
    summary = report["summary"]
    assert set(summary) == {k.key for k in KEY_SERIES}
    for key, lines in summary.items():
        assert lines, f"{key}: no data"
        for name, s in lines.items():
            assert s["points"] > 0 and math.isfinite(s["mean"]), (key, name)
    # The load overfills two workers of MAX_NUM_SEQS slots: full batches, never more.
    for w in live.workers:
        assert MAX_NUM_SEQS - 1 < summary["batch_size"][f"mean {w}"]["max"] <= MAX_NUM_SEQS
        assert 0 < summary["kv_cache_usage"][w]["max"] <= 1
    # `running` is a gauge sampled once a second: a scrape may land between one request
    # finishing and the next being admitted, so the peak proves both workers ran at once
    # (more than one worker's slots) and never more than all slots, not an exact count.
    running_peak = summary["running_waiting"]["running"]["max"]
    assert MAX_NUM_SEQS < running_peak <= WORKERS * MAX_NUM_SEQS
    assert summary["running_waiting"]["queue lag (in the streams)"]["max"] > 0
    assert all(s["max"] > 0 for s in summary["output_tokens"].values())
    delays = summary["queue_delay"]
    assert 0 <= delays["p50"]["max"] <= delays["p99"]["max"]
    assert "batch_size" in capsys.readouterr().out
