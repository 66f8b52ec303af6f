"""The csrc build cache, as the CLI sees it without importing torch."""

from __future__ import annotations

from kernels import csrc


def test_builds_are_found_by_the_hash_of_their_sources(monkeypatch, tmp_path) -> None:
    """A build is used only by trees of the same sources: a checkout or a bisect step whose
    csrc/ differs builds (and loads) its own, never another tree's library."""
    monkeypatch.setenv("REPRO_CACHE_DIR", str(tmp_path))
    assert not csrc.all_fresh("9.9.9", "99.0"), "nothing is built yet"
    directory = csrc.cache_dir("9.9.9", "99.0")
    for name in csrc.EXTENSIONS:
        built = directory / csrc._build_folder(name) / f"repro_{name}.so"
        built.parent.mkdir(parents=True)
        built.touch()
    assert csrc.all_fresh("9.9.9", "99.0")
    assert not csrc.all_fresh("9.9.8", "99.0"), "another torch, another build"
    first = next(iter(csrc.EXTENSIONS))
    (directory / csrc._build_folder(first) / "lock").touch()  # torch's build is under way
    assert not csrc.all_fresh("9.9.9", "99.0"), "a build under way is not fresh"
    (directory / csrc._build_folder(first) / "lock").unlink()
    other = tmp_path / "tree"  # the same sources but one edited line (a folded switch)
    (other / "csrc").mkdir(parents=True)
    for path in csrc.CSRC.iterdir():
        (other / "csrc" / path.name).write_bytes(path.read_bytes())
    edited = other / "csrc" / "moe_lora_align.cu"
    edited.write_text(edited.read_text() + "\n// edited\n")
    monkeypatch.setattr(csrc, "CSRC", other / "csrc")
    csrc._build_folder.cache_clear()
    try:
        assert not csrc.all_fresh("9.9.9", "99.0"), "other sources, another build"
    finally:
        csrc._build_folder.cache_clear()


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
