"""`repro list` and `repro info`: the catalogue's records, read without torch."""

from __future__ import annotations

import argparse

from repro import registry
from repro.common import print_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("list", help="table of registered bugs").set_defaults(run=cmd_list)
    info = sub.add_parser("info", help="the full record of one bug")
    info.add_argument("bug")
    info.set_defaults(run=cmd_info)


def cmd_list(args: argparse.Namespace) -> int:
    rows = [("id", "upstream", "fix parts", "buggy (cpu)", "buggy (cuda)")]
    for bug in registry.BUGS:
        rows.append(
            (
                bug.id,
                "#" + bug.upstream.rsplit("/", 1)[-1],
                ", ".join(f.value for f in bug.fix_parts),
                bug.buggy_outcome.cpu.value,
                bug.buggy_outcome.cuda.value,
            )
        )
    print_table(rows)
    histories = [bug for bug in registry.BUGS if bug.history]
    if histories:
        print("\nhistory:")
    for bug in histories:
        print(f"  {bug.id}: {bug.history}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    bug = registry.get(args.bug)
    print(f"{bug.id}: {bug.title}\nupstream:   {bug.upstream}\nsymptom:    {bug.symptom}")
    print(f"root cause: {bug.root_cause}\ntrigger:    {bug.trigger}")
    print(f"buggy:      cpu {bug.buggy_outcome.cpu.value}, cuda {bug.buggy_outcome.cuda.value}")
    print("fix parts:  (see each with git grep -n 'fix: PART'; upstream: where it sits there)")
    anchors = dict(bug.anchors)
    for part in bug.fix_parts:
        print(f"  {part.value}" + (f"\n    upstream: {anchors[part]}" if part in anchors else ""))
    if bug.history:
        print(f"history:    {bug.history}")
    docs = bug.docs()
    for s in bug.scenarios:
        print(f"\nscenario {s.name}  (repro run {bug.id} --scenario {s.name})")
        print("  " + docs[s.name].replace("\n", "\n  "))
        for line in s.axes.lines():
            print(f"  axis {line}")
        for rule in s.expects:
            parts = " or ".join(sorted(f.value for f in rule.missing))
            why = f"  ({rule.why})" if rule.why else ""
            print(
                f"  without {parts}: cpu {rule.outcome.cpu.value}, "
                f"cuda {rule.outcome.cuda.value}{why}"
            )
    return 0
