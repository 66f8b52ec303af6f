"""Lazy build of the CUDA C++ extensions in csrc/ with torch.utils.cpp_extension.

Each extension is compiled once into a cache directory ($REPRO_CACHE_DIR, default
~/.cache/repro) keyed by torch and CUDA versions, in a folder named by a hash of the sources
(every file in csrc/ and this file): trees whose sources differ (a bisect's commits, `repro
checkout`'s buggy and fixed trees) never load each other's builds, trees whose sources agree
share one. A finished build is imported directly: importing torch.utils.cpp_extension costs a
scenario child about a second and queries CUDA, which a fork server must never do.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

CSRC = Path(__file__).resolve().parent.parent / "csrc"
EXTENSIONS: dict[str, tuple[str, ...]] = {
    "moe_lora_align": ("moe_lora_align.cu", "moe_lora_align_bindings.cpp"),
    "cumem_allocator": ("cumem_allocator.cpp", "cumem_allocator_bindings.cpp"),
}
DRIVER_API = {"cumem_allocator"}  # link libcuda (the driver's virtual memory API)


class BuildError(RuntimeError):
    """An extension failed to build: the tree cannot be tested here (not a failure of it)."""


class BuildUnavailable(BuildError):
    """The extension cannot be built here (no CUDA torch, no nvcc)."""


def cache_dir(torch_version: str | None = None, cuda_version: str | None = None) -> Path:
    """Where builds for this torch live; the versions of the imported torch by default."""
    if torch_version is None:
        import torch

        torch_version, cuda_version = torch.__version__, torch.version.cuda
    return cache_root() / f"torch-{torch_version}-cuda-{cuda_version}"


def cache_root() -> Path:
    """The project's cache: $REPRO_CACHE_DIR, else ~/.cache/repro."""
    return Path(os.environ.get("REPRO_CACHE_DIR", Path.home() / ".cache" / "repro"))


def all_fresh(torch_version: str, cuda_version: str | None) -> bool:
    """Whether every extension has a fresh build for these versions (no torch import: the
    CLI asks this to skip its build child)."""
    return all(_fresh_build(name, cache_dir(torch_version, cuda_version)) for name in EXTENSIONS)


def _arch_list() -> str | None:
    """Compute capability from nvidia-smi, so that building never initializes CUDA."""
    if "TORCH_CUDA_ARCH_LIST" in os.environ or not shutil.which("nvidia-smi"):
        return os.environ.get("TORCH_CUDA_ARCH_LIST")
    query = ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]
    caps = subprocess.run(query, capture_output=True, text=True, check=False).stdout.split()
    return ";".join(sorted(set(caps))) or None


@functools.cache
def _build_folder(name: str) -> str:
    """`name` and a hash of the sources every extension is built from."""
    digest = hashlib.sha256()
    for path in sorted([*CSRC.iterdir(), Path(__file__)]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{name}-{digest.hexdigest()[:16]}"


def _fresh_build(name: str, directory: Path | None = None) -> Path | None:
    """The built library of `name` for these sources if no build of it is under way: torch's
    build holds a `lock` file in the build directory while it compiles and links, and a
    library being linked there can look finished but be cut short ("file too short", seen when
    several test workers built it at once); such a caller goes through torch's build, which
    waits for the lock."""
    build = (directory or cache_dir()) / _build_folder(name)
    built = build / f"repro_{name}.so"
    if (build / "lock").exists() or not built.exists():
        return None
    return built


def _import_library(path: Path, module_name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load(name: str, verbose: bool = False) -> ModuleType:
    """Build (first time) and import extension `name`."""
    import torch

    built = _fresh_build(name)
    if built is not None:
        return _import_library(built, f"repro_{name}")
    from torch.utils import cpp_extension

    if torch.version.cuda is None or cpp_extension.CUDA_HOME is None:
        raise BuildUnavailable(
            f"cannot build {name}: torch {torch.__version__} has no CUDA "
            f"or nvcc was not found (CUDA_HOME={cpp_extension.CUDA_HOME})"
        )
    arch = _arch_list()
    if arch:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    build = cache_dir() / _build_folder(name)
    build.mkdir(parents=True, exist_ok=True)
    stubs = Path(cpp_extension.CUDA_HOME) / "lib64" / "stubs"
    driver = [f"-L{stubs}", "-lcuda"] if name in DRIVER_API else []
    try:
        module = cpp_extension.load(
            name=f"repro_{name}",
            sources=[str(CSRC / s) for s in EXTENSIONS[name]],
            extra_include_paths=[str(CSRC)],
            extra_cflags=["-O2"],
            extra_cuda_cflags=["-O2", "-lineinfo"],
            extra_ldflags=driver,
            with_cuda=True,
            build_directory=str(build),
            verbose=verbose,
        )
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        raise BuildError(f"building csrc extension {name} failed: {e}") from e
    return module
