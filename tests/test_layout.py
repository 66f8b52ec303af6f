"""The architecture points one way (kernels <- harness <- repro <- tests), no module imports
itself through others (no import cycle, counting imports inside functions), the runner holds no
test oracle, and what the CLI parent imports never needs torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package (path prefix) -> top-level project packages it must never import
FORBIDDEN = {
    "kernels": {"harness", "repro", "tests"},
    "harness": {"repro", "tests"},
    "repro": {"tests"},
}
# The code under test must not import oracles or scenarios.
RUNNER_FORBIDDEN = {
    "harness.oracle",
    "harness.reference",
    "harness.record",
    "harness.child",
    "harness.isolate",
    "harness.servers",
}
# What the CLI parent and the fork server import before any child: standard library only
# (plus each other), so that argument checks and verdicts never wait for torch.
LIGHT = [
    "repro/cli.py",
    "repro/commands.py",
    "repro/common.py",
    "repro/info.py",
    "repro/check.py",
    "repro/matrix.py",
    "repro/mutants.py",
    "repro/serve.py",
    "repro/bench.py",
    "repro/report.py",
    "repro/checkout.py",
    "repro/export.py",
    "repro/fold.py",
    "repro/results.py",
    "repro/registry.py",
    "harness/isolate.py",
    "harness/servers.py",
    "harness/userdir.py",
    "harness/child.py",
    "harness/ranks.py",
    "harness/forkserver.py",
    "harness/lifetime.py",
    "harness/device.py",
    "harness/fixes.py",
    "harness/outcome.py",
    "harness/record.py",
]
HEAVY = {"torch", "triton", "numpy", "kernels", "harness.runner", "harness.oracle"}


def imports(path: Path) -> set[str]:
    """Modules imported at module level (not inside functions, not under TYPE_CHECKING)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def project_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports anywhere (functions included), as module names:
    `from a.b import c` is a.b.c when that is a module, else a.b."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        found |= {n for n in names if n in modules}
    return found


def test_no_import_cycles() -> None:
    files = [p for package in FORBIDDEN for p in project_files(package)]
    modules = {module_name(p): p for p in files}
    graph = {name: all_imports(path, set(modules)) - {name} for name, path in modules.items()}
    state: dict[str, str] = {}  # "open" on the current path, "done" after

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                cycle = [*path[path.index(other) :], name, other]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if other not in state:
                visit(other, [*path, name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependencies_point_down(package: str) -> None:
    for path in project_files(package):
        bad = {m for m in imports(path) if m.split(".")[0] in FORBIDDEN[package]}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


# The border inside harness/: the code under test (harness/runner/, with kernels/) reads from the
# tool only its fix switches; the tool's process machinery never imports the code under test at
# module level (a child imports it after the fork, from the tree its request names).
UNDER_TEST = ("harness/runner", "kernels")
TOOL_FOR_UNDER_TEST = {"harness.fixes"}
MACHINERY = ["child", "isolate", "forkserver", "servers", "lifetime", "userdir", "device"]


@pytest.mark.parametrize("package", UNDER_TEST)
def test_the_code_under_test_reads_only_the_fix_switches_of_the_tool(package: str) -> None:
    modules = {module_name(p) for package in FORBIDDEN for p in project_files(package)}
    for path in project_files(package):
        tool = {
            m
            for m in all_imports(path, modules)
            if m.startswith("harness.") and not m.startswith("harness.runner")
        }
        bad = tool - TOOL_FOR_UNDER_TEST
        assert not bad, f"{path.relative_to(ROOT)} (code under test) imports the tool's {bad}"


@pytest.mark.parametrize("name", MACHINERY)
def test_the_process_machinery_holds_no_code_under_test(name: str) -> None:
    found = imports(ROOT / "harness" / f"{name}.py")
    bad = {m for m in found if m.split(".")[0] == "kernels" or m.startswith("harness.runner")}
    assert not bad, f"harness/{name}.py imports the code under test {sorted(bad)} at module level"


def test_the_catalogue_imports_nothing_of_the_tool() -> None:
    """repro/bugs/ (records, scenarios, mutants, entry points) imports repro.bugs only: no arrow
    climbs from the catalogue to the tool (`python -m repro.bugs.BUG` hands over by exec)."""
    modules = {module_name(p) for package in FORBIDDEN for p in project_files(package)}
    for path in project_files("repro/bugs"):
        tool = {m for m in all_imports(path, modules) if m.split(".")[0] == "repro"}
        bad = {m for m in tool if not m.startswith("repro.bugs")}
        assert not bad, f"{path.relative_to(ROOT)} imports the tool's {sorted(bad)}"


def test_the_runner_holds_no_oracle() -> None:
    for path in project_files("harness/runner"):
        bad = {m for m in imports(path) if any(m.startswith(f) for f in RUNNER_FORBIDDEN)}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("name", LIGHT)
def test_the_parent_side_imports_nothing_heavy(name: str) -> None:
    bad = {
        m
        for m in imports(ROOT / name)
        if any(m.split(".")[: len(h.split("."))] == h.split(".") for h in HEAVY)
    }
    assert not bad, f"{name} imports {sorted(bad)} at module level"


def test_records_import_nothing_heavy() -> None:
    records = sorted(ROOT.glob("repro/bugs/*/__init__.py"))
    assert len(records) >= 10
    for path in records:
        bad = {m for m in imports(path) if m.split(".")[0] in {"torch", "triton", "kernels"}}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
