"""The `repro` command line: one parser over the subcommands, each in its own module (list and
info in repro.info, run and check in repro.check, then matrix, fuzz, detectors, mutants, serve,
bench, report and diff), which register their arguments and function. Nothing imports this
module but repro.cli: the subcommands share only repro.common, below them.

Every argument and environment variable is checked before anything heavy starts (no torch in
this process, ever: the fork server and the children import it).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from harness.fixes import UsageError
from harness.outcome import EXIT_CANNOT_TEST, EXIT_INTERRUPTED, EXIT_USAGE
from repro import (
    bench,
    check,
    checkout,
    detectors,
    export,
    fuzz,
    info,
    matrix,
    mutants,
    report,
    serve,
)
from repro.common import check_environment, time_limit

# the modules that register subcommands, in the order --help lists them (imported here, so that
# a tree whose modules or records do not import is told apart from a command that breaks)
SUBCOMMANDS = (
    info,
    check,
    matrix,
    fuzz,
    detectors,
    mutants,
    serve,
    bench,
    report,
    checkout,
    export,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 too; keep our wording
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="repro", description="Reproducers for GPU inference-engine bugs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


def dispatch(argv: Sequence[str], signalled: Callable[[], bool] = lambda: True) -> int:
    """Parse, check and run one command; its exit code (usage errors: 2). A KeyboardInterrupt
    is an interrupt only when `signalled()` says a signal made it (Ctrl-C, SIGTERM); one raised
    by code (a module that raises it at import) goes on up: it is no verdict."""
    command = None
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # --help printed: argparse's exit is the verdict
            return e.code if isinstance(e.code, int) else EXIT_USAGE
        command = args.command
        check_environment()
        time_limit(args)
        return args.run(args)
    except UsageError as e:
        print(f"repro: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        if not signalled():
            raise
        print("repro: interrupted", file=sys.stderr)
        return (
            EXIT_INTERRUPTED if command in ("matrix", "mutants", "detectors") else EXIT_CANNOT_TEST
        )
