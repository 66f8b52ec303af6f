"""A bytecode cache for the project's own modules, where Python writes none.

With PYTHONDONTWRITEBYTECODE set or `python -B` (usual in containers; set on the machines this
project is measured on), Python compiles every module it imports from source, every time. A
scenario runs in a fresh child that imports the project from its tree, so each child compiled
again the 80-odd modules it imports: 0.15-0.22 s a child on an H200 machine (cProfile of a
child's first run), paid by every scenario of every check and matrix, and by the client.

`install()` (harness/__init__.py: the first import of harness in the client, the fork server and
every child) puts a finder first on sys.meta_path for the project's packages (PACKAGES) that
keeps each source file's code under the user's cache (`$REPRO_CACHE_DIR`, else
~/.cache/repro: bytecode/<interpreter>-<optimization>/), never in the tree:
- keyed by a hash of the file's bytes, not its timestamp: an edit is never served stale (one
  within the same second that keeps the size included), and a tree that holds the same file
  (a bisect's checkout, `repro checkout`'s trees) shares its entry; a mutant's copy has a cache
  of its own (repro.mutants sets REPRO_CACHE_DIR);
- the code's file names are set to the file imported, so tracebacks (and harness.child's
  `origin`, which reads them) name that tree's file;
- written atomically; an entry that cannot be read or written is compiled as Python would.
Third-party modules are left to Python (their installed bytecode). Where Python writes bytecode
itself, or with REPRO_BYTECODE_CACHE=0, `install()` does nothing. Standard library only.
"""

from __future__ import annotations

import _imp
import contextlib
import hashlib
import importlib.machinery
import marshal
import os
import sys
from pathlib import Path

PACKAGES = frozenset({"harness", "kernels", "repro"})  # not tests: pytest rewrites their asserts
ENV_SWITCH = "REPRO_BYTECODE_CACHE"  # "0": off


def directory() -> Path:
    # the root is kernels.csrc.cache_dir's (not imported here: it would be compiled uncached)
    root = Path(os.environ.get("REPRO_CACHE_DIR", Path.home() / ".cache" / "repro"))
    return root / "bytecode" / f"{sys.implementation.cache_tag}-O{sys.flags.optimize}"


class _Loader(importlib.machinery.SourceFileLoader):
    """A project source file's loader that reads its code from the cache when it is there."""

    def __init__(self, fullname: str, path: str, where: Path) -> None:
        super().__init__(fullname, path)
        self.where = where

    def get_code(self, fullname: str):
        path = self.get_filename(fullname)
        source = self.get_data(path)
        entry = self.where / f"{hashlib.sha256(source).hexdigest()[:40]}.code"
        try:
            code = marshal.loads(entry.read_bytes())
            _imp._fix_co_filename(code, path)  # as importlib does for a moved .pyc
            return code
        except (OSError, EOFError, ValueError, TypeError):
            pass
        code = self.source_to_code(source, path)
        temporary = entry.with_name(f"{entry.name}.{os.getpid()}")
        try:
            self.where.mkdir(parents=True, exist_ok=True)
            temporary.write_bytes(marshal.dumps(code))
            temporary.replace(entry)
        except OSError:  # not writable, or not a directory: compiled each time
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)
        return code


class _Finder:
    """First on sys.meta_path: the project's modules, found where Python's own path finder
    finds them, loaded through the cache."""

    repro_bytecode = True  # a child inherits the server's finder: install() looks for this

    def __init__(self, where: Path) -> None:
        self.where = where

    def find_spec(self, name: str, path=None, target=None):
        if name.partition(".")[0] not in PACKAGES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader:
            spec.loader = _Loader(spec.loader.name, spec.loader.path, self.where)
        return spec

    def invalidate_caches(self) -> None:
        pass


def install() -> None:
    """The cache, where Python writes no bytecode (idempotent)."""
    if not sys.dont_write_bytecode or os.environ.get(ENV_SWITCH) == "0":
        return
    if any(getattr(f, "repro_bytecode", False) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder(directory()))
