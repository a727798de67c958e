"""deploy/k8s: each overlay (and each optional component) builds with the documented kustomize
command, every manifest passes offline schema validation, and the pieces fit together: probes,
grace periods, autoscaling on the real stream, Redis persistence and secrets, network policies,
monitoring of the real metric ports, dashboards from grafana/dashboards."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import redis
import yaml

from jitney.cli import build_parser
from protocol import WORKER_GROUP, Keys
from protocol.redis_client import cluster_target, sentinel_target
from tests.deploy.manifests import (
    K8S,
    KUSTOMIZE_ARGS,
    REPO,
    Manifest,
    build,
    container,
    env,
    find,
    pod_labels,
    pre_stop_seconds,
    selects,
    validate,
)
from tests.services import free_port, wait_for

OVERLAYS = ["cpu", "gpu"]
# Each entry: components applied together, in order.
COMPONENTS = [
    "external-redis",
    "model-pvc",
    "worker-hpa",
    "scale-to-zero",
    "external-redis+sentinel",
    "external-redis+redis-cluster",
    "prefix-placement",
]
# The base's served model name (JITNEY_SERVED_MODEL_NAME), whose request stream KEDA watches.
SERVED_MODEL = "smollm2-135m"
# After --shutdown-timeout the worker keeps trying to deliver its last replies this long.
WORKER_PUBLISH_GRACE_S = 5
ALERT_TOPICS = {  # what the issue asks to alert on -> metric each alert must read
    "queue lag growing": "jitney_queue_lag",
    "p99 TTFT high": "jitney_time_to_first_token_seconds_bucket",
    "KV usage > 95%": "jitney_kv_cache_usage_ratio",
    "sustained preemptions": "jitney_preemptions_total",
    "no live workers": "jitney_kv_blocks_total",
}


@pytest.fixture(scope="module")
def built() -> dict[str, list[Manifest]]:
    return {o: build(K8S / "overlays" / o) for o in OVERLAYS}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_builds_and_every_manifest_validates(built, overlay):
    docs = built[overlay]
    kinds = {d["kind"] for d in docs}
    assert {
        "StatefulSet",
        "Deployment",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "ScaledObject",
        "PodMonitor",
        "PrometheusRule",
        "NetworkPolicy",
    } <= kinds
    for doc in docs:
        validate(doc)
        assert doc["metadata"].get("namespace", "jitney") == "jitney"


def test_schema_validation_catches_mistakes(built):
    """The validators are not vacuous: a misspelt field fails, built-in and CRD alike."""
    gateway = json.loads(json.dumps(find(built["cpu"], "Deployment", "jitney-gateway")))
    gateway["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(AssertionError, match="readinesProbe"):
        validate(gateway)
    scaled = json.loads(json.dumps(find(built["cpu"], "ScaledObject", "jitney-worker")))
    scaled["spec"]["minReplicas"] = 1
    with pytest.raises(AssertionError, match="minReplicas"):
        validate(scaled)


def assert_env_references_come_first(c: dict) -> None:
    """Kubernetes expands $(VAR) only from variables defined earlier in the list; a later one is
    left as the literal text (and kustomize's patches reorder env lists)."""
    defined: set[str] = set()
    for var in c.get("env", []):
        for ref in re.findall(r"\$\(([A-Z0-9_]+)\)", var.get("value", "")):
            assert ref in defined, f"{c['name']}: {var['name']} uses $({ref}) before it is set"
        defined.add(var["name"])


@pytest.mark.parametrize("component", COMPONENTS)
def test_optional_component_builds_and_validates(tmp_path, monkeypatch, component):
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                # kustomize takes relative paths only.
                "resources": [os.path.relpath(K8S / "overlays" / "gpu", tmp_path)],
                "components": [
                    os.path.relpath(K8S / "components" / c, tmp_path) for c in component.split("+")
                ],
            }
        )
    )
    docs = build(tmp_path)
    for doc in docs:
        validate(doc)
    for name in ("jitney-gateway", "jitney-worker"):
        for c in find(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"]:
            assert_env_references_come_first(c)
    worker = container(find(docs, "Deployment", "jitney-worker"), "worker")
    if component == "external-redis":
        assert not [
            d
            for d in docs
            if d["metadata"]["name"].startswith("jitney-redis")
            and d["kind"] in {"StatefulSet", "Service", "NetworkPolicy"}
        ]
        gateway = container(find(docs, "Deployment", "jitney-gateway"), "gateway")
        for c in (gateway, worker):
            assert env(c)["REDIS_ADDRESS"] != "jitney-redis:6379"
            assert env(c)["REDIS_URL"].startswith("rediss://")
        trigger = find(docs, "ScaledObject", "jitney-worker")["spec"]["triggers"][0]
        assert trigger["metadata"]["enableTLS"] == "true"
    elif component == "external-redis+sentinel":
        gateway = container(find(docs, "Deployment", "jitney-gateway"), "gateway")
        for c in (gateway, worker):
            url = env(c)["REDIS_URL"]
            assert url.startswith("redis+sentinels://") and "$(REDIS_SENTINELS)" in url
            expanded = (
                url.replace("$(REDIS_PASSWORD)", "pw")
                .replace("$(REDIS_SENTINELS)", env(c)["REDIS_SENTINELS"])
                .replace("$(REDIS_SENTINEL_SERVICE)", env(c)["REDIS_SENTINEL_SERVICE"])
            )
            target = sentinel_target(expanded)  # the URL the processes will parse
            assert target is not None and target.tls and len(target.sentinels) == 3
        (trigger,) = find(docs, "ScaledObject", "jitney-worker")["spec"]["triggers"]
        assert trigger["type"] == "redis-sentinel-streams"
        meta = trigger["metadata"]
        assert meta["addressesFromEnv"] == "REDIS_SENTINELS" and "addressFromEnv" not in meta
        assert meta["sentinelMasterFromEnv"] == "REDIS_SENTINEL_SERVICE"
        assert meta["stream"] == Keys().requests(SERVED_MODEL)
        assert meta["consumerGroup"] == WORKER_GROUP
    elif component == "external-redis+redis-cluster":
        gateway = container(find(docs, "Deployment", "jitney-gateway"), "gateway")
        for c in (gateway, worker):
            url = env(c)["REDIS_URL"]
            assert url.startswith("redis+clusters://") and "$(REDIS_CLUSTER_NODES)" in url
            # $(VAR) expands only variables defined earlier in the list.
            names = [x["name"] for x in c["env"]]
            assert names.index("REDIS_URL") > max(
                names.index("REDIS_PASSWORD"), names.index("REDIS_CLUSTER_NODES")
            )
            expanded = url.replace("$(REDIS_PASSWORD)", "pw").replace(
                "$(REDIS_CLUSTER_NODES)", env(c)["REDIS_CLUSTER_NODES"]
            )
            target = cluster_target(expanded)  # the URL the processes will parse
            assert target is not None and target.tls and len(target.nodes) >= 3
            assert target.password == "pw"
        (trigger,) = find(docs, "ScaledObject", "jitney-worker")["spec"]["triggers"]
        assert trigger["type"] == "redis-cluster-streams"
        meta = trigger["metadata"]
        assert meta["addressesFromEnv"] == "REDIS_CLUSTER_NODES"
        # A cluster has database 0 only: KEDA's cluster scaler takes neither.
        assert "addressFromEnv" not in meta and "databaseIndex" not in meta
        assert meta["enableTLS"] == "true"
        assert meta["stream"] == Keys().requests(SERVED_MODEL)
        assert meta["consumerGroup"] == WORKER_GROUP
    elif component == "scale-to-zero":
        scaled = find(docs, "ScaledObject", "jitney-worker")["spec"]
        assert scaled["minReplicaCount"] == 0 and scaled["cooldownPeriod"] >= 300
        gateway = container(find(docs, "Deployment", "jitney-gateway"), "gateway")
        assert env(gateway)["JITNEY_QUEUE_WITHOUT_WORKERS"] == "1"
        monkeypatch.setenv("JITNEY_QUEUE_WITHOUT_WORKERS", "1")  # the gateway reads it so
        assert build_parser().parse_args(["gateway"]).queue_without_workers is True
    elif component == "prefix-placement":
        gateway = container(find(docs, "Deployment", "jitney-gateway"), "gateway")
        for c in (gateway, worker):
            assert env(c)["JITNEY_PREFIX_PLACEMENT"] == "1"
        for command in ("gateway", "worker"):  # both read it so
            monkeypatch.setenv("JITNEY_PREFIX_PLACEMENT", "1")
            assert build_parser().parse_args([command]).prefix_placement is True
        # KEDA scales on the lag of every stream of the model, own streams included.
        (trigger,) = find(docs, "ScaledObject", "jitney-worker")["spec"]["triggers"]
        assert trigger["type"] == "prometheus"
        served = env(worker)["JITNEY_SERVED_MODEL_NAME"]
        assert trigger["metadata"]["query"] == f'max(jitney_queue_lag{{model="{served}"}})'
    elif component == "model-pvc":
        find(docs, "PersistentVolumeClaim", "jitney-models")
        assert env(worker)["JITNEY_MODEL"].startswith("/models/")
        # The served name and KEDA's stream change together.
        served = env(worker)["JITNEY_SERVED_MODEL_NAME"]
        assert served != SERVED_MODEL
        (trigger,) = find(docs, "ScaledObject", "jitney-worker")["spec"]["triggers"]
        assert trigger["metadata"]["stream"] == Keys().requests(served)
        assert any(m["mountPath"] == "/models" and m["readOnly"] for m in worker["volumeMounts"])
    else:  # worker-hpa: the HPA on jitney_queue_lag replaces KEDA
        assert not [d for d in docs if d["apiVersion"].startswith("keda.sh/")]
        hpa = find(docs, "HorizontalPodAutoscaler", "jitney-worker")
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "External"
        assert metric["external"]["metric"]["name"] == "jitney_queue_lag"
        served = env(worker)["JITNEY_SERVED_MODEL_NAME"]
        assert metric["external"]["metric"]["selector"]["matchLabels"] == {"model": served}
        assert hpa["spec"]["minReplicas"] >= 1
        adapter = yaml.safe_load(
            (K8S / "components/worker-hpa/prometheus-adapter-values.yaml").read_text()
        )
        (rule,) = adapter["rules"]["external"]
        assert (
            rule["name"]["as"] == "jitney_queue_lag" and "jitney_queue_lag" in rule["seriesQuery"]
        )


def test_gateway_probes_scaling_and_drain(built):
    docs = built["cpu"]
    deploy = find(docs, "Deployment", "jitney-gateway")
    c = container(deploy, "gateway")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == int(env(c)["JITNEY_PORT"])
    assert ports["metrics"] == int(env(c)["JITNEY_METRICS_PORT"])
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # Stateless: several replicas, owned by the HPA on CPU; a PDB keeps most of them up.
    assert "replicas" not in deploy["spec"]
    hpa = find(docs, "HorizontalPodAutoscaler", "jitney-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "jitney-gateway"
    assert hpa["spec"]["minReplicas"] >= 2
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert "requests" in c["resources"] and "cpu" in c["resources"]["requests"]
    pdb = find(docs, "PodDisruptionBudget", "jitney-gateway")
    assert selects(pdb["spec"]["selector"], pod_labels(deploy))
    svc = find(docs, "Service", "jitney-gateway")
    assert svc["spec"]["selector"].items() <= pod_labels(deploy).items()
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    # Drain: stop receiving (preStop), then aiohttp's shutdown for open streams, then margin.
    grace = deploy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert pre_stop_seconds(c) >= 5
    assert grace >= pre_stop_seconds(c) + float(env(c)["JITNEY_SHUTDOWN_TIMEOUT"]) + 5
    # Each pod gets its own reply stream.
    assert env(c)["JITNEY_GATEWAY_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_probes_drain_and_device(built, overlay):
    deploy = find(built[overlay], "Deployment", "jitney-worker")
    c = container(deploy, "worker")
    e = env(c)
    spec = deploy["spec"]["template"]["spec"]
    # The real flag (JITNEY_SHUTDOWN_TIMEOUT is how the CLI reads --shutdown-timeout).
    assert "--shutdown-timeout" in _worker_help()
    timeout = float(e["JITNEY_SHUTDOWN_TIMEOUT"])
    assert spec["terminationGracePeriodSeconds"] >= (
        pre_stop_seconds(c) + timeout + WORKER_PUBLISH_GRACE_S + 5
    )
    # The metrics server (and /health) starts once the model is loaded: the startup probe must
    # allow minutes before liveness takes over.
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"]
    assert port == int(e["JITNEY_METRICS_PORT"])
    assert e["JITNEY_WORKER_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert "replicas" not in deploy["spec"]  # KEDA owns the count
    # The worker computes on its CPU limit (engine/threads.py reads the cgroup quota): a limit
    # of whole CPUs, as many as it requests, and no thread count set beside it to disagree.
    cpus = {k: cpu_quantity(v["cpu"]) for k, v in c["resources"].items()}
    assert cpus["limits"] == cpus["requests"] and cpus["limits"] >= 1
    assert cpus["limits"] == int(cpus["limits"]), "a fraction of a CPU is a thread it waits on"
    assert not {"OMP_NUM_THREADS", "JITNEY_THREADS"} & set(e)
    assert "--threads" in _worker_help()
    gpus = {k: v.get("nvidia.com/gpu") for k, v in c["resources"].items()}
    if overlay == "gpu":
        assert gpus == {"limits": 1, "requests": 1}
        assert e["JITNEY_DEVICE"] == "cuda" and c["image"].endswith(":cuda")
    else:
        assert gpus == {"limits": None, "requests": None}
        assert e["JITNEY_DEVICE"] == "cpu" and c["image"].endswith(":cpu")


def cpu_quantity(value: str | int | float) -> float:
    """A Kubernetes CPU quantity ("2", 2, "1500m") in CPUs."""
    text = str(value)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _worker_help() -> str:

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["worker"].format_help()


def test_keda_scales_workers_on_the_request_stream_lag(built):
    docs = built["cpu"]
    scaled = find(docs, "ScaledObject", "jitney-worker")["spec"]
    assert scaled["scaleTargetRef"]["name"] == "jitney-worker"
    # Not to zero by default: gateways are not ready without a worker (components/scale-to-zero
    # changes both).
    assert 1 <= scaled["minReplicaCount"] < scaled["maxReplicaCount"]
    assert scaled["cooldownPeriod"] >= 60
    behavior = scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300
    (trigger,) = scaled["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "redis-streams"
    # The stream of the model the workers serve (JITNEY_SERVED_MODEL_NAME, --served-model-name).
    worker_env = env(container(find(docs, "Deployment", "jitney-worker"), "worker"))
    assert worker_env["JITNEY_SERVED_MODEL_NAME"] == SERVED_MODEL
    assert "--served-model-name" in _worker_help()
    assert meta["stream"] == Keys().requests(SERVED_MODEL)
    assert meta["consumerGroup"] == WORKER_GROUP
    assert int(meta["lagCount"]) > 0
    # The scaler reads the Redis address from the worker's own environment and the password
    # from the same Secret the workers use.
    assert meta["addressFromEnv"] in worker_env
    auth = find(docs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    (ref,) = auth["spec"]["secretTargetRef"]
    assert ref["parameter"] == "password"
    assert worker_env["REDIS_PASSWORD"] == {
        "secretKeyRef": {"name": ref["name"], "key": ref["key"]}
    }


def test_redis_url_is_built_from_the_secret(built):
    docs = built["cpu"]
    redis_svc = find(docs, "Service", "jitney-redis")
    for name, cname in (("jitney-gateway", "gateway"), ("jitney-worker", "worker")):
        e = env(container(find(docs, "Deployment", name), cname))
        assert e["REDIS_PASSWORD"] == {"secretKeyRef": {"name": "jitney-redis", "key": "password"}}
        assert e["REDIS_URL"] == "redis://:$(REDIS_PASSWORD)@$(REDIS_ADDRESS)/0"
        host, port = e["REDIS_ADDRESS"].split(":")
        assert host == redis_svc["metadata"]["name"]
        assert int(port) == redis_svc["spec"]["ports"][0]["port"]
        # $(VAR) expands only variables defined earlier in the list.
        names = [x["name"] for x in container(find(docs, "Deployment", name), cname)["env"]]
        assert names.index("REDIS_URL") > max(
            names.index("REDIS_PASSWORD"), names.index("REDIS_ADDRESS")
        )
    # No Secret is shipped: the password is created out of band (docs/deploy.md says how).
    assert not [d for d in docs if d["kind"] == "Secret"]
    assert (
        "kubectl -n jitney create secret generic jitney-redis"
        in (REPO / "docs/deploy.md").read_text()
    )


def test_redis_statefulset_runs_the_shipped_config_with_aof_and_password(built, tmp_path):
    """The StatefulSet mounts a PVC at /data and starts redis-server with the ConfigMap's
    redis.conf plus the password; that config, run for real, has AOF on and never evicts."""
    docs = built["cpu"]
    sts = find(docs, "StatefulSet", "jitney-redis")
    c = container(sts, "redis")
    assert [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]] == ["data"]
    assert {"name": "data", "mountPath": "/data"} in c["volumeMounts"]
    config_volume = next(
        v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"
    )
    cm = find(docs, "ConfigMap", config_volume["configMap"]["name"])
    script = c["command"][-1]
    assert "redis-server /etc/redis/redis.conf --dir /data" in script
    assert '--requirepass "$REDIS_PASSWORD"' in script
    (tmp_path / "redis.conf").write_text(cm["data"]["redis.conf"])
    port = free_port()
    binary = shutil.which("redis-server")
    assert binary, "redis-server not found: `make install` installs it"
    # The shipped config, with only the data directory and port moved here.
    proc = subprocess.Popen(
        [
            binary,
            str(tmp_path / "redis.conf"),
            "--dir",
            str(tmp_path),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--requirepass",
            "s3cret",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=port, password="s3cret", socket_timeout=2)
        wait_for(client.ping, 10, "redis-server with the shipped redis.conf")
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=2).ping()
        client.xadd("s", {"v": "1"})
        assert list((tmp_path / "appendonlydir").iterdir())
    finally:
        proc.terminate()
        proc.wait(10)


def test_network_policies(built):
    docs = built["cpu"]
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    gateway = pod_labels(find(docs, "Deployment", "jitney-gateway"))
    worker = pod_labels(find(docs, "Deployment", "jitney-worker"))
    redis_pods = pod_labels(find(docs, "StatefulSet", "jitney-redis"))

    def governing(labels: dict[str, str]) -> list[Manifest]:
        found = [p for p in policies.values() if selects(p["podSelector"], labels)]
        assert found and all("Ingress" in p["policyTypes"] for p in found), labels
        return found

    def sources(labels: dict[str, str], port: int) -> list[Manifest]:
        """`from` peers allowed to reach `port`; [{}] means anyone."""
        peers: list[Manifest] = []
        for policy in governing(labels):
            for rule in policy.get("ingress", []):
                if any(p["port"] == port for p in rule.get("ports", [])) or "ports" not in rule:
                    peers += rule.get("from", [{}])
        return peers

    def is_prometheus(peer: Manifest) -> bool:
        return (
            peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/name")
            == "prometheus"
            and "namespaceSelector" in peer
        )

    # Redis: gateways and workers (and KEDA's operator, which reads the lag to scale).
    redis_peers = sources(redis_pods, 6379)
    same_ns = [p for p in redis_peers if "namespaceSelector" not in p]
    assert sorted((p["podSelector"]["matchLabels"] for p in same_ns), key=str) == sorted(
        [gateway, worker], key=str
    )
    other = [p for p in redis_peers if "namespaceSelector" in p]
    assert [p["podSelector"]["matchLabels"] for p in other] == [{"app": "keda-operator"}]
    # Metrics ports: Prometheus only. The gateway's API port stays open.
    for labels, port in ((gateway, 9101), (worker, 9100)):
        peers = sources(labels, port)
        assert peers and all(is_prometheus(p) for p in peers), (labels, peers)
    assert {} in sources(gateway, 8000)
    # Nothing else reaches a worker.
    for policy in governing(worker):
        for rule in policy["ingress"]:
            assert [p["port"] for p in rule["ports"]] == [9100]


def test_pod_monitors_scrape_the_metric_ports(built):
    docs = built["cpu"]
    for name, cname in (("jitney-gateway", "gateway"), ("jitney-worker", "worker")):
        deploy = find(docs, "Deployment", name)
        monitor = find(docs, "PodMonitor", name)["spec"]
        assert selects(monitor["selector"], pod_labels(deploy))
        port_names = {p["name"] for p in container(deploy, cname)["ports"]}
        for endpoint in monitor["podMetricsEndpoints"]:
            assert endpoint["port"] == "metrics" and "metrics" in port_names
            assert endpoint.get("path", "/metrics") == "/metrics"


def test_alerts_cover_the_issue_with_real_metrics(built):
    rule = find(built["cpu"], "PrometheusRule", "jitney")
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    exprs = " ".join(r["expr"] for r in alerts)
    for topic, metric in ALERT_TOPICS.items():
        assert re.search(rf"\b{metric}\b", exprs), f"no alert on {topic} ({metric})"
    kv = next(r for r in alerts if "jitney_kv_cache_usage_ratio" in r["expr"])
    assert "0.95" in kv["expr"] and kv["for"] == "5m"
    # The file at the path the observability tests and docs name is this PrometheusRule.
    path = K8S / "base/monitoring/prometheus-rules.yaml"
    assert yaml.safe_load(path.read_text())["spec"] == rule["spec"]


def test_dashboards_are_configmaps_generated_from_grafana_dir(built):
    dashboards = sorted((REPO / "grafana/dashboards").glob("*.json"))
    assert dashboards, "grafana/dashboards/*.json is missing"
    for overlay in OVERLAYS:
        maps = [
            d
            for d in built[overlay]
            if d["kind"] == "ConfigMap"
            and d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
        ]
        data = {k: v for m in maps for k, v in m["data"].items()}
        # Byte for byte the files in grafana/dashboards: one source, no copies.
        assert data == {p.name: p.read_text() for p in dashboards}


def test_docs_quote_the_build_command_the_tests_run():
    docs = (REPO / "docs/deploy.md").read_text()
    command = "kubectl " + " ".join(KUSTOMIZE_ARGS)
    for overlay in OVERLAYS:
        assert f"{command} deploy/k8s/overlays/{overlay}" in docs


def test_every_manifest_file_is_used():
    """A YAML file under deploy/k8s that no kustomization lists would silently never deploy."""
    listed: set[Path] = set()
    for kfile in K8S.rglob("kustomization.yaml"):
        k = yaml.safe_load(kfile.read_text())
        entries = [*k.get("resources", []), *k.get("components", [])]
        entries += [p["path"] for p in k.get("patches", []) if "path" in p]
        for entry in entries:
            listed.add((kfile.parent / entry).resolve())
    not_manifests = {"kustomization.yaml", "prometheus-adapter-values.yaml"}
    for path in K8S.rglob("*.yaml"):
        if path.name not in not_manifests:
            assert path.resolve() in listed, f"{path.relative_to(REPO)} is in no kustomization"
