"""Run scenarios in isolated children, many at once, and lose no run and no process.

Each job runs in a child process: forked from a fork server per device (harness.forkserver,
the default), or a fresh interpreter (`REPRO_ISOLATION=spawn`, and always under
compute-sanitizer). Servers and children import the project from this file's tree (ROOT), never
from the caller's working directory. One thread drives every child through a selector over the
servers' sockets (harness.servers) and every child's pidfd, so that:
- a child's time limit kills its whole group (outcome `timeout`); each child also carries its
  own limit (harness.lifetime), in case nobody is left to enforce this one;
- children and servers die with this process: a server whose socket closes kills its children,
  and every child has a parent-death signal;
- a warm server that holds its lock but does not answer (stopped, hung) is killed and replaced
  by a fresh one for later runs; this run uses a private one (it pays the wait once);
- a server that refuses a request (its own modules differ from the tree's copies), dies, or does
  not report a child that exited (stopped, hung), is replaced once
  by a fresh private one (a dead warm server is not asked again) and its runs in flight run
  again, each recorded once; one that cannot start fails its runs (`error`, its output as
  evidence) as soon as it exits;
- Ctrl-C (KeyboardInterrupt) kills every child's group and every server, then raises
  Interrupted with a result for every job (`skipped`, "interrupted", for the unfinished).
Each Isolator keeps its files in one temporary directory of the user's directory
(harness.userdir), removed at close; directories left by a process that was killed are removed
by the next Isolator. Where the user's directory is not safe, no warm server is used and the
files go to a private temporary directory.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from harness import device as devices
from harness import lifetime
from harness.fixes import Variant
from harness.outcome import ChildExit, Outcome, classify
from harness.servers import (
    BOOT,
    ENV_SERVER,
    ROOT,
    WARM_IDLE_S,
    Server,
    Unresponsive,
    child_env,
    end_holder,
    start_warm,
)
from harness.userdir import UnsafeDirectory, UserDirectory

MODES = ("fork", "spawn")
ENV_ISOLATION = "REPRO_ISOLATION"
SERVER_START_S = 120.0  # a server's preload (importing torch on a loaded machine)
FORK_ANSWER_S = 30.0  # a ready server answers a request with the child's pid
DUMP_BEFORE_KILL_S = 1.0  # at its limit a child dumps its stacks (SIGUSR1), then is killed
REAP_AFTER_KILL_S = 30.0  # a killed child stuck in the driver: give up on its exit status
REPORT_AFTER_EXIT_S = 10.0  # a fork server reports a child's exit; one that does not is hung
REPORT_POLL_S = 0.02  # how often a forked child's report is looked for (decided before its exit)
LEAVE_S = 10.0  # a child decided by its report that has not exited by then is killed
SANITIZER_SLOWDOWN = 10.0  # compute-sanitizer instruments every kernel: scale time limits
SANITIZER_TOOLS = ("memcheck", "initcheck", "racecheck", "synccheck")
CHILD_BOOT = BOOT + "from harness.child import spawned; spawned(sys.argv[2])"


@dataclass(frozen=True, slots=True)
class Job:
    bug: str
    scenario: str
    target: str  # "module:function" run by the child
    fixes: Variant
    device: str
    timeout_s: float
    seed: int = 0
    sanitizer: str | None = None  # a compute-sanitizer tool (SANITIZER_TOOLS) to run it under
    env: tuple[tuple[str, str], ...] = ()  # set in a freshly spawned child (detectors)
    payload: str = ""  # handed to the function as Context.payload (a fuzz program, as JSON)
    dtype: str = "float32"  # handed over as Context.dtype: the runner's dtype
    ranks: int = 1  # > 1: the child coordinates so many rank processes (harness.ranks)
    # the child's niceness (a check's twin yields the CPUs to the first runs); not part of what
    # the job is: a twin equals its job
    nice: int = dataclasses.field(default=0, compare=False)

    @property
    def limit_s(self) -> float:
        return self.timeout_s * (SANITIZER_SLOWDOWN if self.sanitizer else 1.0)

    @property
    def fresh(self) -> bool:
        """Needs its own interpreter: under a sanitizer, or with variables read at import."""
        return bool(self.sanitizer or self.env)

    def request(self, directory: Path) -> dict:
        """What harness.child needs: the spec, where to report and log, the time limit."""
        fixes = sorted(f.value for f in self.fixes)
        spec = {"target": self.target, "fixes": fixes, "device": self.device, "seed": self.seed}
        if self.payload:
            spec["payload"] = self.payload
        if self.dtype != "float32":
            spec["dtype"] = self.dtype
        if self.ranks > 1:
            spec["ranks"] = self.ranks
        request = {
            "spec": spec,
            "report": str(directory / "report.json"),
            "log": str(directory / "output.log"),
            "timeout_s": self.limit_s,
        }
        return {**request, "nice": self.nice} if self.nice else request


@dataclass(frozen=True, slots=True)
class Result:
    job: Job
    outcome: Outcome
    evidence: str
    seconds: float  # wall time of the whole child, start to reap
    scenario_seconds: float | None = None  # the scenario alone, as the child measured it
    gpu: str | None = None  # the GPU it ran on, when the caller sees several


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM made one) during a batch; `results` has one per job, in order."""

    def __init__(self, results: list[Result]) -> None:
        super().__init__("interrupted")
        self.results = results


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run_directory(directory: UserDirectory | None) -> Path:
    """A fresh directory for this process's files: in the user's directory, sweeping those whose
    process is gone; without a safe user directory, a private temporary one."""
    if directory is None:
        return Path(tempfile.mkdtemp(prefix=f"repro-{os.getuid()}-{os.getpid()}-"))
    for old in os.listdir(directory.fd):
        owner = old.partition("-")[0]
        if owner.isdigit() and not _alive(int(owner)):
            shutil.rmtree(directory.path / old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=directory.path))


@dataclass(eq=False, slots=True)
class _Run:
    """One job in flight."""

    index: int
    job: Job
    directory: Path
    started: float
    deadline: float  # fork: for the server's answer, then the time limit; spawn: time limit
    server: Server | None = None
    proc: subprocess.Popen | None = None
    pidfd: int | None = None
    pid: int | None = None
    gpu: str | None = None  # the GPU the child runs on (when the caller sees several)
    rid: int | None = None  # its request id on its server (forked)
    exited: bool = False  # forked: the child is gone, its server has yet to report it
    decided: bool = False  # forked: its report read, its result recorded; it is leaving (the
    # driver tearing its CUDA context down) and holds its place until its exit is seen
    timed_out: bool = False  # past its limit: asked for its stacks, then killed
    killed: bool = False
    cut: str = ""  # stopped unfinished (run_all's `until` or `drop` said why): `skipped`


class Isolator:
    """Runs jobs in isolated children; owns its servers and files (use as a context)."""

    def __init__(self, mode: str | None = None, root: Path = ROOT) -> None:
        self.mode = mode or os.environ.get(ENV_ISOLATION) or "fork"
        if self.mode not in MODES:
            raise ValueError(f"isolation mode must be one of {', '.join(MODES)}: {self.mode!r}")
        self.use_warm = os.environ.get(ENV_SERVER, "auto") != "off"
        try:
            self.userdir: UserDirectory | None = UserDirectory.open()
        except UnsafeDirectory as e:
            self.userdir = None
            if self.use_warm:
                print(
                    f"repro: not using warm servers: {e}; running on a private server",
                    file=sys.stderr,
                )
        self.use_warm = self.use_warm and self.userdir is not None
        self.root, self.directory = root, _run_directory(self.userdir)
        self.gpus = devices.visible_gpus()  # cuda children are spread over them
        self.env = child_env()  # what every child runs with, whichever server forks it
        self.selector = selectors.DefaultSelector()
        self.servers: dict[str, Server] = {}
        self.restarted: set[str] = set()
        self.broken: dict[str, str] = {}  # device -> why its server cannot serve
        self.ids = itertools.count()

    def __enter__(self) -> Isolator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for server in list(self.servers.values()):
            self._drop(server)
        shutil.rmtree(self.directory, ignore_errors=True)
        if self.userdir is not None:
            self.userdir.close()

    def warm(self, device: str) -> None:
        """Start the device's fork server now, so its imports overlap the caller's work."""
        if self.mode == "fork":
            self._server(device)

    def _server(self, device: str) -> Server:
        """The device's server: a warm one if it runs (`repro serve`), else a private one."""
        if device not in self.servers:
            server = self._warm_server(device) if self.use_warm and self.mode == "fork" else None
            if server is None:
                log = self.directory / f"server-{device}-{next(self.ids)}.log"
                server = Server.start(device, self.root, log)
            self.servers[device] = server
            self.selector.register(server.sock, selectors.EVENT_READ, server)
        return self.servers[device]

    def _warm_server(self, device: str) -> Server | None:
        """The warm server (`repro serve`) if one runs and answers. One that is stale (another
        installation, other copies of its own modules) is stopped, one that holds its lock
        but does not answer (stopped, hung) is killed, and a fresh one is started for the next
        runs; this one runs on a private server."""
        try:
            server = Server.connect(device, self.userdir)
        except Unresponsive as e:  # it would cost every later run its wait
            if not end_holder(e.holder, device, self.userdir):
                return None
            print(
                f"repro: the warm {device} server did not answer ({e.holder.describe()}): "
                "killed; a fresh one starts",
                file=sys.stderr,
            )
        else:
            if server is None or not server.stale:
                return server
            server.send({"stop": True})
            server.sock.close()
        with contextlib.suppress(OSError):
            start_warm(device, WARM_IDLE_S, self.userdir)
        return None

    def _drop(self, server: Server) -> None:
        self.selector.unregister(server.sock)
        server.stop()
        if self.servers.get(server.device) is server:
            del self.servers[server.device]

    def run(self, job: Job) -> Result:
        return self.run_all([job])[0]

    def run_all(
        self,
        jobs: Iterable[Job],
        workers: int | None = None,
        on_result: Callable[[Result], None] | None = None,
        stop_on_failure: bool = False,
        then: Callable[[Result], Job | None] | None = None,
        until: Callable[[], str] | None = None,
        drop: Callable[[], dict[Job, str]] | None = None,
    ) -> list[Result]:
        """Run jobs, at most `workers` at once; results in job order, `on_result` sees each
        as it ends. `stop_on_failure`: after the first failure, start nothing more (the jobs
        not started are `skipped`). `then`: a job to run after a result (None: none), started
        before any job still waiting; its result follows the given jobs', in the order they were
        asked for. `until`: asked after each result; once it names a reason, nothing more
        starts and the runs in flight are killed, each of those `skipped` with that reason (a
        check whose verdict is settled). `drop`: asked after each result; the runs of the jobs
        it names are killed and their waiting copies skipped, each with its reason (a twin whose
        copy passed). Raises Interrupted on Ctrl-C, after killing everything it started."""
        batch = _Batch(self, list(jobs), max(1, workers or os.cpu_count() or 1), on_result)
        batch.stop_on_failure, batch.then, batch.until = stop_on_failure, then, until
        batch.drop = drop
        try:
            return batch.run()
        except KeyboardInterrupt:
            raise Interrupted(batch.abandon()) from None


class _Batch:
    """The event loop of one run_all call."""

    def __init__(self, iso: Isolator, jobs: list[Job], workers: int, on_result) -> None:
        self.iso, self.jobs, self.workers, self.on_result = iso, jobs, workers, on_result
        self.pending = collections.deque(range(len(jobs)))
        self.running: set[_Run] = set()
        self.results: dict[int, Result] = {}
        self.gpu_load = collections.Counter({gpu: 0 for gpu in iso.gpus})

    stop_on_failure = False
    then: Callable[[Result], Job | None] | None = None
    until: Callable[[], str] | None = None
    drop: Callable[[], dict[Job, str]] | None = None

    def run(self) -> list[Result]:
        while self.pending or any(not run.decided for run in self.running):
            if self.stop_on_failure and any(r.outcome.is_failure for r in self.results.values()):
                self._skip_pending("not run: an earlier scenario failed (--fail-fast)")
            why = self.until() if self.until else ""
            if why:
                self._skip_pending(f"not run: {why}")
                for run in self.running:
                    self._cut(run, why)
            for job, why in (self.drop() if self.drop else {}).items():
                self._skip_pending(f"not run: {why}", job)
                for run in self.running:
                    if run.job == job:
                        self._cut(run, why)
            while self.pending and self._fits(self.jobs[self.pending[0]]):
                self._start(self.pending.popleft())
            if self.running:
                self._wait()
                self._enforce_deadlines()
        for run in list(self.running):  # still leaving: their server, or their own limit, ends
            self._release(run)  # them
        return [self.results[i] for i in range(len(self.jobs))]

    def _skip_pending(self, why: str, job: Job | None = None) -> None:
        """Skip the waiting runs (of `job` only, when given)."""
        skipped = [i for i in self.pending if job is None or self.jobs[i] == job]
        for i in skipped:
            self.results[i] = Result(self.jobs[i], Outcome.SKIPPED, why, 0.0)
        self.pending = collections.deque(i for i in self.pending if i not in skipped)

    def _cut(self, run: _Run, why: str) -> None:
        """Stop a run in flight, unfinished (its result: skipped); a fork not yet answered by
        its server is killed once its pid comes."""
        if run.cut or run.decided:
            return
        run.cut = f"not finished: {why}"
        if run.pid is not None:
            self._kill(run)

    def _kill(self, run: _Run) -> None:
        lifetime.kill_group(run.pid)
        run.killed, run.deadline = True, time.monotonic() + REAP_AFTER_KILL_S

    def _weight(self, job: Job) -> int:
        """The processes a job runs at once: a run of ranks counts each rank (a rank on a GPU
        holds a CUDA context: 32 runs of 4 ranks on one GPU ran it out of memory), at most
        every worker (a run larger than `workers` runs alone)."""
        return min(max(1, job.ranks), self.workers)

    def _fits(self, job: Job) -> bool:
        busy = sum(self._weight(run.job) for run in self.running)
        return busy + self._weight(job) <= self.workers

    def abandon(self) -> list[Result]:
        """Kill everything in flight; a result for every job (unfinished: skipped)."""
        for run in self.running:
            if run.pid is not None:
                lifetime.kill_group(run.pid)
            if run.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    run.proc.wait(timeout=5)
        for server in list(self.iso.servers.values()):
            self.iso._drop(server)
        started = {run.index for run in self.running}
        for i, job in enumerate(self.jobs):
            if i not in self.results:
                why = "interrupted" if i in started else "interrupted before it started"
                self.results[i] = Result(job, Outcome.SKIPPED, why, 0.0)
        return [self.results[i] for i in range(len(self.jobs))]

    # -- starting -------------------------------------------------------------------------------

    def _start(self, index: int) -> None:
        job, now = self.jobs[index], time.monotonic()
        directory = self.iso.directory / f"job-{next(self.iso.ids)}"
        run = _Run(index, job, directory, now, now + job.limit_s, gpu=self._pick_gpu(job))
        try:
            directory.mkdir()
        except OSError as e:  # a full disk: no run can tell anything
            self._error(run, f"cannot make the run's directory {directory}: {e.strerror}")
            return
        if self.iso.mode == "spawn" or job.fresh:
            self._spawn(run)
            return
        if job.device in self.iso.broken:
            self._error(run, self.iso.broken[job.device])
            return
        server = self.iso._server(job.device)
        rid = next(self.iso.ids)
        run.server, run.rid, server.runs[rid] = server, rid, run
        run.deadline = self._answer_deadline(server)
        self.running.add(run)
        request = {**job.request(directory), "env": self.iso.env, "gpu": run.gpu}
        if not server.send({"id": rid, "root": str(self.iso.root), "request": request}):
            self._server_died(server)

    def _pick_gpu(self, job: Job) -> str | None:
        """The least busy of the caller's GPUs for a cuda child (None: one GPU or none, the
        child keeps the caller's CUDA_VISIBLE_DEVICES)."""
        if job.device != "cuda" or len(self.gpu_load) < 2 or job.ranks > 1:
            return None  # ranks see every GPU: one each where there are enough (NCCL)
        gpu = min(self.gpu_load, key=lambda g: (self.gpu_load[g], self.iso.gpus.index(g)))
        self.gpu_load[gpu] += 1
        return gpu

    def _answer_deadline(self, server: Server) -> float:
        if server.ready:
            return time.monotonic() + FORK_ANSWER_S
        return server.started + SERVER_START_S + FORK_ANSWER_S

    def _spawn(self, run: _Run) -> None:
        request = run.job.request(run.directory)
        cmd = [sys.executable, "-c", CHILD_BOOT, str(self.iso.root), json.dumps(request)]
        if run.job.sanitizer:
            tool = run.job.sanitizer
            cmd = ["compute-sanitizer", "--tool", tool, "--error-exitcode", "99", *cmd]
        parent, env = os.getpid(), {**self.iso.env, **dict(run.job.env)}
        if run.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = run.gpu
        with open(request["log"], "wb") as log:
            run.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=lambda: lifetime.die_with_parent(parent),
            )
        run.pid, run.pidfd = run.proc.pid, os.pidfd_open(run.proc.pid)
        self.iso.selector.register(run.pidfd, selectors.EVENT_READ, run)
        self.running.add(run)

    # -- events ---------------------------------------------------------------------------------

    def _wait(self) -> None:
        if not self.running:
            return
        timeout = max(0.0, min(r.deadline for r in self.running) - time.monotonic())
        if any(self._may_decide(run) for run in self.running):
            timeout = min(timeout, REPORT_POLL_S)
        for key, _ in self.iso.selector.select(timeout):
            if isinstance(key.data, Server):
                if self.iso.servers.get(key.data.device) is key.data:  # not dropped meanwhile
                    self._on_server(key.data)
            elif key.data not in self.running:
                continue
            elif key.data.proc is not None:  # a spawned child exited
                self._finish(key.data, key.data.proc.wait())
            else:  # a forked child exited: its server reports it soon
                self._exited(key.data)
        for run in [r for r in self.running if self._may_decide(r)]:
            if (run.directory / "report.json").exists():
                run.decided = True
                self._finish(run, 0)

    @staticmethod
    def _may_decide(run: _Run) -> bool:
        """A forked child is decided by its report, written last before it leaves through
        os._exit(0) (harness.child.main): its exit (the driver's teardown of its CUDA context,
        0.1 s, most of a second after a fault) is not waited for. Not a spawned child: a tool
        wrapping it (compute-sanitizer) reports at its exit."""
        return (
            run.server is not None
            and run.pid is not None
            and not (run.decided or run.exited or run.timed_out or run.killed or run.cut)
        )

    def _on_server(self, server: Server) -> None:
        messages = server.receive()
        if messages is None:
            self._server_died(server)
            return
        for message in messages:
            run = server.runs.get(message.get("id"))
            if message.get("ready"):
                server.ready, server.versions = True, message["versions"]
                for waiting in server.runs.values():
                    waiting.deadline = self._answer_deadline(server)
            elif run is not None and "pid" in message:
                run.pid, run.deadline = message["pid"], time.monotonic() + run.job.limit_s
                self._watch(run)
                if run.cut:  # stopped before its server answered
                    self._kill(run)
            elif run is not None and "returncode" in message:
                self._finish(run, message["returncode"])
            elif run is not None and "refused" in message:
                self._server_died(server, f"refused a run: {message['refused']}")
                return

    def _watch(self, run: _Run) -> None:
        """Watch a forked child's exit too: a server that stops reporting (stopped, hung) must
        not pass for a child that hangs."""
        try:
            run.pidfd = os.pidfd_open(run.pid)
        except OSError:  # already gone: its report follows
            return
        self.iso.selector.register(run.pidfd, selectors.EVENT_READ, run)

    def _exited(self, run: _Run) -> None:
        if run.decided:  # it has left
            self._release(run)
            return
        self._unwatch(run)
        run.exited, run.deadline = True, time.monotonic() + REPORT_AFTER_EXIT_S

    def _unwatch(self, run: _Run) -> None:
        if run.pidfd is not None:
            self.iso.selector.unregister(run.pidfd)
            os.close(run.pidfd)
            run.pidfd = None

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        for run in [r for r in self.running if r.deadline <= now]:
            if run not in self.running:  # its server died earlier in this round
                continue
            if run.decided:  # decided, but not leaving: killed, then given up on
                if run.killed:
                    self._release(run)
                else:
                    self._kill(run)
            elif run.pid is None:
                self._server_died(run.server, f"did not answer within {FORK_ANSWER_S:.0f}s")
            elif run.exited:
                why = f"did not report its child's exit within {REPORT_AFTER_EXIT_S:.0f}s"
                self._server_died(run.server, why)
            elif run.cut:  # killed by _cut, its exit never seen
                self._done(run, Outcome.SKIPPED, f"{run.cut} (killed, then never reaped)")
            elif not run.timed_out:  # where it hangs, for the evidence (harness.child)
                run.timed_out, run.deadline = True, now + DUMP_BEFORE_KILL_S
                if not run.job.sanitizer:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(run.pid, signal.SIGUSR1)
            elif not run.killed:
                self._kill(run)
            else:
                self._done(run, Outcome.TIMEOUT, "killed at its time limit, then never reaped")

    def _server_died(self, server: Server, why: str = "exited") -> None:
        """Its runs run again, once per device, on a fresh private server (a dead warm server
        is not asked again); if the server had never served, or the fresh one dies too, its
        runs fail (`error`: cannot test)."""
        if why == "exited" and server.proc is not None:  # the exit status follows at once
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.proc.wait(timeout=2.0)
        status = server.proc.poll() if server.proc is not None else None
        self.iso._drop(server)
        if server.proc is None:
            self.iso.use_warm = False
        if status is not None:
            why += f" (exit status {status})"
        runs = list(server.runs.values())
        for run in runs:
            self._unwatch(run)
            self.running.discard(run)
            if run.gpu is not None:
                self.gpu_load[run.gpu] -= 1
            if run.pid is not None:
                lifetime.kill_group(run.pid)
            shutil.rmtree(run.directory, ignore_errors=True)
        kind = "a private" if server.proc is not None else "the warm"
        evidence = f"{kind} fork server ({server.device}) {why}:\n{server.evidence()}".strip()
        if server.ready and server.device not in self.iso.restarted:
            self.iso.restarted.add(server.device)
            self.pending.extendleft(reversed([run.index for run in runs]))
            return
        self.iso.broken[server.device] = evidence
        for run in runs:
            self._error(run, evidence)

    # -- results --------------------------------------------------------------------------------

    def _finish(self, run: _Run, returncode: int) -> None:
        if run.cut:  # whatever it wrote before it was stopped does not count
            self._done(run, Outcome.SKIPPED, run.cut)
            return
        log, report = run.directory / "output.log", run.directory / "report.json"
        text = log.read_text(errors="replace") if log.exists() else ""
        code = None if run.timed_out else returncode
        child = ChildExit(code, run.timed_out, _read_report(report), text, bool(run.job.sanitizer))
        unwritable = None if child.report is not None else _unwritable(run.directory)
        if unwritable:  # the child could not write its report, whatever else it printed
            self._error(run, unwritable)
            return
        verdict = classify(child)
        scenario_s = (child.report or {}).get("timings", {}).get("scenario_s")
        self._record(run, Result(run.job, verdict.outcome, verdict.evidence, 0.0, scenario_s))

    def _done(self, run: _Run, outcome: Outcome, evidence: str) -> None:
        self._record(run, Result(run.job, outcome, evidence, 0.0))

    def _error(self, run: _Run, evidence: str) -> None:
        self._record(run, Result(run.job, Outcome.ERROR, evidence, 0.0))

    def _record(self, run: _Run, result: Result) -> None:
        if run.gpu is not None:
            result = dataclasses.replace(result, gpu=run.gpu)
        if run.server is not None:  # never run again if its server dies later
            run.server.runs.pop(run.rid, None)
        if run.decided and run.pidfd is not None:  # leaving: its place is kept until its exit
            run.deadline = time.monotonic() + LEAVE_S
        else:
            self._release(run)
        result = dataclasses.replace(result, seconds=time.monotonic() - run.started)
        self.results[run.index] = result
        if self.on_result:
            self.on_result(result)
        follow = self.then(result) if self.then else None
        if follow is not None:
            self.jobs.append(follow)
            self.pending.appendleft(len(self.jobs) - 1)

    def _release(self, run: _Run) -> None:
        """The run's place, watch and files, given back."""
        if run.gpu is not None:
            self.gpu_load[run.gpu] -= 1
        self._unwatch(run)
        self.running.discard(run)
        shutil.rmtree(run.directory, ignore_errors=True)


def _unwritable(directory: Path) -> str | None:
    """Why a child could not write in `directory` (no space left, a quota, read-only), or None:
    a page written and removed again."""
    probe = directory / "probe"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return f"cannot test: {e.strerror} in {directory} (the run's directory): no report written"
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


def _read_report(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
