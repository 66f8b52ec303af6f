"""Device selection: cpu (Triton's interpreter), cuda, or auto; and GPU pinning for xdist workers.

Nothing here imports torch at module level: the interpreter switch and CUDA_VISIBLE_DEVICES
must be set before torch initializes CUDA and before any kernel module is imported.
"""

from __future__ import annotations

import os
import shutil
import subprocess

DEVICES = ("cpu", "cuda")
CHOICES = ("cpu", "cuda", "auto")
ENV_DEVICE = "REPRO_DEVICE"


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve(requested: str | None) -> str:
    """cpu or cuda from cpu|cuda|auto (default: $REPRO_DEVICE, else auto)."""
    requested = requested or os.environ.get(ENV_DEVICE) or "auto"
    if requested not in CHOICES:
        raise ValueError(f"device must be one of {', '.join(CHOICES)}, got {requested!r}")
    if requested == "auto":
        return "cuda" if cuda_available() else "cpu"
    return requested


def activate(device: str) -> None:
    """Set the Triton interpreter switch for `device`; call before importing kernels."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)


def visible_gpus() -> list[str]:
    """The caller's visible GPU list, read without initializing CUDA."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d for d in listed.split(",") if d.strip()]
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


def pin_xdist_worker(worker: str | None) -> str | None:
    """Give xdist worker gwN one GPU of the caller's list (round robin); returns the choice."""
    if not worker or not worker.startswith("gw"):
        return None
    gpus = visible_gpus()
    if not gpus:
        return None
    choice = gpus[int(worker[2:]) % len(gpus)]
    os.environ["CUDA_VISIBLE_DEVICES"] = choice
    return choice
