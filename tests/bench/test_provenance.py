"""What a bench result records about its making: the command without this machine's paths."""

from __future__ import annotations

import json
import shlex

from bench.provenance import REPO_ROOT, SHARED_TRACES, recorded_command

TRACE = SHARED_TRACES / "mixed-64.json"


def test_machine_paths_become_repository_relative():
    """Program, repo paths, shared traces, URLs, other absolute paths and quoting."""
    argv = [
        "/home/someone/jitney/.venv/bin/jitney",
        "bench",
        "serve",
        "--trace",
        str(TRACE),
        "--output",
        str(REPO_ROOT / "bench" / "results" / "serve.json"),
        "--plot",
        "/tmp/serve/serve.png",
        "--url",
        "http://127.0.0.1:18100",
        "--title",
        "SmolLM2 (16 slots): mixed-64",
    ]
    command = recorded_command(argv, cwd=REPO_ROOT)
    assert command == (
        "jitney bench serve --trace ../shared/traces/mixed-64.json "
        "--output bench/results/serve.json --plot /tmp/serve/serve.png "
        "--url http://127.0.0.1:18100 --title 'SmolLM2 (16 slots): mixed-64'"
    )
    assert shlex.split(command)[-1] == "SmolLM2 (16 slots): mixed-64"  # one word again


def test_relative_paths_are_read_from_where_it_ran():
    """Run from a subfolder, `results/x.json` is the repository's `bench/results/x.json`, the
    `--flag=value` form included; a relative path outside the repository becomes absolute."""
    argv = ["jitney", "bench", "offline", "--trace=../../shared/traces/t.json", "-o", "results/x"]
    assert recorded_command(argv, cwd=REPO_ROOT / "bench") == (
        "jitney bench offline --trace=../shared/traces/t.json -o bench/results/x"
    )
    outside = REPO_ROOT.parent.parent / "elsewhere"
    assert recorded_command(["jitney", "--output", "out/r.json"], cwd=outside) == (
        f"jitney --output {outside / 'out' / 'r.json'}"
    )


def test_words_without_a_slash_stay_as_typed():
    argv = ["python3 -m jitney.cli", "bench", "offline", "--policies", "continuous,static"]
    assert recorded_command(argv, cwd="/") == "jitney bench offline --policies continuous,static"


def test_committed_results_record_portable_commands():
    """Every committed result's command runs from any checkout's root: no paths of the
    machine it was measured on."""
    results = sorted((REPO_ROOT / "bench" / "results").glob("*.json"))
    assert results
    for path in results:
        command = json.loads(path.read_text())["command"]
        words = shlex.split(command)
        assert words[0] == "jitney", path.name
        assert str(REPO_ROOT) not in command and str(SHARED_TRACES) not in command, path.name
        output = words[words.index("--output") + 1]
        assert output == f"bench/results/{path.name}", path.name
