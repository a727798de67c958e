"""The leak check finds the run's service processes, orphans included, and charges a leak to the
test during which the process started."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests import processes
from tests.processes import LeakWatch
from tests.services import RedisServer, free_port, wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_running_redis_server_is_found_and_gone_once_stopped():
    server = RedisServer().start()
    try:
        assert server.proc is not None
        (found,) = [p for p in processes.service_processes() if p.pid == server.proc.pid]
        assert found.name == "redis-server" and processes.alive(found)
    finally:
        server.close()
    assert not processes.alive(found)
    assert found not in processes.service_processes()


def test_an_orphan_is_still_the_runs_and_a_leak_names_its_test():
    """A redis-server whose parent exited (as the parts of a killed `jitney up`) is adopted by
    pytest, the subreaper; kept past its module's end it is reported with its test, and killed."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server not found: `make install` installs it"
    port = free_port()
    # The shell starts redis-server in the background and exits at once: an orphan.
    spawn = f"{binary} --port {port} --bind 127.0.0.1 --save '' >/dev/null 2>&1 & echo $!"
    pid = int(subprocess.run(["sh", "-c", spawn], capture_output=True, text=True).stdout)
    watch = LeakWatch(current="tests/x.py::test_that_leaks")
    try:
        wait_for(lambda: any(p.pid == pid for p in processes.service_processes()), 10, "the orphan")
        assert watch.after_test(scope_ends=False) is None  # its module may still hold it
        watch.current = "tests/x.py::test_after_it"
        report = watch.after_test(scope_ends=True)
        assert report is not None and f"pid {pid} redis-server" in report
        assert "during tests/x.py::test_that_leaks" in report
        assert "test_after_it" not in report
        assert not any(p.pid == pid for p in processes.service_processes())  # killed
        assert watch.after_test(scope_ends=True) is None
    finally:
        processes.kill({p for p in processes.service_processes() if p.pid == pid})
