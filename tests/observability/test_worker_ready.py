"""A worker's /ready: 503 from the moment its metrics server listens until its service says it
joined (a probe must not route work to a worker still connecting), then what the service says."""

from __future__ import annotations

import urllib.error
import urllib.request

from worker.metrics import WorkerMetrics


def status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def test_ready_is_503_until_the_service_answers_for_it():
    metrics = WorkerMetrics("m", "w")
    port = metrics.serve(0)
    assert status(port, "/health") == 200  # alive at once
    assert status(port, "/ready") == 503  # not joined yet
    joined = False
    metrics.ready = lambda: joined
    assert status(port, "/ready") == 503
    joined = True
    assert status(port, "/ready") == 200
