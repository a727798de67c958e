"""`jitney bench queue`: noop workers and a gateway on a private Redis, streamed closed loop;
the report accounts every token and every component's CPU."""

import json

from jitney.cli import main


def test_bench_queue_reports_tokens_cpu_and_ceilings(tmp_path, capsys):
    out = tmp_path / "queue.json"
    args = ["bench", "queue", "--workers", "2", "--slots", "8", "--requests", "32"]
    args += ["--output-len", "24", "--step-ms", "2", "--output", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["streamed_tokens"] == 32 * 24 and report["failed_requests"] == 0
    cpu = report["cpu_s_per_million_tokens"]
    assert cpu["redis_main_thread"] > 0 and cpu["gateway-0"] > 0 and cpu["workers_total"] > 0
    assert report["redis_commands_per_token"] > 0 and report["redis_bytes_out_per_token"] > 0
    assert report["ceiling_tokens_per_s"]["one_redis_core"] > report["tokens_per_s"]
    assert "Extrapolated at 100% of one core" in capsys.readouterr().out


def test_compare_charts_saved_results(tmp_path, capsys):
    report = {
        "setup": {"workers": 1, "slots": 8, "gateways": 1, "step_ms": 2.0},
        "streamed_tokens": 100,
        "failed_requests": 0,
        "wall_s": 1.0,
        "tokens_per_s": 100.0,
        "cpu_s_per_million_tokens": {"redis_main_thread": 5.0, "gateway-0": 50.0},
        "redis_commands_per_token": 1.0,
        "redis_bytes_in_per_token": 100.0,
        "redis_bytes_out_per_token": 50.0,
        "ceiling_tokens_per_s": {"one_redis_core": 200000, "one_gateway_process": 20000},
    }
    path = tmp_path / "a.json"
    path.write_text(json.dumps(report))
    plot = tmp_path / "c.png"
    args = ["bench", "queue", "--compare", f"old={path}", f"new={path}", "--plot", str(plot)]
    assert main(args) == 0
    assert plot.read_bytes()[:4] == b"\x89PNG" and "== old" in capsys.readouterr().out
