"""docs/structure.md lists every module `pip install` ships, and no module that is gone.

The shipped modules are found as setuptools finds them: pyproject.toml's
`[tool.setuptools.packages.find]` (`where`, `include`, `exclude`, `namespaces`) handed to
setuptools' own finder (the namespace finder unless `namespaces = false`, setuptools' default
for a pyproject.toml), or an explicit `packages` list; every `*.py` directly inside each package
found is a module of the wheel. A module is listed when a list item of the page starts with its
path from the repository root in backticks: "- `engine/kernels/ops.py` — what it holds".
"""

from __future__ import annotations

import collections
import re
import tomllib
from pathlib import Path

import setuptools

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "structure.md"

# A list item ("-" or "*", at any depth) whose first thing is a backticked path to a .py file.
MODULE_ITEM = re.compile(r"^[ \t]*[-*][ \t]+`([^`\s]+\.py)`", re.MULTILINE)


def listed_modules(text: str) -> list[str]:
    """The module paths the page lists, one per list item, in the page's order."""
    return MODULE_ITEM.findall(text)


def shipped_packages(root: Path) -> list[tuple[Path, str]]:
    """(where, package) for every package the project's setuptools configuration ships."""
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = tool["packages"]
    if isinstance(packages, list):  # `packages = [...]`: named one by one
        return [(root, name) for name in packages]
    find = packages["find"]
    finder = (
        setuptools.find_namespace_packages
        if find.get("namespaces", True)
        else setuptools.find_packages
    )
    return [
        (root / where, name)
        for where in find.get("where", ["."])
        for name in finder(
            where=str(root / where),
            include=find.get("include", ["*"]),
            exclude=find.get("exclude", []),
        )
    ]


def shipped_modules(root: Path = ROOT) -> set[str]:
    """Every .py file the wheel holds, as a path from the repository root."""
    return {
        module.relative_to(root).as_posix()
        for where, package in shipped_packages(root)
        for module in (where / package.replace(".", "/")).glob("*.py")
    }


def test_the_finder_sees_every_included_package() -> None:
    """Each `include` pattern of pyproject.toml yields modules: a finder that saw none (a
    namespace package read as no package) would let every other test here pass."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    shipped = shipped_modules()
    assert "engine/llm_engine.py" in shipped  # a namespace package's module
    for pattern in find["find"]["include"]:
        top = pattern.rstrip("*").rstrip(".")
        assert any(m.startswith(f"{top}/") for m in shipped), f"no module found for {pattern}"


def test_every_shipped_module_is_on_the_page() -> None:
    """A module the wheel ships has its line in docs/structure.md."""
    missing = sorted(shipped_modules() - set(listed_modules(PAGE.read_text())))
    assert not missing, (
        "docs/structure.md has no line for these modules; add one each, as a list item "
        "starting with the path in backticks:\n" + "\n".join(missing)
    )


def test_every_module_on_the_page_exists() -> None:
    """A listed module is a file in the repository: a moved or deleted one fails here."""
    gone = [path for path in listed_modules(PAGE.read_text()) if not (ROOT / path).is_file()]
    assert not gone, "docs/structure.md lists modules that are gone:\n" + "\n".join(gone)


def test_each_module_is_listed_once() -> None:
    twice = [
        path for path, n in collections.Counter(listed_modules(PAGE.read_text())).items() if n > 1
    ]
    assert not twice, "docs/structure.md lists these modules more than once:\n" + "\n".join(twice)


def test_the_parser_reads_module_items_only() -> None:
    """A module counts where a list item starts with it: nested items too, the first path of an
    item only; prose, a folder's item and a path later in an item do not."""
    text = (
        "Prose naming `gateway/config.py` is no line.\n"
        "- `scheduler/plan.py` — `StepPlan`; see `scheduler/config.py`.\n"
        "  - `protocol/queue/entry.py` — nested.\n"
        "* `bench/gpu_check.py`, `bench/gpu_check.sh` — two paths.\n"
        "- `engine/kernels/csrc/` — a folder.\n"
        "-`worker/lease.py` — no space after the dash.\n"
    )
    assert listed_modules(text) == [
        "scheduler/plan.py",
        "protocol/queue/entry.py",
        "bench/gpu_check.py",
    ]


def test_a_package_on_disk_is_found_as_setuptools_finds_it(tmp_path: Path) -> None:
    """The finder follows pyproject.toml: included packages (with or without __init__.py) ship
    their modules; an excluded package, an unincluded folder and a nested folder's files
    directly do not count as the parent's."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools.packages.find]\ninclude = ["app*"]\nexclude = ["app.probes*"]\n'
    )
    for path in ("app/__init__.py", "app/core.py", "app/sub/deep.py", "app/probes/p.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_app.py").write_text("")
    assert shipped_modules(tmp_path) == {"app/__init__.py", "app/core.py", "app/sub/deep.py"}
