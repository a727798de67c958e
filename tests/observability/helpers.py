"""Helpers for the observability tests: the dashboard, PromQL metric names, the metrics the
project exports, the alert rules, and a real Prometheus (Debian's) on a free loopback port."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from bench.prom_report import Prometheus
from gateway.serving.gateway_metrics import GatewayMetrics
from tests.services import free_port, wait_for
from worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "grafana/dashboards/jitney-overview.json"
PROVISIONING = ROOT / "grafana/provisioning"
RULES = ROOT / "deploy/k8s/base/monitoring/prometheus-rules.yaml"


# ----- the dashboard ------------------------------------------------------------------------
def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def query_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in all_panels(dashboard) if p["type"] != "row"]


def panel_exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title / refId, expr) of every query target."""
    return [
        (f"{p['title']} / {t['refId']}", t["expr"])
        for p in query_panels(dashboard)
        for t in p["targets"]
    ]


def variable_queries(dashboard: dict[str, Any]) -> dict[str, str]:
    return {
        v["name"]: v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        for v in dashboard["templating"]["list"]
        if v["type"] == "query"
    }


def label_values(query: str) -> tuple[str, str]:
    """Grafana's `label_values(selector, label)` -> (selector, label)."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", query)
    assert m, f"variable query is not label_values(selector, label): {query!r}"
    return m.group(1), m.group(2)


_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace Grafana variables ($x, ${x}, ${x:fmt}) by `values`; an unknown one is an error,
    so a variable added to the dashboard must be handled here on purpose."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"no test value for the dashboard variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(one, expr)


# ----- PromQL metric names ------------------------------------------------------------------
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w.:])[a-zA-Z_:][a-zA-Z0-9_:]*")
_KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
}


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers outside strings, label matchers,
    ranges and grouping clauses that are neither keywords nor function calls."""
    text = _STRING.sub('""', expr)
    text = _VARIABLE.sub("x", text)
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\[\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        name = m.group(0)
        if name.lower() in _KEYWORDS or re.match(r"\s*\(", text[m.end() :]):
            continue
        names.add(name)
    return names


def exported_metric_names() -> set[str]:
    """Every series name the gateway and worker exporters can produce, from their registries
    (labelled children that have not been used yet have no samples, so names come from each
    family's type)."""
    suffixes = {
        "counter": ("_total",),
        "gauge": ("",),
        "histogram": ("_bucket", "_count", "_sum"),
        "summary": ("", "_count", "_sum"),
    }
    registries: list[CollectorRegistry] = [
        WorkerMetrics("m", "w").registry,
        GatewayMetrics().registry,
    ]
    return {
        family.name + suffix
        for registry in registries
        for family in registry.collect()
        for suffix in suffixes.get(family.type, ("",))
    }


# ----- alert rules --------------------------------------------------------------------------
def rule_groups() -> list[dict[str, Any]]:
    """`spec.groups` of the PrometheusRule (fails clearly when the file is missing)."""
    assert RULES.is_file(), (
        f"{RULES.relative_to(ROOT)} is missing: the PrometheusRule with Jitney's alerts belongs "
        "there (the Kubernetes monitoring manifests)"
    )
    docs = [d for d in yaml.safe_load_all(RULES.read_text()) if d]
    rules = [d for d in docs if d.get("kind") == "PrometheusRule"]
    assert rules, f"{RULES.name} has no document of kind PrometheusRule"
    groups = [g for d in rules for g in d["spec"]["groups"]]
    assert groups, f"{RULES.name}: spec.groups is empty"
    return groups


def write_rules_file(path: Path) -> Path:
    """spec.groups as a plain Prometheus rule file (what promtool and Prometheus read)."""
    path.write_text(yaml.safe_dump({"groups": rule_groups()}, sort_keys=False))
    return path


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = _tool("promtool")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60)


def _tool(name: str) -> str:
    # /usr/bin first: Debian's package puts both there, whatever PATH the test runs with.
    binary = f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else shutil.which(name)
    assert binary, f"{name} not found: `make install` installs Debian's prometheus package"
    return binary


# ----- a real Prometheus --------------------------------------------------------------------
class PrometheusServer:
    """Debian's prometheus on a free loopback port, with a generated config and a temporary
    storage directory, scraping the given targets every `scrape_interval`."""

    def __init__(
        self,
        jobs: dict[str, list[str]],
        scrape_interval: str = "1s",
        rule_files: list[Path] | None = None,
    ):
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="jitney-prometheus-"))
        config = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "rule_files": [str(p) for p in rule_files or []],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": targets}]}
                for job, targets in jobs.items()
            ],
        }
        self.config = self.dir / "prometheus.yml"
        self.config.write_text(json.dumps(config))  # JSON is YAML
        self.log = self.dir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self) -> Prometheus:
        return Prometheus(self.url)

    def start(self) -> PrometheusServer:
        check = promtool("check", "config", str(self.config))
        assert check.returncode == 0, check.stdout + check.stderr
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    _tool("prometheus"),
                    f"--config.file={self.config}",
                    f"--storage.tsdb.path={self.dir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1h",
                    "--log.level=warn",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

        def ready() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.output()
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return resp.status == 200

        wait_for(ready, 60, "prometheus /-/ready")
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
