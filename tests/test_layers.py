"""The package layers: no import runs back up, and the pure parts stay pure.

Layers, top down: `jitney/` → `bench/`, `worker/` → `engine/`, `gateway/` → `scheduler/`,
`protocol/`. Every import statement counts, lazy ones inside functions too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from protocol import Keys

ROOT = Path(__file__).resolve().parents[1]

# package -> top-level modules it must never import
FORBIDDEN: dict[str, set[str]] = {
    "scheduler": {"torch", "redis", "aiohttp", "transformers", "protocol", "engine", "worker"}
    | {"gateway", "bench", "jitney"},
    "protocol": {"torch", "engine", "worker", "gateway", "bench", "jitney", "scheduler"},
    "engine": {"redis", "aiohttp", "protocol.keys", "protocol.redis_client", "worker"}
    | {"gateway", "bench", "jitney"},
    "worker": {"gateway", "bench", "jitney", "aiohttp"},
    "gateway": {"torch", "engine", "worker", "bench", "jitney"},
    "bench": {"jitney"},
}


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


def test_the_rule_sees_lazy_imports(tmp_path: Path) -> None:
    """An import inside a function counts, and `from a.b import c` names a, a.b and a.b.c."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from worker.service import run\n")
    assert {"worker", "worker.service", "worker.service.run"} <= imported_modules(module)


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
    packages = ["scheduler", "engine", "worker", "gateway", "bench", "jitney", "tests"]
    # test_protocol checks the spelling itself; this file holds an example that must be caught.
    exempt = {ROOT / "tests" / "test_protocol.py", Path(__file__).resolve()}
    offences = [
        f"{path.relative_to(ROOT)}:{line}: {text!r}"
        for package in packages
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
