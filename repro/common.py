"""What the subcommands share, at the bottom of the tool (it imports no other repro module):
argument checks (devices, time limits, dtypes, output files), preparing a device, tables.
Standard library and the light harness only: no torch in the CLI's process."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

from harness import device as devices
from harness.child import PREPARE
from harness.fixes import ALL_FIXES, UsageError
from harness.isolate import ENV_ISOLATION, MODES, Isolator, Job
from harness.outcome import Outcome
from harness.record import DTYPES, HANG_FACTOR, BugRecord
from harness.servers import ENV_SERVER
from harness.userdir import ENV_SERVER_DIR

BENCH_SCHEMA = "repro-bench/1"  # `repro bench --json` (read by `repro diff`)
ENV_TIMEOUT = "REPRO_TIMEOUT"  # caps every scenario's time limit, as --timeout does

BUILD_TIMEOUT_S = 900.0  # the first csrc build takes about a minute; a loaded machine, more

EVIDENCE_LINES = 6


def dtype_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="the runner's dtype: weights, activations, KV cache (scenarios that build no "
        "runner run as written); default float32",
    )


def timeout_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help=f"shorten every scenario's time limit to at most SECONDS (also ${ENV_TIMEOUT})",
    )


def _seconds(value: float | str, name: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise UsageError(f"{name} must be a finite number of seconds above 0, got {value!r}")
    return seconds


def time_limit(args: argparse.Namespace) -> float | None:
    """The cap on every scenario's time limit: --timeout, else $REPRO_TIMEOUT, else none."""
    if getattr(args, "timeout", None) is not None:
        return _seconds(args.timeout, "--timeout")
    value = os.environ.get(ENV_TIMEOUT)
    return None if value is None else _seconds(value, f"${ENV_TIMEOUT}")


def shard_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shard",
        metavar="K/N",
        help="run part K of N only: a deterministic split balanced by each run's usual seconds "
        "(the records'), disjoint, the N parts together the whole (CI's runners)",
    )


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """(K, N) of --shard K/N, 1 <= K <= N; None without it."""
    if text is None:
        return None
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise UsageError(f"--shard takes K/N with 1 <= K <= N, got {text!r}")
    return int(k), int(n)


def take_shard(items: list, shard: tuple[int, int] | None, cost, key) -> list:
    """Part K of N of `items` (in their order): longest first onto the least loaded part, ties
    by `key` then by the part's number, so every part computes the same split."""
    if shard is None:
        return items
    k, n = shard
    order = sorted(range(len(items)), key=lambda i: (-cost(items[i]), key(items[i]), i))
    loads, owner = [0.0] * n, {}
    for i in order:
        part = min(range(n), key=lambda j: (loads[j], j))
        loads[part] += cost(items[i])
        owner[i] = part
    return [item for i, item in enumerate(items) if owner[i] == k - 1]


def job_cost(bug: BugRecord, job: Job) -> float:
    """A run's usual seconds (its record's), 1 when not recorded."""
    return bug.usual_s(job.scenario, job.device) or 1.0


def capped(timeout_s: float, cap: float | None) -> float:
    return timeout_s if cap is None else min(timeout_s, cap)


def warn_tight(planned: list[tuple[BugRecord, Job]], cap: float | None) -> None:
    """One line when the cap is too tight to tell a hang in some scenario: a timeout there
    cannot test (125); it is no verdict (BugRecord.hang_shown)."""
    if cap is None:
        return
    tight = {
        f"{job.scenario} ({phrase})"
        for bug, job in planned
        if (phrase := bug.tight(bug.scenario(job.scenario), job.device, job.timeout_s))
    }
    if tight:
        shown = ", ".join(sorted(tight)[:4]) + (
            f" and {len(tight) - 4} more" if len(tight) > 4 else ""
        )
        print(
            f"repro: a time limit of {cap:g}s is under {HANG_FACTOR:g}x the usual time of {shown}: "
            "a timeout there cannot test (125), it is no verdict",
            file=sys.stderr,
        )


def check_environment() -> None:
    """Every environment variable the tool reads, valid or a usage error."""
    if os.environ.get(ENV_ISOLATION, "fork") not in MODES:
        raise UsageError(
            f"${ENV_ISOLATION} must be one of {', '.join(MODES)}, got {os.environ[ENV_ISOLATION]!r}"
        )
    try:
        devices.check_choice(None)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if os.environ.get(ENV_SERVER, "auto") not in ("auto", "off"):
        raise UsageError(f"${ENV_SERVER} must be auto or off, got {os.environ[ENV_SERVER]!r}")
    for name in ("REPRO_CACHE_DIR", ENV_SERVER_DIR):
        value = os.environ.get(name)
        if value is not None and (not value or (Path(value).exists() and not Path(value).is_dir())):
            raise UsageError(f"${name} must name a directory, got {value!r}")


def device_choice(requested: str | None) -> str:
    try:
        return devices.check_choice(requested)
    except ValueError as e:
        raise UsageError(str(e)) from None


def unavailable(device: str) -> str | None:
    """Why `device` cannot run here, or None (cheap: no torch, no CUDA initialization)."""
    if device == "cuda" and devices.torch_cuda_version() is None:
        return "no CUDA device is available: the installed torch is a CPU build"
    if device == "cuda" and not devices.visible_gpus():
        return "no CUDA device is available: no GPU visible (driver files, CUDA_VISIBLE_DEVICES)"
    return None


def prepare(isolator: Isolator, device: str) -> str | None:
    """Build the csrc extensions once, in a child, before scenario children race to build
    them under their own time limits; why the device cannot run, or None."""
    why = unavailable(device)
    if why or device != "cuda" or _builds_fresh():
        return why
    job = Job("csrc", "build", PREPARE, ALL_FIXES, "cuda", BUILD_TIMEOUT_S)
    result = isolator.run(job)
    if result.seconds > 5:
        print(f"csrc build: {result.outcome.value} in {result.seconds:.1f}s", file=sys.stderr)
    if result.outcome != Outcome.PASS:
        return f"preparing cuda failed ({result.outcome.value}): {result.evidence}"
    return None


def _builds_fresh() -> bool:
    """Every csrc build is fresh for the installed torch: no build child needed (a child still
    loads them; a stale or missing one is built by the child above). The versions are torch's
    own (torch/version.py): the cache is named after torch.__version__, which can differ from
    the package metadata's version (a local part such as +cu130)."""
    from kernels import csrc  # NOTE: torch-free at import; cache_dir needs the versions given

    version = devices.torch_version()
    return version is not None and csrc.all_fresh(version, devices.torch_cuda_version())


def evidence_lines(evidence: str, indent: str = "      ") -> str:
    """A few lines: the head says what diverged, the tail how a traceback ended."""
    lines = evidence.strip().splitlines()
    if len(lines) > EVIDENCE_LINES:
        head, tail = EVIDENCE_LINES // 2, EVIDENCE_LINES - EVIDENCE_LINES // 2 - 1
        skipped = len(lines) - head - tail
        lines = [*lines[:head], f"... ({skipped} lines)", *lines[-tail:]]
    return "\n".join(indent + line for line in lines)


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


def devices_wanted(requested: str | None) -> list[str]:
    """The devices asked for; of "all" (the default), those this machine has, and on stderr why
    cuda is not among them (a run on a machine without a GPU should not pass for a full one)."""
    requested = requested or os.environ.get(devices.ENV_DEVICE) or "all"
    if requested == "all":
        why_not = unavailable("cuda")
        if why_not:
            print(f"cuda: skipped: {why_not}", file=sys.stderr)
        return ["cpu"] if why_not else ["cpu", "cuda"]
    return [devices.resolve(device_choice(requested))]


def prepare_devices(isolator: Isolator, wanted: list[str]) -> list[str]:
    """The devices of `wanted` that can run (warmed, csrc built); why not on stderr."""
    ready = []
    for device in wanted:
        isolator.warm(device)
        why_not = prepare(isolator, device)
        if why_not:
            print(f"{device}: skipped: {why_not}", file=sys.stderr)
        else:
            ready.append(device)
    return ready


def writable(path: str, option: str) -> None:
    """A usage error unless `path` can be written as it will be: a temporary file beside it,
    renamed over it (tried now, before any run)."""
    target = Path(os.path.realpath(path))
    if target.is_dir():
        raise UsageError(f"{option} {path}: is a directory")
    if target.exists() and not target.is_file():  # /dev/stdout, a pipe: written in place
        return
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as e:
        raise UsageError(f"{option} {path}: cannot write: {e.strerror}") from None
    os.close(fd)
    os.unlink(temporary)


def writable_directory(path: str) -> None:
    """A usage error unless files can be written into `path`, a directory or one to be made:
    a temporary directory is made in it, or in its nearest existing parent, and removed (tried
    now, before anything is written; nothing is left behind)."""
    target = Path(os.path.realpath(path))
    existing = next(p for p in (target, *target.parents) if os.path.exists(p))
    if not existing.is_dir():
        raise UsageError(f"{path}: cannot write: {existing} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".repro-", dir=existing))
    except OSError as e:
        raise UsageError(f"{path}: cannot write in {existing}: {e.strerror}") from None
