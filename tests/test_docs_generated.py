"""Figures in the guide are generated, never typed: every block of README.md and docs/**.md
between `<!-- generated: repro ARGS -->` and `<!-- end generated -->` is what `repro ARGS`
prints now (a table of a committed bench file, say)."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest

from tests import procs

BLOCK = re.compile(r"<!-- generated: repro (.+?) -->\n(.*?)<!-- end generated -->", re.DOTALL)
PAGES = [procs.ROOT / "README.md", *sorted((procs.ROOT / "docs").rglob("*.md"))]
BLOCKS = [
    (page.relative_to(procs.ROOT).as_posix(), args, text)
    for page in PAGES
    for args, text in BLOCK.findall(page.read_text())
]


def test_the_speed_page_has_a_generated_speed_table() -> None:
    speed = "docs/measurements/speed.md"
    assert any("bench --table" in args for page, args, _ in BLOCKS if page == speed)


@pytest.mark.parametrize(("page", "args", "text"), BLOCKS, ids=[f"{p}:{a}" for p, a, _ in BLOCKS])
def test_a_generated_block_is_what_its_command_prints(page, args, text) -> None:
    done = subprocess.run(
        procs.repro_command(*shlex.split(args)), capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert text == done.stdout, f"{page}: regenerate with `repro {args}`"
