"""The architecture points one way (kernels <- harness <- repro <- tests), the runner holds no
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
    "repro/matrix.py",
    "repro/mutants.py",
    "repro/serve.py",
    "repro/bench.py",
    "repro/report.py",
    "repro/results.py",
    "repro/registry.py",
    "harness/isolate.py",
    "harness/servers.py",
    "harness/userdir.py",
    "harness/child.py",
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


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependencies_point_down(package: str) -> None:
    for path in project_files(package):
        bad = {m for m in imports(path) if m.split(".")[0] in FORBIDDEN[package]}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


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
    for path in sorted(ROOT.glob("repro/*/__init__.py")):
        bad = {m for m in imports(path) if m.split(".")[0] in {"torch", "triton", "kernels"}}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
