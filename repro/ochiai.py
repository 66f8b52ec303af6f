"""A fault-localization baseline anyone can run on a checkout (README: For tool builders).

Spectrum-based ranking: run failing and passing scenarios in a buggy tree, each in its own
process under `sys.settrace` (Triton's interpreter runs the kernels as Python, so kernel lines
count too), and rank every executed line of `harness/runner/` and `kernels/` by Ochiai,
failed(line) / sqrt(total failed x (failed(line) + passed(line))). With `--truth FILE` (the
output of `repro export BUG fix.buggy_lines`) it prints the best rank a fix line reaches.

    repro checkout kv_block_stale_nan --variant buggy /tmp/b
    repro export kv_block_stale_nan fix.buggy_lines > /tmp/truth
    cd /tmp/b && python -m repro.ochiai --truth /tmp/truth \\
        --fail kv_block_stale_nan:recycled_state_block --pass kernel_block_size:SCENARIO
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path.cwd()
TRACED = ("harness/runner/", "kernels/")


def trace(target: str) -> None:
    """In a child: run one scenario (`bug:scenario`, all fixes on) and print its lines."""
    sys.path.insert(0, str(ROOT))
    from harness import device
    from harness.child import run
    from harness.fixes import ALL_FIXES
    from repro import registry

    device.activate("cpu")
    bug_id, name = target.split(":")
    bug = registry.get(bug_id)
    spec = {
        "target": bug.target(bug.scenario(name)),
        "fixes": [f.value for f in ALL_FIXES],
        "device": "cpu",
        "seed": 0,
    }
    seen: set[tuple[str, int]] = set()
    wanted = {str(ROOT / d) for d in TRACED}

    def tracer(frame, event, arg):
        path = frame.f_code.co_filename
        if not any(path.startswith(w) for w in wanted):
            return None
        if event == "line":
            seen.add((path, frame.f_lineno))
        return tracer

    sys.settrace(tracer)
    report = run(spec, time.monotonic(), {})
    sys.settrace(None)
    lines = sorted(f"{Path(p).relative_to(ROOT)}:{n}" for p, n in seen)
    print(json.dumps({"status": report["status"], "lines": lines}))


def spectrum(target: str) -> tuple[str, set[str]]:
    proc = subprocess.run(
        [sys.executable, "-m", "repro.ochiai", "--trace", target],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["status"], set(out["lines"])


def _ranks(target: str) -> int | None:
    """The world size of BUG:SCENARIO's scenario; None where the records know no such one."""
    from harness.fixes import UsageError
    from repro import registry

    bug, _, name = target.partition(":")
    try:
        return registry.get(bug).scenario(name).ranks
    except (UsageError, KeyError):
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", help=argparse.SUPPRESS)
    p.add_argument("--fail", action="append", default=[], metavar="BUG:SCENARIO")
    p.add_argument("--pass", dest="passing", action="append", default=[], metavar="BUG:SCENARIO")
    p.add_argument("--truth", help="path:line per line (repro export BUG fix.buggy_lines)")
    p.add_argument("--top", type=int, default=10)
    args = p.parse_args()
    if args.trace:
        trace(args.trace)
        return
    for target in args.fail + args.passing:
        ranks = _ranks(target)
        if ranks is None:
            p.error(f"{target}: no such BUG:SCENARIO (repro info BUG lists its scenarios)")
        if ranks > 1:  # one traced process cannot stand for N ranks
            p.error(f"{target} runs as {ranks} ranks; this baseline traces one process")
    failed, passed = [], []
    for target in args.fail + args.passing:
        status, lines = spectrum(target)
        (passed if status == "pass" else failed).append(lines)
        print(f"{target}: {status}, {len(lines)} lines")
    lines = set().union(*failed, *passed)
    score = {
        line: sum(line in f for f in failed)
        / math.sqrt(len(failed) * (sum(line in f for f in failed) + sum(line in q for q in passed)))
        for line in lines
        if failed and any(line in f for f in failed)
    }
    ranked = sorted(score, key=lambda line: (-score[line], line))
    for i, line in enumerate(ranked[: args.top], 1):
        print(f"{i:>3} {score[line]:.3f} {line}")
    if args.truth:
        truth = set(Path(args.truth).read_text().split())
        ranks = [ranked.index(t) + 1 for t in truth if t in score]
        tied = {score[ranked[r - 1]] for r in ranks}
        best = min(ranks) if ranks else None
        ties = sum(score[line] in tied for line in ranked) if ranks else 0
        print(f"fix lines: {len(truth)}; best rank {best} of {len(ranked)} ({ties} lines tied)")


if __name__ == "__main__":
    main()
