"""Device selection: cpu (Triton's interpreter), cuda, or auto; and GPU pinning for xdist workers.

Nothing here imports torch or initializes CUDA: the CLI decides what can run in milliseconds, the
interpreter switch and CUDA_VISIBLE_DEVICES must be set before torch initializes CUDA, and a
process that initialized CUDA cannot fork usable children. Whether CUDA really works is asked
by each scenario child (torch.cuda.is_available()), which skips when it does not.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

DEVICES = ("cpu", "cuda")
CHOICES = ("cpu", "cuda", "auto")
ENV_DEVICE = "REPRO_DEVICE"


def _torch_version_file() -> str:
    """torch/version.py of the installed torch ("" when there is none), read without importing."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return ""
    try:
        return (Path(spec.submodule_search_locations[0]) / "version.py").read_text()
    except OSError:
        return ""


def _version_field(name: str) -> str | None:
    found = re.search(
        rf"^{name}\b[^=]*=\s*['\"]([^'\"]+)['\"]", _torch_version_file(), re.MULTILINE
    )
    return found.group(1) if found else None


def torch_version() -> str | None:
    """torch.__version__ of the installed torch (with its local part, e.g. 2.11.0+cu130, which
    the package metadata may lack), without importing torch."""
    return _version_field("__version__")


def torch_cuda_version() -> str | None:
    """The CUDA version the installed torch was built with (None: a CPU build, or no torch),
    without importing torch."""
    return _version_field("cuda")


def _machine_gpus() -> list[str]:
    """Indices of the machine's NVIDIA GPUs, from the driver's files (no CUDA initialization)."""
    proc = Path("/proc/driver/nvidia/gpus")
    if proc.is_dir():
        return [str(i) for i in range(len(list(proc.iterdir())))]
    nodes = [p for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)]
    if nodes:
        return [str(i) for i in range(len(nodes))]
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


def visible_gpus() -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES (up to an invalid entry, as CUDA
    reads it) when set, else every GPU of the machine; none where the machine has none."""
    machine = _machine_gpus()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not machine or listed is None:
        return machine
    visible = []
    for entry in (e.strip() for e in listed.split(",")):
        if not entry or entry.startswith("-"):
            break
        visible.append(entry)
    return visible


def cuda_available() -> bool:
    return torch_cuda_version() is not None and bool(visible_gpus())


def check_choice(requested: str | None) -> str:
    """cpu, cuda or auto from the option or $REPRO_DEVICE; ValueError for anything else."""
    source = "--device" if requested else f"${ENV_DEVICE}"
    value = requested or os.environ.get(ENV_DEVICE) or "auto"
    if value not in CHOICES:
        raise ValueError(f"{source} must be one of {', '.join(CHOICES)}, got {value!r}")
    return value


def resolve(requested: str | None) -> str:
    """cpu or cuda from cpu|cuda|auto (default: $REPRO_DEVICE, else auto)."""
    requested = check_choice(requested)
    if requested == "auto":
        return "cuda" if cuda_available() else "cpu"
    return requested


def activate(device: str) -> None:
    """Set the Triton interpreter switch for `device`; call before importing kernels."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)


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
