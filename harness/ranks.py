"""A scenario of N ranks: N rank processes over torch.distributed, one run, one outcome.

The scenario child (harness.child, forked by the fork server, or spawned) becomes the
coordinator of its ranks (`coordinate`). Where it is a warm child (torch imported) with no
CUDA context, which is what the fork server makes, each rank is a fork of it (`_may_fork`:
a context does not survive a fork, and none exists yet: each rank makes its own), or, where a
warm cuda server made it as a spare coordinator, a child it was made with whose context is
made already (the request's RANK_SPARES: each is handed its rank's request, `_hand_over`);
else (a spawned child, a sanitizer run) a fresh interpreter that imports the project from the
request's tree. Each rank joins the process group (`join`) and runs the scenario function with
its rank in the Context, then writes its own report (harness.child.main). The ranks stay in the
coordinator's process group (the run's, which the isolator kills as a whole on timeout, Ctrl-C
and a dead server) and each dies with the coordinator (parent-death signal); the coordinator
kills them itself on every path it decides (SIGKILL, then reaped).

Rendezvous: a FileStore in the run's private directory (no port; parallel runs never meet),
gloo's and NCCL's sockets on the loopback interface. Backend: gloo on the CPU; on a GPU,
NCCL with one GPU per rank where torch.cuda.device_count() >= N, else gloo on CUDA tensors
with rank r on GPU r mod the count (NCCL refuses two ranks on one GPU). The pass evidence says
which.

The collective-trace oracle: each rank records every collective before issuing it
(harness.runner.parallel.Collectives: one JSON line per entry, flushed). The coordinator
reads the traces while the ranks run (`first_divergence`): when two ranks' entries of one
group differ at the same index, or a rank waits in a collective that another rank of its
group will never issue (that rank finished the step, moved past it, or exited), the run is
`collective_mismatch`, the first divergence named, every rank killed: in seconds, not at the
backend's timeout. A rank that fails otherwise (a fault, an exception, a wrong result) names
the run's outcome ("rank 1: illegal_address: ..."), the first to fail deciding, at once (a
peer still spinning on a flag of the dead rank is not waited for); only a rank whose collective
lost its peer, an effect, waits up to CAUSE_WAIT_S for its cause to exit. A rank is done when its
report is written (its last act before it leaves: harness.child.main), not when its exit is seen:
the driver's teardown of its CUDA context takes 0.1 s, most of a second after a fault. The
coordinator writes its own report first, then waits for its ranks' exits (`reap`, bounded).
A real hang is bounded by the run's limit (the parent asks for stacks: the coordinator
forwards SIGUSR1 to its ranks and prints each one's stack under "=== rank R stacks ===") and
by the process group's timeout, set past the run's limit.

Standard library only at import: the coordinator never needs torch itself.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness import lifetime
from harness.outcome import ChildExit, Outcome, classify

ROOT = Path(__file__).resolve().parent.parent
RANK_BOOT = (
    "import sys; sys.path[:] = [sys.argv[1], *(p for p in sys.path if p)]; "
    "from harness.child import spawned_rank; spawned_rank(sys.argv[2])"
)
RankMain = Callable[[str], None]  # a rank's entry point, given its request as JSON
SOCKET_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
POLL_S = 0.02  # how often the coordinator reads the ranks' traces and exits
# the backends' words for a peer that went away (gloo's TCP pair, NCCL's abort)
PEER_LOST = re.compile(r"Connection (reset|closed) by peer|remote process exited|aborted", re.I)
# after a rank's collective lost its peer: the others' time to exit (so the cause is seen); a
# rank that failed otherwise is the cause, decided at once. A rank that faulted on a GPU can take
# longer than 2 s to leave the driver while other checks share the GPU: with 2 s the peer's lost
# connection was taken for the run's outcome (ep_graph_bucket_local under `repro mutants`, one
# H200: an exception, then illegal_address, so 'cannot test: flaky'); as long as REAP_S
CAUSE_WAIT_S = 10.0
PG_TIMEOUT_GRACE_S = 30.0  # the process group's timeout is past the run's own limit
DUMP_WAIT_S = 0.3  # after forwarding SIGUSR1, time for the ranks to write their stacks
REAP_S = 10.0  # a rank stuck in the driver (leaving or killed): give up on its exit status
RANK_SPARES = "rank_spares"  # a spare coordinator's request: [[pid, write fd]] of its ranks


# -- traces -------------------------------------------------------------------------------------


@dataclass(slots=True)
class RankTrace:
    """What one rank's trace says so far, and whether the rank ended cleanly (then it issues
    nothing more)."""

    rank: int
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)  # kind -> its members
    events: list[dict] = field(default_factory=list)  # entries and {"step_end": S}, in order
    exited: bool = False

    def entries(self, group: str) -> list[tuple[int, dict]]:
        """(position in events, entry) of each collective of `group`, in order."""
        return [(i, e) for i, e in enumerate(self.events) if e.get("group") == group]

    def finished_before(self, step: int, position: int) -> bool:
        """The rank ended step `step` (or a later one) before events[position]."""
        return any(e.get("step_end", -1) >= step for e in self.events[:position])

    def why_not(self, step: int) -> str | None:
        """Why this rank will never issue a collective of step `step` it has not issued yet:
        it ended that step, moved on to a later one, or exited (None: it may still)."""
        if self.finished_before(step, len(self.events)):
            return f"nothing (finished step {step} without it)"
        later = [e["step"] for e in self.events if "op" in e and e["step"] > step]
        if later:
            return f"nothing (moved on to step {later[0]})"
        if self.exited:
            return "nothing (exited)"
        return None


def read_trace(path: Path, rank: int) -> RankTrace:
    """The complete lines of a rank's trace (a line being written is left for later)."""
    trace = RankTrace(rank)
    try:
        text = path.read_text()
    except OSError:
        return trace
    for line in text.split("\n")[:-1]:
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if "groups" in item:
            trace.groups = {kind: tuple(members) for kind, members in item["groups"].items()}
        else:
            trace.events.append(item)
    return trace


def describe(entry: dict) -> str:
    """all_reduce(dp, (2,), int32)"""
    return f"{entry['op']}({entry['group']}, {tuple(entry['shape'])}, {entry['dtype']})"


def _same(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("step", "op", "group", "shape", "dtype"))


def first_divergence(traces: list[RankTrace]) -> str | None:
    """The first point where the ranks' collectives disagree, in words, or None (so far they
    agree, or a rank may still issue what another waits in). Per group (the members of one
    group compare their own entries of it): the first index where two members' entries
    differ, or where one member has an entry that another will never issue."""
    found: list[tuple[int, int, str]] = []  # (step, index, words)
    by_rank = {t.rank: t for t in traces}
    instances = {(kind, members) for t in traces for kind, members in t.groups.items()}
    for kind, members in sorted(instances):
        ranks = [by_rank[r] for r in members if r in by_rank]
        if len(ranks) < 2:
            continue
        entries = {t.rank: t.entries(kind) for t in ranks}
        longest = max(len(e) for e in entries.values())
        for k in range(longest):
            words = _diverges_at(k, ranks, entries)
            if words is not None:
                found.append(words)
                break
    return min(found)[2] if found else None


def _diverges_at(k: int, ranks: list[RankTrace], entries: dict) -> tuple[int, int, str] | None:
    have = [t for t in ranks if len(entries[t.rank]) > k]
    first = min(have, key=lambda t: (entries[t.rank][k][1]["step"], t.rank))
    ref = entries[first.rank][k][1]
    step, head = ref["step"], f"step {ref['step']}: rank {first.rank} {describe(ref)} vs rank"
    for other in ranks:
        if other is first:
            continue
        if len(entries[other.rank]) <= k:
            why = other.why_not(step)
            if why is not None:
                return step, k, f"{head} {other.rank} {why}"
            continue
        other_pos, theirs = entries[other.rank][k]
        if _same(ref, theirs):
            continue
        if theirs["step"] > step and other.finished_before(step, other_pos):
            why = f"nothing (finished step {step} without it)"
        elif theirs["step"] != step:
            why = f"{describe(theirs)} of step {theirs['step']}"
        else:
            why = describe(theirs)
        return step, k, f"{head} {other.rank} {why}"
    return None


# -- the ranks ----------------------------------------------------------------------------------


def join(spec: dict) -> str:
    """In a rank: join the process group of `spec` (rank, world_size, store, pg_timeout_s);
    returns the backend. Called by harness.child.run before the scenario function."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    n, rank = spec["world_size"], spec["rank"]
    backend = "gloo"
    if spec["device"] == "cuda":
        if torch.cuda.device_count() >= n:
            backend = "nccl"  # one GPU per rank
            torch.cuda.set_device(rank)
        else:  # ranks share GPUs (rank r on GPU r mod count): NCCL refuses, gloo carries them
            torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.FileStore(spec["store"], n)
    timeout = timedelta(seconds=spec["pg_timeout_s"])
    dist.init_process_group(backend, store=store, rank=rank, world_size=n, timeout=timeout)
    # No rank leaves before every rank has joined: one that returned from init_process_group
    # and left at once (a scenario with nothing to do with its peers) closed its connections
    # while a peer was still making them, which failed that peer ("Gloo connectFullMesh
    # failed ... Connection closed by peer": torch no longer ends init_process_group with a
    # barrier). On the 2-CPU VM under load, two ranks of tests.children:passes: 2 of 100 runs
    # `error` without this, 0 of 200 with it (2026-11-28)
    store.set(f"joined/{rank}", "1")
    store.wait([f"joined/{r}" for r in range(n)], timeout)
    print(f"rank {rank} of {n}: torch.distributed {backend} on {spec['device']}", flush=True)
    return backend


class _Forked:
    """A rank forked from the coordinator, with the part of subprocess.Popen's face the
    coordinator uses (poll, kill, pid, returncode)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)


def _may_fork(spec: dict) -> bool:
    """A rank may be a fork of this coordinator (about 0.1 s, against an interpreter that
    imports torch: seconds) where the coordinator is a warm child that has torch imported and
    no CUDA context (a context does not survive a fork), and no tool wraps the run."""
    torch = sys.modules.get("torch")
    if torch is None or spec.get("sanitizer") or os.environ.get("REPRO_ISOLATION") == "spawn":
        return False
    return spec["device"] == "cpu" or not torch.cuda.is_initialized()


def _fork(rank_request: dict, log: Path, env: dict[str, str], rank_main: RankMain) -> _Forked:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return _Forked(pid)
    try:
        enter_rank(str(log), env)
        rank_main(json.dumps(rank_request))
    finally:
        os._exit(70)  # main never returns; an exception before it: the rank failed


def enter_rank(log: str, env: dict[str, str]) -> None:
    """The start of a rank process, forked here or a rank spare (harness.forkserver): its
    output to its log, no input, the loopback environment, the coordinator's SIGUSR1 handler
    undone."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(fd)
    os.close(null)
    os.environ.update(env)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)


@dataclass(eq=False, slots=True)
class _Rank:
    rank: int
    proc: subprocess.Popen | _Forked
    log: Path
    report: Path
    trace: Path
    returncode: int | None = None  # 0 once its report is written: it leaves through os._exit(0)
    leaving: bool = False  # its report written, its exit not seen yet


def _hand_over(spare: list[int], rank_request: dict, log: Path, env: dict[str, str]) -> bool:
    """Give a rank spare (a child of this coordinator with its context made ahead: a warm cuda
    server's, harness.forkserver's _rank_spare_main reads this) its rank's request; False
    when it died meanwhile. Its pipe is closed either way. (The server imports this module:
    a tree whose copy differs replaces the server, so writer and reader always agree.)"""
    message = {"root": str(ROOT), "log": str(log), "env": env, "request": rank_request}
    return lifetime.hand_over(spare[1], message)


def _spawn(
    request: dict,
    spec: dict,
    rank: int,
    n: int,
    directory: Path,
    rank_main: RankMain,
    spare: list[int] | None = None,
) -> _Rank:
    paths = {
        "log": directory / f"rank-{rank}.log",
        "report": directory / f"rank-{rank}.json",
        "trace": directory / f"trace-{rank}.jsonl",
    }
    rank_spec = {k: v for k, v in spec.items() if k != "ranks"}
    rank_spec.update(
        rank=rank,
        world_size=n,
        store=str(directory / "store"),
        trace=str(paths["trace"]),
        pg_timeout_s=request["timeout_s"] + PG_TIMEOUT_GRACE_S,
    )
    rank_request = {
        "spec": rank_spec,
        "report": str(paths["report"]),
        "log": str(paths["log"]),
        "timeout_s": request["timeout_s"],
        "coordinator": os.getpid(),
    }
    loopback = {name: os.environ.get(name, "lo") for name in SOCKET_ENV}  # loopback only
    if spare is not None and _hand_over(spare, rank_request, paths["log"], loopback):
        return _Rank(rank, _Forked(spare[0]), paths["log"], paths["report"], paths["trace"])
    if _may_fork(spec):
        proc = _fork(rank_request, paths["log"], loopback, rank_main)
        return _Rank(rank, proc, paths["log"], paths["report"], paths["trace"])
    env = {**os.environ, **loopback}
    coordinator = os.getpid()
    with open(paths["log"], "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", RANK_BOOT, str(ROOT), json.dumps(rank_request)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=lambda: lifetime.die_with_parent(coordinator),  # the run's group kept
        )
    return _Rank(rank, proc, paths["log"], paths["report"], paths["trace"])


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _log(rank: _Rank) -> str:
    try:
        return rank.log.read_text(errors="replace")
    except OSError:
        return ""


class _Coordinator:
    def __init__(self, request: dict, rank_main: RankMain) -> None:
        self.rank_main = rank_main
        self.request, self.spec = request, request["spec"]
        self.n = int(self.spec["ranks"])
        self.directory = Path(request["report"]).parent / "ranks"
        self.ranks: list[_Rank] = []
        self.order: list[int] = []  # ranks in the order their exits were seen

    def run(self) -> dict:
        spares = self._spares()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            faulthandler.unregister(signal.SIGUSR1)
            signal.signal(signal.SIGUSR1, self._dump_stacks)
            for rank in range(self.n):
                args = (self.request, self.spec, rank, self.n, self.directory, self.rank_main)
                self.ranks.append(_spawn(*args, spare=spares.pop(0) if spares else None))
            return self._watch()
        finally:  # the ranks still running are killed, not waited for (`reap`, after the report)
            lifetime.let_go(spares, 0.0)  # any not handed over (the run broke first)
            self._kill_all()
            self._print_logs()

    def _spares(self) -> list[list[int]]:
        """The rank spares this coordinator was made with (a warm cuda server's: each rank's
        context made ahead), where they fit this run: one per rank, and a rank may be a fork
        (no tool wraps the run). Any that do not fit are let go (EOF: each exits)."""
        spares = self.request.get(RANK_SPARES) or []
        if len(spares) == self.n and _may_fork(self.spec):
            return list(spares)
        lifetime.let_go(spares, 0.0)
        return []

    def _watch(self) -> dict:
        failed_at = None
        while True:
            self._reap()
            traces = self._traces()
            mismatch = first_divergence(traces)
            if mismatch is not None and failed_at is None:
                return self._mismatch(mismatch)
            failed = [r for r in self._exited() if not self._passed(r)]
            if failed and failed_at is None:
                failed_at = time.monotonic()
            done = all(r.returncode is not None for r in self.ranks)
            cause = min(failed, key=self._cause_first) if failed else None
            # a failure that is no lost peer is the cause already (no rank exiting later can
            # come before it); only an effect waits for its cause, CAUSE_WAIT_S at most
            final = cause is not None and not self._cause_first(cause)[0]
            if failed and (done or final or time.monotonic() - failed_at > CAUSE_WAIT_S):
                return self._failed(cause)
            if done:
                return self._passed_all()
            time.sleep(POLL_S)

    def _reap(self) -> None:
        for r in self.ranks:
            if r.returncode is not None:
                continue
            if r.proc.poll() is not None:
                r.returncode = r.proc.returncode
            elif r.report.exists():  # written last, atomically: the rank is done, and leaving
                r.returncode, r.leaving = 0, True
            else:
                continue
            self.order.append(r.rank)

    def _cause_first(self, rank: _Rank) -> tuple[bool, int]:
        """A failed rank's place in the choice of the run's outcome: a rank whose collective
        lost its peer (the backend's connection reset or closed by a rank that died) shows an
        effect, whichever exited first; among the others, the first to exit is the cause."""
        report = _read_json(rank.report) or {}
        lost = report.get("status") == "exception" and PEER_LOST.search(report.get("message", ""))
        return (bool(lost), self.order.index(rank.rank))

    def _exited(self) -> list[_Rank]:
        return [self.ranks[i] for i in self.order]

    def _passed(self, rank: _Rank) -> bool:
        report = _read_json(rank.report)
        return rank.returncode == 0 and report is not None and report.get("status") == "pass"

    def _traces(self) -> list[RankTrace]:
        traces = []
        for r in self.ranks:
            trace = read_trace(r.trace, r.rank)
            trace.exited = r.returncode is not None and self._passed(r)
            traces.append(trace)
        return traces

    def _states(self) -> str:
        """Where each rank was when the coordinator decided."""
        lines = []
        for r in self.ranks:
            if r.returncode is None:
                state = "running (killed by the coordinator)"
            elif r.leaving:
                status = (_read_json(r.report) or {}).get("status", "no report")
                state = f"done ({status})"
            elif r.returncode < 0:
                state = f"killed by {signal.Signals(-r.returncode).name}"
            else:
                status = (_read_json(r.report) or {}).get("status", "no report")
                state = f"exited {r.returncode} ({status})"
            lines.append(f"rank {r.rank}: {state}")
        return "\n".join(lines)

    def _mismatch(self, words: str) -> dict:
        states = self._states()
        return {"status": "ranks", "outcome": "collective_mismatch", "detail": f"{words}\n{states}"}

    def _failed(self, rank: _Rank) -> dict:
        child = ChildExit(rank.returncode, False, _read_json(rank.report), _log(rank))
        verdict = classify(child)
        if verdict.outcome == Outcome.SKIPPED:
            return {"status": "skipped", "detail": f"rank {rank.rank}: {verdict.evidence}"}
        detail = f"rank {rank.rank}: {verdict.outcome.value}: {verdict.evidence}\n{self._states()}"
        return {"status": "ranks", "outcome": verdict.outcome.value, "detail": detail}

    def _passed_all(self) -> dict:
        reports = [_read_json(r.report) or {} for r in self.ranks]
        backend = next(
            (line for line in _log(self.ranks[0]).splitlines() if "torch.distributed" in line),
            "",
        )
        details = "; ".join(
            f"rank {r.rank}: {rep.get('detail', '')}"
            for r, rep in zip(self.ranks, reports, strict=True)
        )
        backend = backend.split(": ", 1)[-1]
        return {"status": "pass", "detail": f"{self.n} ranks, {backend}: {details}"}

    def _kill_all(self) -> None:
        for r in self.ranks:
            if r.returncode is None and r.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    r.proc.kill()

    def _print_logs(self) -> None:
        """Each rank's log, kept in the run's output."""
        for r in self.ranks:
            print(f"=== rank {r.rank} log ===\n{_log(r).rstrip()}", file=sys.stderr, flush=True)

    def _dump_stacks(self, signum, frame) -> None:
        """The parent's request for stacks (a run at its limit): every live rank's, then this
        coordinator's own."""
        sizes = {}
        for r in self.ranks:
            if r.proc.poll() is None:
                sizes[r.rank] = r.log.stat().st_size if r.log.exists() else 0
                with contextlib.suppress(ProcessLookupError):
                    os.kill(r.proc.pid, signal.SIGUSR1)
        time.sleep(DUMP_WAIT_S)
        for r in self.ranks:
            if r.rank in sizes:
                with open(r.log, "rb") as f:
                    f.seek(sizes[r.rank])
                    dumped = f.read().decode(errors="replace")
                print(f"=== rank {r.rank} stacks ===\n{dumped.rstrip()}", file=sys.stderr)
        print("=== coordinator stack ===", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)


def reap(timeout_s: float = REAP_S) -> None:
    """In the coordinator, after its report: wait for every rank's exit (each leaving or
    killed), at most `timeout_s`; one still stuck in the driver dies with the coordinator."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # none left
            return
        if pid == 0:
            if time.monotonic() > deadline:
                return
            time.sleep(POLL_S)


def coordinate(
    request: dict, started: float, timings: dict[str, float], rank_main: RankMain
) -> dict:
    """In the scenario child: run the request's ranks, return the run's report. `rank_main`
    (harness.child.spawned_rank) is a forked rank's entry point; a spawned one names it."""
    timings["startup_s"] = time.monotonic() - started
    try:
        return _Coordinator(request, rank_main).run()
    except Exception as e:  # the coordinator itself broke: cannot test
        import traceback

        traceback.print_exc()
        return {
            "status": "exception",
            "type": type(e).__name__,
            "message": str(e),
            "origin": "scenario",
            "where": "harness/ranks.py (the coordinator)",
        }
