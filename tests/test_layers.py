"""The package layers: no import runs back up, and the pure parts stay pure.

Layers, top down: `jitney/` → `bench/`, `worker/` → `engine/`, `gateway/` → `scheduler/`,
`protocol/` → `generation/` (what a token stream means) and `launch/` (local process
management). `research/` (probes, not installed) sits beside `bench/`: it may use what bench may,
and nothing installed imports it. Every import statement counts, lazy ones inside functions too.
"""

from __future__ import annotations

import ast
import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from protocol import Keys

ROOT = Path(__file__).resolve().parents[1]

# package -> top-level modules it must never import
FORBIDDEN: dict[str, set[str]] = {
    "scheduler": {"torch", "redis", "aiohttp", "transformers", "protocol", "engine", "worker"}
    | {"gateway", "bench", "jitney"},
    "generation": {"torch", "redis", "aiohttp", "protocol", "launch", "scheduler", "engine"}
    | {"worker", "gateway", "bench", "jitney"},
    "launch": {"torch", "transformers", "redis", "aiohttp", "protocol", "generation"}
    | {"scheduler", "engine", "worker", "gateway", "bench", "jitney"},
    "protocol": {"torch", "engine", "worker", "gateway", "bench", "jitney", "scheduler", "launch"},
    "engine": {"redis", "aiohttp", "protocol.keys", "protocol.redis_client", "protocol.queue"}
    | {"launch", "worker", "gateway", "bench", "jitney"},
    "worker": {"gateway", "bench", "jitney", "aiohttp", "launch"},
    "gateway": {"torch", "engine", "worker", "bench", "jitney", "launch"},
    "bench": {"jitney"},
    "jitney": set(),  # the top: it may import any installed package
    # The probes are not installed: no installed package may import them (added below), and
    # they run from a checkout beside bench/, on nothing above it (a test helper they need runs
    # as a process of its own).
    "research": {"jitney", "tests"},
}
# What `pip install` ships (pyproject.toml's packages): none of it may import the probes.
INSTALLED = set(FORBIDDEN) - {"research"}
FORBIDDEN = {
    package: banned | {"research"} if package in INSTALLED else banned
    for package, banned in FORBIDDEN.items()
}
# Every package of code the checks below read, installed or not.
CODE = ["scheduler", "engine", "worker", "gateway", "bench", "research", "jitney", "tests"]


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement in `path` names, with each of its parent packages."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 2)}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_nothing_above_or_beside_its_layer(package: str) -> None:
    """Each package's modules import none of the packages its layer forbids."""
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no modules found under {package}/"
    offences = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files
        for name in sorted(imported_modules(path) & FORBIDDEN[package])
    ]
    assert not offences, "\n".join(offences)


def test_the_installed_packages_are_the_layered_ones_and_leave_the_probes_out() -> None:
    """pyproject.toml ships exactly the packages held above as installed; research/ is not
    among them, so a wheel carries no probe."""
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    patterns = found["find"]["include"]
    shipped = {pattern.removesuffix("*") for pattern in patterns}
    assert shipped == INSTALLED
    assert not any(fnmatch("research", pattern) for pattern in patterns)
    assert (ROOT / "research" / "__init__.py").exists()


def test_the_rule_sees_lazy_imports(tmp_path: Path) -> None:
    """An import inside a function counts, and `from a.b import c` names a, a.b and a.b.c."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from worker.service import run\n")
    assert {"worker", "worker.service", "worker.service.run"} <= imported_modules(module)


# The gateway's rooms, top down: http (the app) → batch → serving (the request path) → openai
# (the shapes). gateway.app_state is the app's key to the shared state, for route modules only.
GATEWAY_ROOMS: dict[str, set[str]] = {
    "openai": {"gateway.serving", "gateway.batch", "gateway.http", "gateway.app_state", "redis"},
    "serving": {"gateway.batch", "gateway.http", "gateway.app_state"},
    "batch": {"gateway.http"},
    "http": set(),
}


@pytest.mark.parametrize("room", sorted(GATEWAY_ROOMS))
def test_gateway_rooms_import_nothing_above_them(room: str) -> None:
    """Each room of the gateway imports none of the rooms above it."""
    files = sorted((ROOT / "gateway" / room).rglob("*.py"))
    assert files, f"no modules found under gateway/{room}/"
    offences = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files
        for name in sorted(imported_modules(path) & GATEWAY_ROOMS[room])
    ]
    assert not offences, "\n".join(offences)


def test_every_gateway_module_is_in_a_room() -> None:
    """Beside the rooms, gateway/ holds only its config and the app's shared-state key."""
    loose = {path.name for path in (ROOT / "gateway").glob("*.py")}
    assert loose == {"__init__.py", "config.py", "app_state.py"}
    rooms = {path.name for path in (ROOT / "gateway").iterdir() if (path / "__init__.py").exists()}
    assert rooms == set(GATEWAY_ROOMS)


def _key_pattern() -> re.Pattern[str]:
    """A key of the protocol as it would be spelled: `<tag>:<name>` for every name Keys has."""
    keys = Keys("PFX")
    names = set()
    for attr in dir(Keys):
        value = getattr(keys, attr)
        key = value("X") if callable(value) and not attr.startswith("_") else value
        if isinstance(key, str) and key.startswith(f"{keys.tag}:"):
            names.add(key.split(":")[1])
    assert {"requests", "replies", "cancels", "workers"} <= names
    return re.compile(r":(" + "|".join(sorted(names)) + r")(:|$)")


def _spelled_strings(path: Path) -> list[tuple[int, str]]:
    """String constants of a module, docstrings left out (prose may name a key)."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    return sorted(
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if id(node) not in docstrings
    )


def spelled_keys(path: Path) -> list[tuple[int, str]]:
    pattern = _key_pattern()
    return [(line, text) for line, text in _spelled_strings(path) if pattern.search(text)]


def test_only_the_wire_layer_spells_a_redis_key() -> None:
    """Key names come from protocol.Keys; no other module (tests included) writes one out."""
    # test_protocol checks the spelling itself; this file holds an example that must be caught.
    exempt = {ROOT / "tests" / "test_protocol.py", Path(__file__).resolve()}
    offences = [
        f"{path.relative_to(ROOT)}:{line}: {text!r}"
        for package in CODE
        for path in sorted((ROOT / package).rglob("*.py"))
        if path not in exempt
        for line, text in spelled_keys(path)
    ]
    assert not offences, "\n".join(offences)


def test_the_key_rule_sees_f_strings_and_plain_strings(tmp_path: Path) -> None:
    """A key built in an f-string or written out is caught; prose in a docstring is not."""
    module = tmp_path / "m.py"
    module.write_text(
        '"""Reads `{p}:requests`."""\n'
        'def f(p, g):\n    return f"{p}:replies:{g}", "jitney:workers", "a: requests"\n'
    )
    assert [text for _, text in spelled_keys(module)] == [":replies:", "jitney:workers"]


# A Lua script is a string that calls redis; a stream script is one naming a stream command.
LUA_CALL = re.compile(r"\bredis\.p?call\b")
STREAM_COMMAND = re.compile(
    r"""['"]x(ack|add|autoclaim|claim|del|group|info|len|pending|range|read|readgroup|revrange"""
    r"""|setid|trim)[a-z]*['"]""",
    re.IGNORECASE,
)
QUEUE_MODULE = ROOT / "protocol" / "queue"


def spelled_stream_scripts(path: Path) -> list[tuple[int, str]]:
    """(line, stream command) of each Lua script in `path` that names a stream command."""
    return [
        (line, STREAM_COMMAND.search(text).group(0))  # type: ignore[union-attr]
        for line, text in _spelled_strings(path)
        if LUA_CALL.search(text) and STREAM_COMMAND.search(text)
    ]


def test_only_the_queue_module_spells_a_stream_script() -> None:
    """Every Lua script that touches a stream (enqueue, the backlog reading, the DRR read,
    publish/ack/refund) is protocol/queue's, which both ends import; other scripts (rate
    limits, batch state) touch no stream and stay beside the one module that owns their keys."""
    offences = [
        f"{path.relative_to(ROOT)}:{line}: a script calling {command}"
        for package in [*CODE, "protocol"]
        for path in sorted((ROOT / package).rglob("*.py"))
        if QUEUE_MODULE not in path.parents and path != Path(__file__).resolve()
        for line, command in spelled_stream_scripts(path)
    ]
    assert not offences, "\n".join(offences)
    assert spelled_stream_scripts(QUEUE_MODULE / "scripts.py"), "the queue's scripts not seen"


def test_the_stream_script_rule_sees_scripts_not_prose(tmp_path: Path) -> None:
    """A script calling a stream command is caught (any case, redis.call or pcall, in an
    f-string too); a docstring naming one, a script on other keys, or a Python XADD is not."""
    module = tmp_path / "m.py"
    module.write_text(
        '"""Calls redis.call(\'XADD\', ...)."""\n'
        "A = \"redis.call('XADD', KEYS[1], '*', 'v', ARGV[1])\"\n"
        "B = \"local ok, g = pcall(redis.call, 'xinfo', 'GROUPS', q)\"\n"
        "C = f\"redis.pcall('XACK', {'k'}, ARGV[1])\"\n"
        "D = \"redis.call('HSET', KEYS[1], 'x', 1)\"\n"
        "def f(r):\n    return r.xadd('s', {'v': 1})\n"
    )
    assert spelled_stream_scripts(module) == [(2, "'XADD'"), (3, "'xinfo'"), (4, "'XACK'")]


# What code outside the engine must not read of an engine: it reads `engine.view` instead.
ENGINE_INTERNALS = {"policy", "block_manager", "requests", "runner", "choices", "kv_cache"}


def engine_reach_ins(path: Path) -> list[tuple[int, str]]:
    """(line, `x.name`) of each read of an engine internal in `path`: an attribute in
    ENGINE_INTERNALS of something named like an engine (`engine`, `self.engine`, `big_engine`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute) or node.attr not in ENGINE_INTERNALS:
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
        if "engine" in name:
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_outside_the_engine_only_its_view_is_read() -> None:
    """The worker, the benchmarks and the command line read an engine through `Engine.view`
    (engine/engine_view.py), never its policy, block manager, choices or runner (tests may, to
    check invariants)."""
    offences = [
        f"{path.relative_to(ROOT)}:{line}: {read}"
        for package in ["worker", "bench", "research", "jitney", "gateway"]
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, read in engine_reach_ins(path)
    ]
    assert not offences, "\n".join(offences)


def test_the_view_rule_sees_an_engine_by_its_name(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "def f(self, engine, args):\n"
        "    engine.policy.waiting, self.engine.block_manager, args.policy, engine.view.kv_usage\n"
    )
    assert engine_reach_ins(module) == [(2, "engine.policy"), (2, "self.engine.block_manager")]
