"""Running scenarios in child processes with a time limit, and collecting classified results.

Each job is one scenario on one variant and device, in its own child process (a device-side
assert or illegal address leaves the CUDA context unusable). Children are forked from a
pre-imported fork server per device (harness.forkserver), which saves the torch import per
child; `REPRO_ISOLATION=spawn` (and every compute-sanitizer job) starts a fresh interpreter
instead. A child that crashes, hangs or exits without a report still yields exactly one
classified result.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from harness.fixes import Variant
from harness.outcome import ChildExit, Outcome, classify

ROOT = Path(__file__).resolve().parent.parent
MODES = ("fork", "spawn")
SERVER_START_S = 300.0  # preload time allowed to a fork server (imports)
SANITIZER_SLOWDOWN = 10.0  # compute-sanitizer instruments every kernel: scale time limits


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

    def spec(self) -> dict:
        fixes = sorted(f.value for f in self.fixes)
        return {"target": self.target, "fixes": fixes, "device": self.device, "seed": self.seed}


@dataclass(frozen=True, slots=True)
class Result:
    job: Job
    outcome: Outcome
    evidence: str
    seconds: float  # wall time of the whole child, start to reap
    scenario_seconds: float | None = None  # the scenario alone, as the child measured it


class ServerDown(RuntimeError):
    """The fork server exited or never came up."""


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # many children at once; scenarios are tiny
    return env


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


class _ForkServer:
    """Client side of one `python -m harness.forkserver DEVICE` process."""

    def __init__(self, device: str) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (the server's stderr, open while it runs)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "harness.forkserver", device],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=_child_env(),
        )
        self.cond = threading.Condition()
        self.pids: dict[int, int] = {}  # request id -> pid
        self.codes: dict[int, int] = {}  # pid -> return code
        self.next_id, self.dead = 0, False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.cond:
                if "id" in message:
                    self.pids[message["id"]] = message["pid"]
                elif "returncode" in message:
                    self.codes[message["pid"]] = message["returncode"]
                self.cond.notify_all()
        with self.cond:
            self.dead = True
            self.cond.notify_all()

    def _down(self) -> ServerDown:
        self.log.seek(0)
        tail = self.log.read().decode(errors="replace").strip().splitlines()[-8:]
        return ServerDown("fork server is down:\n" + "\n".join(tail))

    def start(self, spec: dict, report: Path, log: Path) -> int:
        """Fork a child for `spec`; returns its pid."""
        with self.cond:
            rid, self.next_id = self.next_id, self.next_id + 1
            request = {"id": rid, "spec": spec, "report": str(report), "log": str(log)}
            try:
                self.proc.stdin.write((json.dumps(request) + "\n").encode())
                self.proc.stdin.flush()
            except BrokenPipeError:
                raise self._down() from None
            self.cond.wait_for(lambda: rid in self.pids or self.dead, SERVER_START_S)
            if rid not in self.pids:
                raise self._down()
            return self.pids.pop(rid)

    def wait(self, pid: int, timeout: float) -> int | None:
        """The child's return code, or None if it is still running after `timeout`."""
        with self.cond:
            self.cond.wait_for(lambda: pid in self.codes or self.dead, timeout)
            if pid in self.codes:
                return self.codes.pop(pid)
            if self.dead:
                raise self._down()
            return None

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):  # a dead server cannot take the flush
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class Isolator:
    """Runs jobs in isolated children; owns the fork servers it starts (use as a context)."""

    def __init__(self, mode: str | None = None) -> None:
        self.mode = mode or os.environ.get("REPRO_ISOLATION", "fork")
        if self.mode not in MODES:
            raise ValueError(f"isolation mode must be one of {MODES}, got {self.mode!r}")
        self.servers: dict[str, _ForkServer] = {}
        self.lock = threading.Lock()

    def __enter__(self) -> Isolator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self.lock:
            for server in self.servers.values():
                server.close()
            self.servers.clear()

    def warm(self, device: str) -> None:
        """Start the device's fork server now, so its imports overlap the caller's work."""
        if self.mode == "fork":
            self._server(device)

    def _server(self, device: str) -> _ForkServer:
        with self.lock:
            if device not in self.servers:
                self.servers[device] = _ForkServer(device)
            return self.servers[device]

    def run(self, job: Job) -> Result:
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="repro-") as tmp:
            report, log = Path(tmp) / "report.json", Path(tmp) / "output.log"
            try:
                code, timed_out = self._execute(job, report, log)
            except ServerDown as e:
                return Result(job, Outcome.ERROR, str(e), time.monotonic() - start)
            text = log.read_text(errors="replace") if log.exists() else ""
            child = ChildExit(code, timed_out, _read_report(report), text, job.sanitizer)
        verdict = classify(child)
        scenario_s = (child.report or {}).get("timings", {}).get("scenario_s")
        return Result(job, verdict.outcome, verdict.evidence, time.monotonic() - start, scenario_s)

    def _execute(self, job: Job, report: Path, log: Path) -> tuple[int | None, bool]:
        """Run the child to its end or its time limit: (return code or None, timed out)."""
        if self.mode == "spawn" or job.sanitizer:
            return _spawn(job, report, log)
        server = self._server(job.device)
        pid = server.start(job.spec(), report, log)
        code = server.wait(pid, job.timeout_s)
        if code is not None:
            return code, False
        _kill_group(pid)
        server.wait(pid, 30.0)
        return None, True

    def run_all(
        self,
        jobs: Iterable[Job],
        workers: int | None = None,
        on_result: Callable[[Result], None] | None = None,
    ) -> list[Result]:
        """Run jobs concurrently; results in job order, `on_result` sees each as it ends."""
        jobs = list(jobs)
        workers = max(1, min(workers or os.cpu_count() or 1, len(jobs) or 1))
        results: dict[int, Result] = {}
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(self.run, job): i for i, job in enumerate(jobs)}
            for future in as_completed(futures):
                results[futures[future]] = result = future.result()
                if on_result:
                    on_result(result)
        return [results[i] for i in range(len(jobs))]


def _spawn(job: Job, report: Path, log: Path) -> tuple[int | None, bool]:
    cmd = [sys.executable, "-m", "harness.child", json.dumps(job.spec()), str(report)]
    timeout = job.timeout_s
    if job.sanitizer:
        cmd = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "99", *cmd]
        timeout *= SANITIZER_SLOWDOWN
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=_child_env(),
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.wait()
            return None, True


def _read_report(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
