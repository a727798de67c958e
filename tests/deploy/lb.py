"""Helpers for the load-balancer test: nginx run from deploy/nginx/nginx.conf, and a slow model.

nginx runs the shipped compose config with only what must differ rewritten (upstream addresses,
listen address, include path) plus private pid/log/temp paths, so it runs as root or not and
never touches /var.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from tests.model_dirs import write_random_llama
from tests.services import free_port, wait_for

REPO = Path(__file__).resolve().parents[2]
NGINX_DIR = REPO / "deploy" / "nginx"
NGINX_INSTALL_HINT = "nginx not found: `make install` installs it (Debian: apt-get install nginx)"


def nginx_binary() -> str:
    found = shutil.which("nginx") or (
        "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None
    )
    if found is None:
        raise RuntimeError(NGINX_INSTALL_HINT)
    return found


def _sub_exactly(pattern: str, repl: str, text: str, count: int) -> str:
    new, n = re.subn(pattern, repl, text, flags=re.MULTILINE)
    assert n == count, (
        f"deploy/nginx/nginx.conf: expected {count} match(es) of {pattern!r}, got {n}"
    )
    return new


def render_nginx_conf(gateway_ports: list[int], listen_port: int, workdir: Path) -> str:
    """deploy/nginx/nginx.conf, pointed at loopback gateways, with private runtime paths."""
    text = (NGINX_DIR / "nginx.conf").read_text()
    servers = iter(gateway_ports)
    text, n = re.subn(
        r"^(\s*server )gateway-\d+:8000( [^;]*)?;",
        lambda m: f"{m.group(1)}127.0.0.1:{next(servers)}{m.group(2) or ''};",
        text,
        flags=re.MULTILINE,
    )
    assert n == len(gateway_ports), (
        f"nginx.conf has {n} gateway servers, the test runs {len(gateway_ports)}"
    )
    text = _sub_exactly(r"^(\s*)listen 8080;", rf"\1listen 127.0.0.1:{listen_port};", text, 1)
    text = _sub_exactly(
        r"include /etc/nginx/jitney-proxy\.conf;",
        f"include {NGINX_DIR / 'jitney-proxy.conf'};",
        text,
        1,
    )
    temp = "\n".join(
        f"    {kind}_temp_path {workdir / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    # The test learns which gateway carried each stream from this header (not for production:
    # it tells clients the internal addresses).
    text = _sub_exactly(
        r"^http \{",
        f"http {{\n{temp}\n    add_header X-Jitney-Upstream $upstream_addr always;",
        text,
        1,
    )
    header = [
        "daemon off;",
        f"pid {workdir / 'nginx.pid'};",
        f"lock_file {workdir / 'nginx.lock'};",
        f"error_log {workdir / 'error.log'} warn;",
    ]
    if os.geteuid() == 0:  # as root nginx would switch its workers to `nobody`: keep our user
        header.append(f"user {pwd.getpwuid(0).pw_name};")
    return "\n".join(header) + "\n" + text


class Nginx:
    def __init__(self, gateway_ports: list[int]):
        self.binary = nginx_binary()
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="jitney-nginx-"))
        self.conf = self.dir / "nginx.conf"
        self.conf.write_text(render_nginx_conf(gateway_ports, self.port, self.dir))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        path = self.dir / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self) -> Nginx:
        args = [
            self.binary,
            "-p",
            str(self.dir),
            "-c",
            str(self.conf),
            "-e",
            str(self.dir / "error.log"),
        ]
        check = subprocess.run([*args, "-t"], capture_output=True, text=True)
        assert check.returncode == 0, f"nginx -t failed:\n{check.stderr}\n{self.conf.read_text()}"
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, (
                f"nginx exited:\n{self.log()}"
            )
            with urllib.request.urlopen(f"{self.url}/nginx-health", timeout=2) as resp:
                return resp.status == 200

        wait_for(up, 15, "nginx")
        return self

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: nginx's fast shutdown
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def write_slow_model(path: Path) -> Path:
    """A seeded random Llama (~30M parameters) with the tiny byte-level tokenizer, as a Hugging
    Face directory. tiny-random decodes ~700 tokens/s here, so any request of it (at most 2048
    tokens) ends before a gateway's 5 s heartbeat can lapse; this one decodes ~60 tokens/s, so a
    long request is still running when the workers notice its gateway is dead."""
    return write_random_llama(
        path,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
