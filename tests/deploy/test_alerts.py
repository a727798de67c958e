"""The alerts in deploy/k8s/base/monitoring/prometheus-rules.yaml, evaluated by `promtool test
rules` (Debian's prometheus package, installed by `make install`) on synthetic series: each alert
fires on the series it is about, and stays quiet on healthy or short-lived ones."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.manifests import K8S

RULES = K8S / "base/monitoring/prometheus-rules.yaml"
W = 'model="m", worker="w1"'  # labels of a healthy-path series


def promtool() -> str:
    binary = shutil.which("promtool") or "/usr/bin/promtool"
    assert Path(binary).exists(), "promtool not found: `make install` installs Debian's prometheus"
    return binary


def alert(name: str, **labels: str) -> dict[str, Any]:
    return {"exp_labels": {"severity": _severity(name), **labels}}


def _severity(name: str) -> str:
    return next(r["labels"]["severity"] for r in _rules() if r.get("alert") == name)


def _rules() -> list[dict[str, Any]]:
    spec = yaml.safe_load(RULES.read_text())["spec"]
    return [r for g in spec["groups"] for r in g["rules"]]


def case(series: list[tuple[str, str]], checks: list[tuple[str, str, list[dict]]]) -> dict:
    return {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series],
        "alert_rule_test": [
            {"eval_time": t, "alertname": name, "exp_alerts": exp} for t, name, exp in checks
        ],
    }


TESTS = [
    # Backlog rising for 10+ minutes (both gateways report the same lag) fires; a constant
    # backlog and an empty queue do not.
    case(
        [
            ('jitney_queue_lag{instance="g1"}', "0+2x40"),
            ('jitney_queue_lag{instance="g2"}', "0+2x40"),
        ],
        [
            ("5m", "JitneyQueueLagGrowing", []),
            ("20m", "JitneyQueueLagGrowing", [alert("JitneyQueueLagGrowing")]),
        ],
    ),
    case(
        [('jitney_queue_lag{instance="g1"}', "7x40")],
        [("30m", "JitneyQueueLagGrowing", [])],
    ),
    # p99 TTFT: every first token of model "slow" took 10-30 s; model "fast" under 1 s.
    case(
        [
            ('jitney_time_to_first_token_seconds_bucket{model="slow", le="1"}', "0x40"),
            ('jitney_time_to_first_token_seconds_bucket{model="slow", le="10"}', "0x40"),
            ('jitney_time_to_first_token_seconds_bucket{model="slow", le="30"}', "0+10x40"),
            ('jitney_time_to_first_token_seconds_bucket{model="slow", le="+Inf"}', "0+10x40"),
            ('jitney_time_to_first_token_seconds_bucket{model="fast", le="1"}', "0+10x40"),
            ('jitney_time_to_first_token_seconds_bucket{model="fast", le="10"}', "0+10x40"),
            ('jitney_time_to_first_token_seconds_bucket{model="fast", le="30"}', "0+10x40"),
            ('jitney_time_to_first_token_seconds_bucket{model="fast", le="+Inf"}', "0+10x40"),
        ],
        [
            ("8m", "JitneyTTFTHigh", []),
            ("20m", "JitneyTTFTHigh", [alert("JitneyTTFTHigh", model="slow")]),
        ],
    ),
    # KV over 95% for 5 minutes fires; 90%, or a 3-minute spike, does not.
    case(
        [
            (f"jitney_kv_cache_usage_ratio{{{W}}}", "0.97x20"),
            ('jitney_kv_cache_usage_ratio{model="m", worker="w2"}', "0.90x20"),
            ('jitney_kv_cache_usage_ratio{model="m", worker="w3"}', "0.99x2 0.5x20"),
        ],
        [
            ("3m", "JitneyKVCacheFull", []),
            ("10m", "JitneyKVCacheFull", [alert("JitneyKVCacheFull", model="m", worker="w1")]),
        ],
    ),
    # 0.5 preemptions/s for 15+ minutes fires; one a minute does not.
    case(
        [
            (f"jitney_preemptions_total{{{W}}}", "0+30x40"),
            ('jitney_preemptions_total{model="m", worker="w2"}', "0+1x40"),
        ],
        [
            ("10m", "JitneyPreemptionsSustained", []),
            (
                "25m",
                "JitneyPreemptionsSustained",
                [alert("JitneyPreemptionsSustained", model="m", worker="w1")],
            ),
        ],
    ),
    # One request dead-lettered at 10m fires at once; none for a while stays quiet.
    case(
        [(f'jitney_request_handoffs_total{{{W}, event="dead_lettered"}}', "0x9 1x20")],
        [
            ("5m", "JitneyRequestsDeadLettered", []),
            ("11m", "JitneyRequestsDeadLettered", [alert("JitneyRequestsDeadLettered", model="m")]),
        ],
    ),
    # The only worker's series goes stale at 5m: the alert fires 2 minutes later.
    case(
        [(f"jitney_kv_blocks_total{{{W}}}", "100x4 stale")],
        [
            ("4m", "JitneyNoLiveWorkers", []),
            ("9m", "JitneyNoLiveWorkers", [alert("JitneyNoLiveWorkers")]),
        ],
    ),
]


def test_alert_rules_fire_when_they_should(tmp_path: Path) -> None:
    spec = yaml.safe_load(RULES.read_text())["spec"]
    # Annotations are templates checked by `promtool check rules` (tests/observability); here
    # the expressions, durations and labels are what is under test.
    for group in spec["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": spec["groups"]}, sort_keys=False))
    tests = tmp_path / "tests.yml"
    tests.write_text(
        yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": TESTS})
    )
    tested = {check["alertname"] for t in TESTS for check in t["alert_rule_test"]}
    assert tested == {r["alert"] for r in _rules() if "alert" in r}, "an alert has no test"
    result = subprocess.run(
        [promtool(), "test", "rules", tests.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
