"""The `repro` command's entry point: exit codes that mean one thing to git bisect and to CI.

This module imports only the standard library, so that a tree whose project modules do not
import still gets a verdict (125, cannot test) instead of a traceback (which git reads as "bad").
The commands are in repro.commands; nothing here or there imports torch: scenarios run in
children (harness.isolate).

The tree under test is the working directory's: run inside a checkout of this project other than
the one this module comes from (an installed command, a bisect in a second clone), the command
runs that checkout's own entry point instead, as `python -m repro` there would. Whatever else
goes wrong in the command itself exits 125 with one line; its traceback goes to a log file.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path

EXIT_USAGE, EXIT_CANNOT_TEST, EXIT_INTERRUPTED = 2, 125, 130
ROOT = Path(__file__).resolve().parent.parent
PROJECT = 'name = "gpu-repro"'  # pyproject.toml of a checkout of this project
ENV_FROM = "REPRO_RUN_FROM"  # set when another tree's command handed over to this one
# Runs the entry point of the tree in argv[1]; anything that stops it from starting is 125.
HANDOVER = """
import sys
root = sys.argv[1]
sys.path[:] = [root, *(p for p in sys.path[1:] if p)]
try:
    from repro.cli import main
except BaseException as e:
    print(f"repro: cannot test: the project in {root} does not import: {type(e).__name__}: {e}",
          file=sys.stderr)
    sys.exit(125)
main(sys.argv[2:])
"""


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


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


def _hand_over(argv: list[str]) -> None:
    """Run the working directory's checkout when it is not this tree (never returns then)."""
    try:
        tree = checkout_of(Path.cwd())
    except OSError:  # the working directory was removed
        return
    if tree is None or tree == ROOT:
        return
    if os.environ.get(ENV_FROM):  # handed over once already and still not there: refuse
        print(
            f"repro: cannot test: the working directory is in {tree}, but this command runs {ROOT}",
            file=sys.stderr,
        )
        sys.exit(EXIT_CANNOT_TEST)
    print(f"repro: testing {tree} (the working directory's checkout)", file=sys.stderr)
    sys.stderr.flush()
    os.environ[ENV_FROM] = str(ROOT)
    os.execv(sys.executable, [sys.executable, "-c", HANDOVER, str(tree), *argv])


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
    kind, error, _ = sys.exc_info()
    fd, log = tempfile.mkstemp(prefix="repro-crash-", suffix=".log")
    with os.fdopen(fd, "w") as out:
        traceback.print_exc(file=out)
    where = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    at = f" at {where.filename}:{where.lineno}" if where else ""
    print(
        f"repro: cannot test: {what}: {kind.__name__}: {error}{at} (traceback: {log})",
        file=sys.stderr,
    )
    return EXIT_CANNOT_TEST


def main(argv: Sequence[str] | None = None) -> None:
    """`repro ...`; exits with the command's code (see `repro check --help`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _hand_over(argv)
    os.environ.pop(ENV_FROM, None)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if p and Path(p).resolve() != ROOT)]
    sys.stdout = _Stdout(sys.stdout)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a runner's cleanup stops us like Ctrl-C
        signal.signal(sig, _interrupt)
    try:
        from repro import commands
    except Exception:
        sys.exit(_crashed("the project does not import"))
    try:
        code = commands.dispatch(argv)
        sys.stdout.flush()
    except Exception:
        code = _crashed("the repro command broke")
    sys.exit(code)


def run_alone(bug_id: str) -> None:
    """`python -m repro.bugs.<bug> [matrix options]`: its fixed and buggy variants side by side."""
    main(["matrix", "--bug", bug_id, *sys.argv[1:]])


if __name__ == "__main__":
    main()
