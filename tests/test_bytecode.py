"""The project's bytecode cache (harness.bytecode), where Python writes no bytecode: an edit is
never served stale, a copy of the tree names its own files, and the cache is used."""

from __future__ import annotations

import json
import marshal
import os
import subprocess
import sys
import textwrap

import pytest

from tests import procs

# A child that imports a stand-in `kernels` package from TREE (first on sys.path) through the
# cache, as a scenario child imports the project from its request's tree, and says what it saw.
PROBE = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import harness  # the cache's finder (harness/__init__.py)
    sys.path.insert(0, sys.argv[2])
    for name in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:
        del sys.modules[name]
    import kernels.probe as probe
    print(json.dumps({"value": probe.VALUE, "file": probe.where.__code__.co_filename,
                      "module": probe.__file__}))
    """
)


PLANTED = "VALUE = 7\n\n\ndef where():\n    return VALUE\n"


def probe(tree, cache, **env: str) -> dict:
    environ = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "REPRO_CACHE_DIR": str(cache), **env}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(procs.ROOT), str(tree)],
        capture_output=True,
        text=True,
        env=environ,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def tree_with(path, value: int):
    (path / "kernels").mkdir(parents=True, exist_ok=True)
    (path / "kernels" / "__init__.py").write_text("")
    source = path / "kernels" / "probe.py"
    source.write_text(f"VALUE = {value}\n\n\ndef where():\n    return VALUE\n")
    os.utime(source, ns=(10**18, 10**18))  # one timestamp for every edit
    return source


def entries(cache) -> list:
    return sorted(cache.rglob("*.code"))


def test_an_edit_is_never_served_stale_even_with_its_size_and_timestamp(tmp_path) -> None:
    cache = tmp_path / "cache"
    tree_with(tmp_path / "a", 1)
    assert probe(tmp_path / "a", cache)["value"] == 1
    before = entries(cache)
    assert before, "nothing was cached"
    for entry in before:  # what is read back is the cache's: planted, it is what runs
        if b"VALUE" in entry.read_bytes():
            entry.write_bytes(marshal.dumps(compile(PLANTED, "planted", "exec")))
    assert probe(tmp_path / "a", cache)["value"] == 7
    assert entries(cache) == before
    tree_with(tmp_path / "a", 2)  # same size, same timestamp: Python's own .pyc would miss it
    assert probe(tmp_path / "a", cache)["value"] == 2


def test_a_copy_of_the_tree_names_its_own_files(tmp_path) -> None:
    """A bisect's or a mutant's copy shares the entries of identical files, and its tracebacks
    (harness.child.origin reads them) still name the copy's file."""
    cache = tmp_path / "cache"
    first, second = tree_with(tmp_path / "a", 1), tree_with(tmp_path / "b", 1)
    assert probe(tmp_path / "a", cache)["file"] == str(first)
    count = len(entries(cache))
    seen = probe(tmp_path / "b", cache)
    assert seen["file"] == seen["module"] == str(second)
    assert len(entries(cache)) == count


@pytest.mark.parametrize(
    "env",
    [{"REPRO_BYTECODE_CACHE": "0"}, {"PYTHONDONTWRITEBYTECODE": ""}],
    ids=["off", "python writes its own"],
)
def test_no_cache_where_python_writes_bytecode_or_it_is_switched_off(tmp_path, env) -> None:
    tree_with(tmp_path / "a", 1)
    probe(tmp_path / "a", tmp_path / "cache", PYTHONPYCACHEPREFIX=str(tmp_path / "pyc"), **env)
    assert not (tmp_path / "cache").exists()
