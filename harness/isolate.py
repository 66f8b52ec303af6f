"""Running scenarios in child processes with a time limit, and collecting classified results.

Each job is one scenario on one variant and device, in a fresh `python -m harness.child` process
(a device-side assert or illegal address leaves the CUDA context unusable). A child that
crashes, hangs or exits without a report still yields exactly one classified result.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from harness.fixes import Variant
from harness.outcome import ChildExit, Outcome, classify

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Job:
    bug: str
    scenario: str
    target: str  # "module:function" run by the child
    fixes: Variant
    device: str
    timeout_s: float
    seed: int = 0
    sanitizer: bool = False


@dataclass(frozen=True, slots=True)
class Result:
    job: Job
    outcome: Outcome
    evidence: str
    seconds: float  # wall time of the whole child, spawn to reap
    scenario_seconds: float | None = None  # the scenario alone, as the child measured it


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # many children at once; scenarios are tiny
    return env


def _command(job: Job, report: Path) -> list[str]:
    spec = {
        "target": job.target,
        "fixes": sorted(f.value for f in job.fixes),
        "device": job.device,
        "seed": job.seed,
    }
    cmd = [sys.executable, "-m", "harness.child", json.dumps(spec), str(report)]
    if job.sanitizer:
        cmd = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "99", *cmd]
    return cmd


def _read_report(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_job(job: Job) -> Result:
    """Run one job in a child process group; kill the group at the time limit."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="repro-") as tmp:
        report, log = Path(tmp) / "report.json", Path(tmp) / "output.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                _command(job, report),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=_child_env(),
                start_new_session=True,
            )
            try:
                code, timed_out = proc.wait(timeout=job.timeout_s), False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code, timed_out = proc.wait(), True
        child = ChildExit(
            None if timed_out else code,
            timed_out,
            _read_report(report),
            log.read_text(errors="replace"),
            job.sanitizer,
        )
    verdict = classify(child)
    scenario_s = (child.report or {}).get("timings", {}).get("scenario_s")
    return Result(job, verdict.outcome, verdict.evidence, time.monotonic() - start, scenario_s)


def run_jobs(
    jobs: Iterable[Job],
    workers: int | None = None,
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Run jobs concurrently; results come back in job order, `on_result` sees them as they end."""
    jobs = list(jobs)
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs) or 1))
    results: dict[int, Result] = {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(run_job, job): i for i, job in enumerate(jobs)}
        for future in as_completed(futures):
            results[futures[future]] = result = future.result()
            if on_result:
                on_result(result)
    return [results[i] for i in range(len(jobs))]
