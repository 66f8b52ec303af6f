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
    os.utime(next(first.iterdir()), (newest + 10, newest + 10))
    assert csrc.all_fresh("9.9.9", "99.0")
    (first / "lock").touch()  # torch's build of it is under way: the library may be cut short
    assert not csrc.all_fresh("9.9.9", "99.0"), "a build under way is not fresh"


def test_the_cli_names_the_cache_the_children_build_in() -> None:
    """The CLI reads torch's versions without importing torch; a child names its cache after
    the imported torch. They must agree, or every check runs a build child it does not need
    (a torch whose package metadata lacks the local part, 2.11.0 for 2.11.0+cu130, did)."""
    import torch

    from harness import device as devices

    assert devices.torch_version() == torch.__version__
    assert devices.torch_cuda_version() == torch.version.cuda
    without_torch = csrc.cache_dir(devices.torch_version(), devices.torch_cuda_version())
    assert without_torch == csrc.cache_dir()
