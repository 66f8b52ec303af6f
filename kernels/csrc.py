"""Lazy build of the CUDA C++ extensions in csrc/ with torch.utils.cpp_extension.

Each extension is compiled once into a cache directory ($REPRO_CACHE_DIR, default
~/.cache/repro) keyed by torch and CUDA versions; torch's own source hashing rebuilds on change.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

CSRC = Path(__file__).resolve().parent.parent / "csrc"
EXTENSIONS: dict[str, tuple[str, ...]] = {
    "moe_lora_align": ("moe_lora_align.cu", "moe_lora_align_bindings.cpp"),
}


class BuildUnavailable(RuntimeError):
    """The extension cannot be built here (no CUDA torch, no nvcc)."""


def cache_dir() -> Path:
    import torch

    root = Path(os.environ.get("REPRO_CACHE_DIR", Path.home() / ".cache" / "repro"))
    return root / f"torch-{torch.__version__}-cuda-{torch.version.cuda}"


def _arch_list() -> str | None:
    """Compute capability from nvidia-smi, so that building never initializes CUDA."""
    if "TORCH_CUDA_ARCH_LIST" in os.environ or not shutil.which("nvidia-smi"):
        return os.environ.get("TORCH_CUDA_ARCH_LIST")
    query = ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]
    caps = subprocess.run(query, capture_output=True, text=True, check=False).stdout.split()
    return ";".join(sorted(set(caps))) or None


@functools.cache
def load(name: str, verbose: bool = False) -> ModuleType:
    """Build (first time) and import extension `name`."""
    import torch
    from torch.utils import cpp_extension

    if torch.version.cuda is None or cpp_extension.CUDA_HOME is None:
        raise BuildUnavailable(
            f"cannot build {name}: torch {torch.__version__} has no CUDA "
            f"or nvcc was not found (CUDA_HOME={cpp_extension.CUDA_HOME})"
        )
    arch = _arch_list()
    if arch:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    build = cache_dir() / name
    build.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=f"repro_{name}",
        sources=[str(CSRC / s) for s in EXTENSIONS[name]],
        extra_include_paths=[str(CSRC)],
        extra_cflags=["-O2"],
        extra_cuda_cflags=["-O2", "-lineinfo"],
        build_directory=str(build),
        verbose=verbose,
    )
