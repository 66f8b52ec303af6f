"""The csrc build cache, as the CLI sees it without importing torch."""

from __future__ import annotations

import os

from kernels import csrc


def test_builds_are_fresh_only_when_newer_than_every_input(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("REPRO_CACHE_DIR", str(tmp_path))
    assert not csrc.all_fresh("9.9.9", "99.0"), "nothing is built yet"
    directory = csrc.cache_dir("9.9.9", "99.0")
    newest = max(p.stat().st_mtime for p in [*csrc.CSRC.iterdir(), csrc.Path(csrc.__file__)])
    for name in csrc.EXTENSIONS:
        built = directory / name / f"repro_{name}.so"
        built.parent.mkdir(parents=True)
        built.touch()
        os.utime(built, (newest + 10, newest + 10))
    assert csrc.all_fresh("9.9.9", "99.0")
    assert not csrc.all_fresh("9.9.8", "99.0"), "another torch, another build"
    stale = newest - 10  # older than the newest input, whatever the checkout's mtimes
    first = directory / next(iter(csrc.EXTENSIONS))
    os.utime(next(first.iterdir()), (stale, stale))
    assert not csrc.all_fresh("9.9.9", "99.0"), "an input newer than a build makes it stale"
