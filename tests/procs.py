"""Processes of a run, found by an environment tag every descendant inherits."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path

TAG = "REPRO_TEST_TAG"


def new_tag() -> str:
    return uuid.uuid4().hex


def tagged(tag: str, exclude: tuple[int, ...] = ()) -> list[int]:
    """Live (not zombie) processes whose environment carries `tag`."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in exclude:
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and not _zombie(entry):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _zombie(entry: Path) -> bool:
    stat = (entry / "stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def alive(pid: int) -> bool:
    """The process is there and not a zombie."""
    try:
        return not _zombie(Path(f"/proc/{pid}"))
    except OSError:
        return False


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def parent_of(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def wait_until(condition, timeout_s: float = 60.0, step_s: float = 0.02):
    """`condition()`'s first truthy value, polling; None after `timeout_s` (a hang guard)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(step_s)
    return None


def survivors(tag: str, timeout_s: float = 10.0, exclude: tuple[int, ...] = ()) -> list[int]:
    """The tagged processes still alive after waiting up to `timeout_s` for them to go."""
    wait_until(lambda: not tagged(tag, exclude), timeout_s)
    return [p for p in tagged(tag, exclude) if p != os.getpid()]


ROOT = Path(__file__).resolve().parent.parent
# The `repro` entry point in a fresh interpreter, importing this tree; at exit it says whether
# torch was imported (the parent never should).
# It is the command's own process (the guard's child, repro.cli): its verdict goes to a pipe
# nobody reads, and the guard's own tests run the real entry points.
PROBE = """
import os, sys
sys.path.insert(0, sys.argv.pop(1))
os.environ["REPRO_VERDICT_FD"] = str(os.pipe()[1])
try:
    from repro.cli import main
    main(sys.argv[1:])
finally:
    print("torch imported:", any(m in sys.modules for m in ("torch", "triton", "numpy")),
          file=sys.stderr)
"""


# PROBE on a machine that looks like a GPU machine to the client: the installed torch a CUDA
# build and one GPU in the driver's files (both are read without importing torch: harness.device).
# The children it starts see the real machine.
FAKE_GPU = """
import sys
sys.path.insert(0, sys.argv[1])
from harness import device
device.torch_cuda_version = lambda: "13.0"
device._machine_gpus = lambda: ["0"]
"""


def repro_command(*argv: str, fake_gpu: bool = False) -> list[str]:
    return [sys.executable, "-c", (FAKE_GPU if fake_gpu else "") + PROBE, str(ROOT), *argv]


def installed_repro() -> str:
    """The `repro` command the README's set-up installs beside this interpreter."""
    beside = Path(sys.executable).with_name("repro")
    found = str(beside) if beside.exists() else shutil.which("repro")
    assert found, "the README's set-up installs the repro command"
    return found


def repro_run(bug: str, variant: str) -> str:
    """`repro run BUG --variant VARIANT --device cpu` in a process of its own: its stdout and
    stderr together (its seconds go to this test's stderr)."""
    argv = ("run", bug, "--variant", variant, "--device", "cpu")
    start = time.monotonic()
    done = subprocess.run(repro_command(*argv), capture_output=True, text=True, timeout=300)
    print(f"repro run {bug} --variant {variant}: {time.monotonic() - start:.1f}s", file=sys.stderr)
    return done.stdout + done.stderr


def forked_ranks(target, directory: Path, *args) -> None:
    """Run target(rank, str(directory), *args) in two ranks forked from the test, joined over
    gloo (a FileStore in `directory`); fail on any rank's error, exit or hang (120 s)."""
    context = multiprocessing.get_context("fork")
    errors = context.Queue()

    def main(rank: int) -> None:
        import torch.distributed as dist

        try:
            store = dist.FileStore(str(directory / "store"), 2)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
            target(rank, str(directory), *args)
            dist.barrier()
            dist.destroy_process_group()
        except BaseException:
            errors.put(f"rank {rank}: {traceback.format_exc()}")
            raise

    ranks = [context.Process(target=main, args=(r,)) for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(120)
    alive = [p for p in ranks if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank did not finish in 120 s"
    assert errors.empty(), errors.get()
    assert [p.exitcode for p in ranks] == [0, 0]
