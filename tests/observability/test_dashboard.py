"""The Grafana dashboard, its provisioning and the alert rules, checked without a live stack:
structure, variables, every queried metric exported, every expression parsed by promtool."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import yaml

from bench.prom_report import KEY_SERIES, parse_duration, parse_time, prom_duration
from jitney.cli import main
from tests.observability.helpers import (
    DASHBOARD,
    PROVISIONING,
    ROOT,
    all_panels,
    exported_metric_names,
    label_values,
    load_dashboard,
    metric_names,
    panel_exprs,
    promtool,
    query_panels,
    rule_groups,
    substitute,
    variable_queries,
    write_rules_file,
)
from tests.services import free_port

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRAFANA_BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}
# Series Prometheus itself adds for every target; alerts may use them (e.g. `up == 0`).
SCRAPE_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return load_dashboard()


def test_dashboard_is_grafana_dashboard_json(dashboard):
    assert dashboard["title"] == "Jitney overview" and dashboard["uid"] == "jitney-overview"
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard["id"] is None  # provisioned: Grafana assigns the id
    assert {"from", "to"} <= dashboard["time"].keys()
    panels = list(all_panels(dashboard))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("h", "w", "x", "y")), p["title"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for cell in itertools.product(
            range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])
        ):
            assert cell not in cells, f"{p['title']!r} overlaps {cells[cell]!r}"
            cells[cell] = p["title"]
    for p in query_panels(dashboard):
        assert p["type"] in {"timeseries", "stat", "gauge", "bargauge", "table"}, p["type"]
        assert p["datasource"] == DATASOURCE, f"{p['title']}: use the $datasource variable"
        assert p["targets"], f"{p['title']} has no query"
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"] == DATASOURCE, p["title"]


def test_templating_defines_every_variable_the_queries_use(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("model", "worker"):
        v = variables[name]
        assert v["type"] == "query" and v["datasource"] == DATASOURCE
        assert v["multi"] and v["includeAll"] and v["allValue"] == ".*"  # `=~` matchers
    assert "$model" in variable_queries(dashboard)["worker"]  # workers of the chosen models
    values = {name: "x" for name in variables} | GRAFANA_BUILTINS
    texts = [e for _, e in panel_exprs(dashboard)] + list(variable_queries(dashboard).values())
    for text in texts:
        substitute(text, values)  # raises on a variable that is not defined
    used = {m for text in texts for m in re.findall(r"\$\{?(\w+)", text)}
    assert {"model", "worker", "__rate_interval"} <= used


def test_dashboard_covers_what_the_issue_asks_for(dashboard):
    exprs = [e for _, e in panel_exprs(dashboard)]

    def queried(metric: str, *fragments: str) -> bool:
        return any(metric in e and all(f in e for f in fragments) for e in exprs)

    assert queried("jitney_http_requests_total", "by (status)")
    assert queried("jitney_generation_tokens_total", "rate(")
    for metric in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        for q in ("0.5", "0.9", "0.99"):
            assert queried(f"jitney_{metric}_seconds_bucket", f"histogram_quantile({q},"), metric
    for q in ("0.5", "0.99"):
        assert queried("jitney_queue_delay_seconds_bucket", f"histogram_quantile({q},")
    for metric in (
        "jitney_queue_lag",
        "jitney_queue_pending",
        "jitney_batch_size_sum",
        "jitney_batch_tokens_sum",
        "jitney_kv_cache_usage_ratio",
        "jitney_kv_blocks_free",
        "jitney_requests_running",
        "jitney_requests_waiting",
        "jitney_preemptions_total",
    ):
        assert queried(metric), metric
    # Work classes: what waits per priority, and each API key's share of the tokens.
    assert queried("jitney_gateway_waiting_requests", "by (priority)")
    assert queried("jitney_key_tokens_total", "by (key_id", "rate(")
    assert queried("jitney_queue_lag", "by (model)")
    # Prefix-aware placement: each worker's hit rate, where requests waited, and how long.
    assert queried("jitney_prefix_cache_hits_total", "by (worker)", "jitney_prefix_cache_queries")
    assert queried("jitney_placement_reads_total", "by (outcome)", "rate(")
    for q in ("0.5", "0.99"):
        assert queried("jitney_placement_wait_seconds_bucket", f"histogram_quantile({q},")
    # Speculative decoding: how much is kept, how much the history brings, the row's price.
    spec = "jitney_spec_decode_"
    assert queried(f"{spec}num_accepted_tokens_total", f"{spec}num_draft_tokens_total", " / ")
    assert queried(f"{spec}history_draft_tokens_total", "rate(")
    assert queried(f"{spec}history_accepted_tokens_total", "rate(")
    assert queried(f"{spec}draft_row_cost", "by (worker)")
    per_worker = [e for e in exprs if "by (worker)" in e]
    assert {"jitney_generation_tokens_total", "jitney_requests_running"} <= set().union(
        *map(metric_names, per_worker)
    )


def test_every_queried_metric_is_exported(dashboard):
    exported = exported_metric_names()
    assert "jitney_batch_size_bucket" in exported and "jitney_queue_lag" in exported
    selectors = [(n, label_values(q)[0]) for n, q in variable_queries(dashboard).items()]
    texts = panel_exprs(dashboard) + selectors
    missing = {f"{where}: {name}" for where, e in texts for name in metric_names(e) - exported}
    assert not missing, f"not exported by gateway/ or worker/: {sorted(missing)}"


def test_metric_names_reads_promql():
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{x=~"$m",y="b(c)"}[$__rate_interval]'
        " offset 5m))) / on(worker) group_left max(b_total[1m:10s]) * 1e3 > bool 0 unless c"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}
    assert metric_names("sum(rate(d[5m])) by (le, worker)") == {"d"}


def test_every_dashboard_expression_parses(dashboard, tmp_path):
    """promtool parses each expression (variables substituted) as a recording rule."""
    values = {"model": ".*", "worker": ".*", "datasource": "x"} | GRAFANA_BUILTINS
    rules = [
        {"record": f"jitney_dashboard_check:expr_{i}", "expr": substitute(e, values)}
        for i, (_, e) in enumerate(panel_exprs(dashboard))
    ]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(rules)} rules found" in result.stdout


def test_provisioning_points_at_prometheus_and_the_dashboards_folder():
    ds = yaml.safe_load((PROVISIONING / "datasources/prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert source["access"] == "proxy"
    assert parse_duration(source["jsonData"]["timeInterval"]) > 0
    boards = yaml.safe_load((PROVISIONING / "dashboards/jitney.yml").read_text())
    (provider,) = boards["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    assert DASHBOARD.parent == ROOT / "grafana/dashboards"  # the folder mounted at that path


def test_alert_rules_pass_promtool_and_use_exported_metrics(tmp_path):
    path = write_rules_file(tmp_path / "rules.yml")
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = [r for g in rule_groups() for r in g["rules"] if "alert" in r]
    assert alerts, "the PrometheusRule defines no alert"
    known = exported_metric_names() | SCRAPE_SERIES
    recorded = {r["record"] for g in rule_groups() for r in g["rules"] if "record" in r}
    for rule in alerts:
        unknown = metric_names(str(rule["expr"])) - known - recorded
        assert not unknown, f"alert {rule['alert']} uses metrics nobody exports: {unknown}"


def test_report_time_arguments():
    assert parse_duration("90s") == 90 and parse_duration("1.5h") == 5400
    assert parse_time("1700000000") == 1700000000
    assert parse_time("2023-11-14T22:13:20+00:00") == 1700000000
    assert prom_duration(4) == "4000ms" and prom_duration(0.0001) == "1ms"
    for bad in ("10", "m", "-5s"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    assert [k.key for k in KEY_SERIES] == [
        "batch_size",
        "batch_tokens",
        "queue_delay",
        "kv_cache_usage",
        "running_waiting",
        "output_tokens",
    ]


def test_report_without_prometheus_fails_clearly(tmp_path: Path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(SystemExit, match=r"bench report: .*127\.0\.0\.1"):
        main(
            [
                "bench",
                "report",
                "--prometheus",
                url,
                "--last",
                "5m",
                "--output",
                str(tmp_path / "r.json"),
                "--plot",
                "",
            ]
        )
    assert not (tmp_path / "r.json").exists()
