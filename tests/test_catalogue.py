"""docs/catalogue.md is generated from the records: it is exactly what `repro list --markdown`
prints now, one table row per registered bug."""

from __future__ import annotations

import subprocess

from repro.registry import BUGS
from tests import procs

PAGE = procs.ROOT / "docs" / "catalogue.md"


def _printed() -> str:
    done = subprocess.run(
        procs.repro_command("list", "--markdown"), capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_catalogue_page_is_what_repro_list_markdown_prints() -> None:
    assert PAGE.read_text() == _printed(), (
        "docs/catalogue.md is stale: regenerate it with `repro list --markdown > docs/catalogue.md`"
    )


def test_the_catalogue_has_a_title_and_one_row_per_bug() -> None:
    lines = _printed().splitlines()
    assert lines[0].startswith("# ")
    rows = [line for line in lines if line.startswith("| `")]
    assert [row.split(" | ")[0].strip("| `") for row in rows] == [bug.id for bug in BUGS]
    for row, bug in zip(rows, BUGS, strict=True):
        assert f"]({bug.upstream})" in row and f" | {len(bug.scenarios)} | " in row, row
        assert row.split(" | ")[-1].startswith(bug.fidelity.grade), row  # the grade, last
