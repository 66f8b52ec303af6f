"""The `repro` command's entry point: exit codes that mean one thing to git bisect and to CI.

This module imports only the standard library, so that a tree whose project modules do not
import still gets a verdict (125, cannot test) instead of a traceback (which git reads as "bad").
The commands are in repro.commands; nothing here or there imports torch: scenarios run in
children (harness.isolate).
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Sequence

EXIT_USAGE, EXIT_CANNOT_TEST, EXIT_INTERRUPTED = 2, 125, 130


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: Sequence[str] | None = None) -> None:
    """`repro ...`; exits with the command's code (see `repro check --help`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a runner's cleanup stops us like Ctrl-C
        signal.signal(sig, _interrupt)
    try:
        from repro import commands
    except (ImportError, SyntaxError) as e:
        where = traceback.extract_tb(e.__traceback__)[-1]
        print(
            f"repro: cannot test: the project does not import: {type(e).__name__}: {e}\n"
            f"    at {where.filename}:{where.lineno}",
            file=sys.stderr,
        )
        sys.exit(EXIT_CANNOT_TEST)
    try:
        code = commands.dispatch(argv)
        sys.stdout.flush()
    except BrokenPipeError:  # `repro info BUG | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)


def run_alone(bug_id: str) -> None:
    """`python -m repro.<bug> [matrix options]`: its fixed and buggy variants side by side."""
    main(["matrix", "--bug", bug_id, *sys.argv[1:]])


if __name__ == "__main__":
    main()
