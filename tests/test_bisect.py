"""`git bisect run repro check` on synthetic histories of this tree: the installed command names
the commit that brought the bug back, skips commits it cannot test, and says 125 for a tree that
does not import."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import ROOT, installed_repro

# the same on a GPU machine (every run is --device cpu): the CPU job runs them
pytestmark = pytest.mark.cpu_job

GRID_FIX = "num_slots = max_loras + 1 if fixes.grid_plus_one else max_loras"
ID_ZERO = "        if lora_id == 0:\n            return -1\n"
GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
    "GIT_CONFIG_NOSYSTEM": "1",
}


class Repo:
    """A git repository made from this working tree (tracked and untracked, not ignored)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        listed = self.git("ls-files", "-co", "--exclude-standard", cwd=ROOT).split("\n")
        for name in filter(None, listed):
            if (ROOT / name).is_file():
                (path / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, path / name)
        self.git("init", "-q")
        self.commit("A: good")

    def git(self, *args: str, cwd: Path | None = None, env: dict | None = None) -> str:
        done = subprocess.run(
            ["git", *args],
            cwd=cwd or self.path,
            env={**os.environ, **GIT_ENV, **(env or {})},
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode not in (0, 1) or (done.returncode == 1 and args[0] != "bisect"):
            raise AssertionError(f"git {' '.join(args)}: {done.stdout}{done.stderr}")
        return done.stdout + done.stderr

    def edit(self, name: str, old: str, new: str) -> None:
        path = self.path / name
        text = path.read_text()
        assert old in text, f"{old!r} not in {name}"
        path.write_text(text.replace(old, new, 1))

    def commit(self, message: str) -> str:
        self.git("add", "-A")
        self.git("commit", "-qm", message)
        return self.git("rev-parse", "HEAD").strip()

    def bisect(self, bad: str, good: str, *check: str) -> str:
        """`git bisect run` with the installed `repro check`, running this repository's tree."""
        script = installed_repro()
        self.git("bisect", "start", bad, good)
        try:
            return self.git(
                "bisect", "run", script, "check", *check, env={"PYTHONPATH": str(self.path)}
            )
        finally:
            self.git("bisect", "reset")


def first_bad(log: str) -> str | None:
    found = re.search(r"^([0-9a-f]{40}) is the first bad commit", log, re.MULTILINE)
    return found.group(1) if found else None


def repro(repo: Repo, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "repro", *argv],
        cwd=repo.path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def syntax_history(tmp_path_factory) -> tuple[Repo, dict[str, str]]:
    """A good; B breaks an unrelated kernel's syntax; C removes a fix; D repairs B; E harmless."""
    repo = Repo(tmp_path_factory.mktemp("syntax"))
    shas = {"A": repo.git("rev-parse", "HEAD").strip()}
    attention = (repo.path / "kernels" / "paged_attention.py").read_text()
    (repo.path / "kernels" / "paged_attention.py").write_text(attention + "\ndef broken(:\n")
    shas["B"] = repo.commit("B: a syntax error in an unrelated kernel")
    repo.edit("kernels/moe_lora_align.py", GRID_FIX, "num_slots = max_loras")
    shas["C"] = repo.commit("C: the align grid one slot short again")
    (repo.path / "kernels" / "paged_attention.py").write_text(attention)
    shas["D"] = repo.commit("D: repair B")
    repo.edit("README.md", "# gpu-repro", "# gpu-repro (a harmless change)")
    shas["E"] = repo.commit("E: harmless")
    return repo, shas


CHECK_GRID = ("moe_align_grid", "--device", "cpu", "--scenario", "last_slot_rows")


def test_the_broken_kernel_is_unrelated_to_the_bug() -> None:
    """The premise of the history: moe_align_grid's scenarios never import paged attention."""
    probe = (
        "import os, sys; os.environ['TRITON_INTERPRET'] = '1'; sys.path.insert(0, sys.argv[1]);"
        "import repro.bugs.moe_align_grid.scenarios;"
        "print('kernels.paged_attention' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe, str(ROOT)], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


@pytest.mark.moe_align_grid
@pytest.mark.parametrize("symptom", [(), ("--symptom",)], ids=["plain", "symptom"])
def test_bisect_names_the_fix_removal(syntax_history, symptom) -> None:
    repo, shas = syntax_history
    log = repo.bisect(shas["E"], shas["A"], *CHECK_GRID, *symptom)
    assert first_bad(log) == shas["C"], log


@pytest.mark.moe_align_grid
def test_a_tree_whose_bug_code_does_not_import_cannot_be_tested(tmp_path) -> None:
    broken = Repo(tmp_path)
    align = (broken.path / "kernels" / "moe_lora_align.py").read_text()
    (broken.path / "kernels" / "moe_lora_align.py").write_text(align + "\ndef broken(:\n")
    done = repro(broken, "check", *CHECK_GRID)
    assert done.returncode == 125, done.stdout + done.stderr
    assert "the project does not import: SyntaxError" in done.stdout


def test_a_tree_whose_records_do_not_import_cannot_be_tested(tmp_path) -> None:
    repo = Repo(tmp_path)
    record = repo.path / "repro" / "bugs" / "lora_dummy_run" / "__init__.py"
    record.write_text(record.read_text() + "\nimport no_such_module\n")
    done = repro(repo, "check", "moe_align_grid", "--device", "cpu")
    assert done.returncode == 125, done.stdout + done.stderr
    assert "repro: cannot test: the project does not import: ModuleNotFoundError" in done.stderr


@pytest.mark.lora_dummy_run
def test_bisect_names_a_regression_that_raises_in_the_code_under_test(tmp_path) -> None:
    """A good; B: convert_mapping no longer maps id 0 (a ValueError in the dummy run); C."""
    repo = Repo(tmp_path)
    good = repo.git("rev-parse", "HEAD").strip()
    repo.edit("harness/runner/lora.py", ID_ZERO, "")
    regression = repo.commit("B: convert_mapping looks id 0 up")
    repo.edit("README.md", "# gpu-repro", "# gpu-repro (a harmless change)")
    head = repo.commit("C: harmless")
    log = repo.bisect(head, good, "lora_dummy_run", "--device", "cpu")
    assert first_bad(log) == regression, log
    # Its documented symptom is a device-side assert: --symptom cannot call this commit bad.
    repo.git("checkout", "-q", regression)
    done = repro(repo, "check", "lora_dummy_run", "--device", "cpu", "--symptom")
    assert done.returncode == 125, done.stdout
    assert "exception, confirmed by a second run; not its documented symptom" in done.stdout
    assert "ValueError: LoRA id 0 is not active" in done.stdout
