"""`repro checkout BUG --variant buggy|fixed DIR`: the bug as code, a standalone tree.

The tree is this project's files (git's tracked and unignored ones) with the bug's switches
folded by repro/fold.py: the fixed tree holds the fix as plain code, the buggy one lacks it,
and neither holds a switch of that bug in kernels/, harness/runner/ or csrc/ (other bugs'
switches stay, all on). `diff -r` of the two trees is the fix. `--without PART` folds that
part off and the bug's others on. Exit: 0 written, 2 usage (unknown bug or part, DIR not
empty or not writable), 125 the fold failed or left a switch (named).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from harness.fixes import Fix, UsageError, parse_fix
from harness.outcome import EXIT_CANNOT_TEST
from harness.record import BugRecord
from harness.servers import ROOT
from repro import registry
from repro.common import writable_directory
from repro.fold import FoldError, fold_bug, leftovers, tree_paths


def add_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("checkout", help="write a standalone buggy or fixed tree of one bug")
    c.add_argument("bug")
    c.add_argument("--variant", choices=("fixed", "buggy"))
    c.add_argument(
        "--without", action="append", default=[], metavar="PART", help="fixed, less PART"
    )
    c.add_argument("dir", help="an empty or new directory")
    c.set_defaults(run=cmd_checkout)


def values(bug: BugRecord, variant: str, without: list[str] = ()) -> dict[Fix, bool]:
    """{part: on?} for the bug's parts (a usage error names a part of another bug)."""
    off = {parse_fix(name) for name in without}
    foreign = off - set(bug.fix_parts)
    if foreign:
        own = ", ".join(p.value for p in bug.fix_parts)
        names = ", ".join(sorted(p.value for p in foreign))
        raise UsageError(f"--without {names}: not a part of {bug.id} (its parts: {own})")
    if off and variant != "fixed":
        raise UsageError("--without PART takes the fixed tree less PART: drop --variant buggy")
    return {p: variant == "fixed" and p not in off for p in bug.fix_parts}


def cmd_checkout(args: argparse.Namespace) -> int:
    bug = registry.get(args.bug)
    if not (args.variant or args.without):
        raise UsageError("checkout needs --variant fixed|buggy or --without PART")
    variant = "fixed" if args.without else args.variant
    vals = values(bug, variant, args.without)
    target = Path(args.dir)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UsageError(f"{args.dir}: exists and is not an empty directory")
    writable_directory(args.dir)
    try:
        changed = fold_bug(ROOT, bug, vals)
    except FoldError as e:
        print(f"checkout: cannot fold {bug.id}: {e}", file=sys.stderr)
        return EXIT_CANNOT_TEST
    left = leftovers(ROOT, bug, changed)
    write(ROOT, target, changed)
    label = f"without {','.join(args.without)}" if args.without else variant
    print(f"{bug.id} {label}: {target} ({len(changed)} files folded)")
    if left:
        print(f"checkout: {bug.id}'s switch left at {', '.join(left)}", file=sys.stderr)
        return EXIT_CANNOT_TEST
    return 0


def write(root: Path, target: Path, changed: dict[str, str]) -> None:
    for path in tree_paths(root):
        dest = target / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        if path in changed:
            dest.write_text(changed[path])
            shutil.copymode(root / path, dest)
        elif not os.path.islink(root / path):
            shutil.copy2(root / path, dest)
