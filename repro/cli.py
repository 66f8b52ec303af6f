"""The `repro` command's entry point: exit codes that mean one thing to git bisect and to CI.

This module imports only the standard library. It is a guard around the command: `main` forks,
the child imports the project and runs the command, and writes its verdict (the exit code) on a
pipe as its last act. The parent imports nothing of the project; it forwards SIGTERM and SIGHUP
to the child and exits with the verdict. A child that ends without one (an exit or an
interrupt raised while a module was imported, `os._exit`, a signal) exits 125, with one line
naming how and where: a tree whose project modules exit at import can never pass for good or
bad. Whatever else goes wrong in the command itself exits 125 with one line; its traceback goes
to a log file in the user's directory (harness.userdir), the newest CRASH_LOGS kept.

The tree under test is the working directory's: run inside a checkout of this project other than
the one this module comes from (an installed command, a bisect in a second clone), the child runs
that checkout's own entry point instead, as `python -m repro` there would, under the same guard.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

EXIT_USAGE, EXIT_CANNOT_TEST, EXIT_INTERRUPTED = 2, 125, 130
ROOT = Path(__file__).resolve().parent.parent
PROJECT = 'name = "gpu-repro"'  # pyproject.toml of a checkout of this project
PROJECT_PACKAGES = ("harness", "kernels", "repro", "tests")
ENV_FROM = "REPRO_RUN_FROM"  # set when another tree's command handed over to this one
ENV_VERDICT = "REPRO_VERDICT_FD"  # the guard's pipe: this process runs the command itself
VERDICT_PROTOCOL = 1  # a handed-over tree that has it writes its own verdict
CRASH_LOGS = 20  # crash logs kept in the user's directory
AFTER_VERDICT_S = 10.0  # a child that gave its verdict but does not exit is killed then
# Runs the entry point of the tree in argv[1] under the guard's pipe (argv[2]); anything that
# stops it from starting is a verdict of 125. A tree older than the guard exits with its code.
HANDOVER = """
import os, sys
root, fd = sys.argv[1], int(sys.argv[2])
sys.path[:] = [root, *(p for p in sys.path[1:] if p)]
def verdict(code):
    os.write(fd, f"verdict {code}\\n".encode())
    sys.exit(code)
try:
    import repro.cli as cli
except BaseException as e:
    print(f"repro: cannot test: the project in {root} does not import: {type(e).__name__}: {e}",
          file=sys.stderr)
    verdict(125)
if getattr(cli, "VERDICT_PROTOCOL", None):
    os.environ["REPRO_VERDICT_FD"] = str(fd)
    cli.main(sys.argv[3:])
try:
    cli.main(sys.argv[3:])
except SystemExit as e:
    verdict(e.code if isinstance(e.code, int) else 125)
"""


def checkout_of(directory: Path) -> Path | None:
    """The checkout of this project that holds `directory`, if any."""
    for candidate in (directory, *directory.parents):
        try:
            if (
                PROJECT in (candidate / "pyproject.toml").read_text()
                and (candidate / "repro").is_dir()
            ):
                return candidate.resolve()
        except OSError:
            continue
    return None


def main(argv: Sequence[str] | None = None) -> None:
    """`repro ...`; exits with the command's verdict (see `repro check --help`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    fd = os.environ.pop(ENV_VERDICT, "")
    if fd.isdigit():  # the guard's child (handed over): run the command here
        _command(argv, int(fd))
    _standard_streams()
    code = _guard(argv)
    with contextlib.suppress(OSError):
        sys.stdout.flush()
    os._exit(code)


# -- the guard (the parent) -----------------------------------------------------------------------


def _standard_streams() -> None:
    """Descriptors 0-2 open (on /dev/null if closed: `repro check BUG >&-`), so that no file or
    socket the command opens later takes their place, and sys.stdout/stderr usable."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if sys.stdout is None:
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115  # lives as long as the process
    if sys.stderr is None:
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115


def _guard(argv: list[str]) -> int:
    """Run the command in a child; its verdict, or 125 and one line when it gave none."""
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        _child(argv, write)
    os.close(write)

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the child from the terminal
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    lines, status = _collect(read, pid)
    verdicts = [line for line in lines if line.startswith("verdict ")]
    if verdicts:
        return int(verdicts[-1].split()[1])
    print(
        f"repro: cannot test: the command ended without its verdict: {_how(lines, status)}",
        file=sys.stderr,
    )
    return EXIT_CANNOT_TEST


def _collect(read: int, pid: int) -> tuple[list[str], int]:
    """The child's lines on the pipe and its wait status, once it exited (killed when it gave
    its verdict and still runs AFTER_VERDICT_S later: a hung interpreter teardown)."""
    pidfd, data, deadline = os.pidfd_open(pid), b"", None
    watched = [read, pidfd]
    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = select.select(watched, [], [], timeout)[0]
        if read in ready:
            chunk = os.read(read, 1 << 16)
            data += chunk
            if not chunk:
                watched.remove(read)
        if pidfd in ready:
            break
        if deadline is None and b"verdict " in data:
            deadline = time.monotonic() + AFTER_VERDICT_S
        elif deadline is not None and time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
            deadline = math.inf
    if read in watched:  # what it wrote before it exited (a descendant may hold the pipe)
        os.set_blocking(read, False)
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(read, 1 << 16):
                data += chunk
    os.close(read)
    os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    return data.decode(errors="replace").splitlines(), status


def _how(lines: list[str], status: int) -> str:
    """How a child without a verdict ended, and where (its own last word, else its status)."""
    ended = [line.removeprefix("ended ") for line in lines if line.startswith("ended ")]
    if ended:
        return ended[-1]
    if os.WIFSIGNALED(status):
        how = f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    else:
        how = f"exit status {os.waitstatus_to_exitcode(status)}"
    imported = [line.removeprefix("import ") for line in lines if line.startswith("import ")]
    began = f" (the last project module it began to import: {imported[-1]})" if imported else ""
    return how + began


# -- the command (the child) ----------------------------------------------------------------------


def _child(argv: list[str], fd: int) -> None:
    """In the forked child: tied to the guard, then the command."""
    _die_with_parent()
    _command(argv, fd)


def _die_with_parent() -> None:
    """SIGTERM (an interrupt: the command cleans up) when the guard dies."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(EXIT_CANNOT_TEST)


def _hand_over(tree: Path, argv: list[str], fd: int) -> None:
    """Run the working directory's checkout (never returns)."""
    if os.environ.get(ENV_FROM):  # handed over once already and still not there: refuse
        print(
            f"repro: cannot test: the working directory is in {tree}, but this command runs {ROOT}",
            file=sys.stderr,
        )
        _say(fd, f"verdict {EXIT_CANNOT_TEST}")
        os._exit(EXIT_CANNOT_TEST)
    print(f"repro: testing {tree} (the working directory's checkout)", file=sys.stderr)
    sys.stderr.flush()
    os.environ[ENV_FROM] = str(ROOT)
    os.set_inheritable(fd, True)
    os.execv(sys.executable, [sys.executable, "-c", HANDOVER, str(tree), str(fd), *argv])


def _say(fd: int, line: str) -> None:
    with contextlib.suppress(OSError):  # the guard is gone
        os.write(fd, (line + "\n").encode())


class _ImportTrace:
    """A meta path finder that finds nothing: it tells the guard which project module is being
    imported, so that a child killed while importing names it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.partition(".")[0] in PROJECT_PACKAGES:
            _say(self.fd, f"import {name}")


def _shown(filename: str) -> str:
    path = Path(filename).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def _ended(error: BaseException) -> str:
    """`Type(args) raised at FILE:LINE` of an exception that ended the command unanswered."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    what = f"{type(error).__name__}({', '.join(map(repr, error.args))})"
    if not frames:
        return f"{what} raised"
    at = frames[-1]
    importing = [f for f in frames if f.name == "<module>"]
    where = f" (while importing {_shown(importing[-1].filename)})" if importing else ""
    return f"{what} raised at {_shown(at.filename)}:{at.lineno}{where}"


def _command(argv: list[str], fd: int) -> None:
    """Import the project (this tree's, or the working directory's checkout's), run the
    command, write the verdict; never returns."""
    try:
        tree = checkout_of(Path.cwd())
    except OSError:  # the working directory was removed
        tree = None
    if tree is not None and tree != ROOT:
        _hand_over(tree, argv, fd)
    os.set_inheritable(fd, False)
    os.environ.pop(ENV_FROM, None)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if p and Path(p).resolve() != ROOT)]
    sys.stdout = _Stdout(sys.stdout)
    interrupted: list[int] = []

    def interrupt(signum: int, frame: object) -> None:
        if not interrupted:  # once: a second signal must not break the cleanup of the first
            interrupted.append(signum)
            raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a runner's cleanup: Ctrl-C
        signal.signal(sig, interrupt)
    real_exit = os._exit

    def traced_exit(code: int) -> None:  # os._exit from the project: named, then done
        caller = sys._getframe(1)
        _say(
            fd,
            f"ended os._exit({code}) called at {_shown(caller.f_code.co_filename)}:"
            f"{caller.f_lineno}",
        )
        real_exit(code)

    os._exit = traced_exit
    sys.meta_path.insert(0, _ImportTrace(fd))
    try:
        code = _run(argv, lambda: bool(interrupted))
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException as e:  # SystemExit, KeyboardInterrupt raised by code: no verdict
        _say(fd, f"ended {_ended(e)}")
        real_exit(EXIT_CANNOT_TEST)
    _say(fd, f"verdict {code}")
    sys.exit(code)


def _run(argv: list[str], signalled) -> int:
    try:
        from repro import commands
    except Exception:
        return _crashed("the project does not import")
    try:
        return commands.dispatch(argv, signalled)
    except Exception:
        return _crashed("the repro command broke")


class _Stdout:
    """sys.stdout that outlives its reader (`repro check BUG | head -1`): once the pipe is
    closed, output goes nowhere and the command carries on to its own exit code."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def _gone(self) -> None:
        os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
        self._stream = open(os.devnull, "w")  # noqa: SIM115  # lives as long as the process

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _crashed(what: str) -> int:
    """The command itself broke: one line, the traceback in a log file."""
    import traceback

    kind, error, _ = sys.exc_info()
    log = _crash_log(traceback.format_exc())
    where = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    at = f" at {where.filename}:{where.lineno}" if where else ""
    print(
        f"repro: cannot test: {what}: {kind.__name__}: {error}{at} (traceback: {log})",
        file=sys.stderr,
    )
    return EXIT_CANNOT_TEST


def _crash_log(text: str) -> str:
    """Write `text` to a new crash log: in the user's directory (the oldest removed past
    CRASH_LOGS), else in the temp directory when that cannot be used."""
    import tempfile

    try:
        from harness.userdir import UserDirectory

        with UserDirectory.open() as directory:
            crashes = directory.path / "crashes"
            crashes.mkdir(mode=0o700, exist_ok=True)
            for old in sorted(crashes.iterdir(), key=lambda p: p.stat().st_mtime)[: 1 - CRASH_LOGS]:
                old.unlink(missing_ok=True)
            where = str(crashes)
    except Exception:
        where = None
    fd, log = tempfile.mkstemp(prefix="repro-crash-", suffix=".log", dir=where)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return log


if __name__ == "__main__":
    main()
