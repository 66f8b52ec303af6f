"""`repro report` and `repro diff`: results documents (repro-results/1) for people.

    repro report FILE... [--markdown OUT] [--html OUT] [--junit OUT]
    repro diff A.json[,A2.json...] B.json[,B2.json...]

`report` prints a Markdown table (the job summary's, or the terminal's): one row per bug and
scenario, one column per variant and device, each cell the outcome(s) with a mark where it is not
the expected one; `--html` writes a self-contained page with the same grid in colour, each cell's
evidence on hover and on click, timings, and the provenance of every file. `diff` lists the runs
whose outcome changed between two documents (two commits, CPU vs GPU, two GPUs): exit 1 when any
did, 0 when none, 2 usage error. Runs are matched by bug, scenario, variant and seed, and by
device unless each file ran one device and they differ (CPU vs GPU). Several files (a sharded run's
parts, comma-separated in `diff`) are read as one.

`diff` of two `repro bench --json` files (repro-bench/1) names every figure that got more than
SLOWER times slower (and at least NOISE_S seconds), and exits 1 when any did: CI's warning step
against the last main run's bench. A bench of one part (`repro bench --shard K/N`) timed that
part's matrix: its matrix figures are compared with the same part's only.
"""

from __future__ import annotations

import argparse
import html
import json
from collections import defaultdict
from pathlib import Path

from harness.fixes import UsageError
from repro.common import BENCH_SCHEMA
from repro.results import SCHEMA_ID, LiveJunit, problem

SHARDED = ("matrix_each_part", "matrix_floor")  # a bench's figures of its --shard part
SLOWER = 1.5  # a figure this many times slower than before is named by `repro diff`
NOISE_S = 0.05  # ... when it also grew by at least this many seconds
OUTCOME_COLOURS = {"pass": "#cfe8cf", "skipped": "#e6e6e6"}  # failures: by expectation below


def add_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("report", help="Markdown and HTML views of results documents")
    r.add_argument("files", nargs="+", metavar="FILE", help="results JSON (repro-results/1)")
    r.add_argument("--markdown", metavar="OUT", help="write the Markdown here (default: stdout)")
    r.add_argument("--html", metavar="OUT", help="write a self-contained HTML page")
    r.add_argument("--junit", metavar="OUT", help="write one JUnit file of every run")
    d = sub.add_parser(
        "diff", help="the runs whose outcome changed (results), or the figures that slowed (bench)"
    )
    d.add_argument("a", metavar="A.json", help="a file, or several (a sharded run) joined by ','")
    d.add_argument("b", metavar="B.json", help="the same for the other side")
    r.set_defaults(run=cmd_report)
    d.set_defaults(run=cmd_diff)


def load(path: str) -> dict:
    """A results document, checked against its schema; anything else is a usage error."""
    try:
        doc = json.loads(Path(path).read_text())
    except RecursionError:  # json's decoder recurses once per nested array or object
        raise UsageError(f"{path}: not a results document: nested too deeply") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: not a results document: {e}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA_ID:
        raise UsageError(f"{path}: not a {SCHEMA_ID} document")
    found = problem(doc)
    if found:
        raise UsageError(f"{path}: not a valid {SCHEMA_ID} document: {found}")
    return doc


def _grid(docs: list[dict]) -> tuple[list[tuple[str, str]], list[tuple[str, str]], dict]:
    """(rows: bug, scenario; columns: variant, device; cells: (row, column) -> runs)."""
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for doc in docs:
        for run in doc["results"]:
            key = ((run["bug"], run["scenario"]), (run["variant"], _where(run)))
            cells[key].append(run)
    rows = list(dict.fromkeys(k[0] for k in cells))
    columns = sorted({k[1] for k in cells}, key=lambda c: (c[1], c[0] != "fixed", c[0]))
    return rows, columns, cells


def _where(run: dict) -> str:
    """The device (and the runner's dtype when not float32), and the detector where the run was
    one of `repro detectors`'."""
    where = run["device"] + ("" if run.get("dtype", "float32") == "float32" else f" {run['dtype']}")
    return f"{where} {run['detector']}" if "detector" in run else where


def _unexpected(run: dict) -> bool:
    """Only the scenario's own oracle has an expectation (other detectors are measured)."""
    return run.get("detector", "oracle") == "oracle" and run["outcome"] != run["expected"]


def _cell_text(runs: list[dict]) -> str:
    counts: dict[str, int] = defaultdict(int)
    for run in runs:
        counts[run["outcome"]] += 1
    text = ", ".join(f"{o} x{n}" if len(runs) > 1 else o for o, n in counts.items())
    unexpected = sum(_unexpected(run) for run in runs)
    return text + (
        f" (UNEXPECTED {unexpected}, expected {runs[0]['expected']})" if unexpected else ""
    )


def markdown(docs: list[dict]) -> str:
    rows, columns, cells = _grid(docs)
    head = ["bug", "scenario", *(f"{v} ({d})" for v, d in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        values = [_cell_text(cells[row, c]) if (row, c) in cells else "" for c in columns]
        lines.append("| " + " | ".join([*row, *values]) + " |")
    runs = [run for doc in docs for run in doc["results"]]
    ok = sum(not _unexpected(run) for run in runs)
    lines.append(f"\n{ok}/{len(runs)} runs as expected.")
    partial = sum(doc.get("complete") is False for doc in docs)
    if partial:
        lines.append(f"{partial} of the documents is incomplete (a run killed or still running).")
    return "\n".join(lines) + "\n"


def _html_cell(runs: list[dict]) -> str:
    unexpected = any(_unexpected(run) for run in runs)
    outcome = runs[0]["outcome"]
    colour = "#f4b6b6" if unexpected else OUTCOME_COLOURS.get(outcome, "#f3dfa8")
    evidence = "\n\n".join(
        f"seed {r['seed']}: {r['outcome']} in {r['seconds']}s\n{r['evidence']}" for r in runs
    )
    text = html.escape(_cell_text(runs))
    return (
        f'<td class="cell{" unexpected" if unexpected else ""}" style="background:{colour}" '
        f'title="{html.escape(evidence)}"><details><summary>{text}</summary>'
        f"<pre>{html.escape(evidence)}</pre></details></td>"
    )


def html_page(docs: list[dict]) -> str:
    rows, columns, cells = _grid(docs)
    head = "".join(f"<th>{html.escape(v)}<br>{html.escape(d)}</th>" for v, d in columns)
    body = []
    for row in rows:
        tds = "".join(
            _html_cell(cells[row, c]) if (row, c) in cells else "<td></td>" for c in columns
        )
        body.append(f"<tr><th>{html.escape(row[0])}</th><th>{html.escape(row[1])}</th>{tds}</tr>")
    provenance = "".join(
        f"<li><code>{html.escape(doc['command'])}</code> {html.escape(doc['created'])}: "
        f"<code>{html.escape(json.dumps(doc['provenance']))}</code></li>"
        for doc in docs
    )
    style = (
        "body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}"
        "td,th{border:1px solid #999;padding:4px 8px;vertical-align:top;font-size:13px}"
        "pre{white-space:pre-wrap;max-width:60em;font-size:11px}summary{cursor:pointer}"
    )
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>repro results</title>"
        f"<style>{style}</style></head><body><h1>repro results</h1>"
        f'<table id="grid"><tr><th>bug</th><th>scenario</th>{head}</tr>{"".join(body)}</table>'
        f"<h2>Provenance</h2><ul>{provenance}</ul></body></html>\n"
    )


def cmd_report(args: argparse.Namespace) -> int:
    docs = [load(path) for path in args.files]
    text = markdown(docs)
    if args.markdown:
        Path(args.markdown).write_text(text)
    else:
        print(text, end="")
    if args.html:
        Path(args.html).write_text(html_page(docs))
    if args.junit:
        LiveJunit(args.junit).rows([r for doc in docs for r in doc["results"]])
    return 0


def _keyed(doc: dict, with_device: bool) -> dict[tuple, str]:
    key = lambda r: (
        (r["bug"], r["scenario"], r["variant"], r["seed"], r.get("detector", ""))
        + ((r["device"],) if with_device else ())
    )
    return {key(r): r["outcome"] for r in doc["results"]}


def _merged(paths: str) -> dict:
    """Results documents read as one (a sharded run's parts): their runs together."""
    docs = [load(path) for path in paths.split(",")]
    return {**docs[0], "results": [r for doc in docs for r in doc["results"]]}


def _is_bench(paths: str) -> bool:
    try:
        doc = json.loads(Path(paths.split(",")[0]).read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("schema") == BENCH_SCHEMA


def load_bench(paths: str) -> dict[str, float]:
    """{figure: seconds} of bench files read as one (per-bug figures as BUG.figure)."""
    figures: dict[str, float] = {}
    for path in paths.split(","):
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError, RecursionError) as e:
            raise UsageError(f"{path}: not a bench document: {e}") from None
        if not isinstance(doc, dict) or doc.get("schema") != BENCH_SCHEMA:
            raise UsageError(f"{path}: not a {BENCH_SCHEMA} document")
        # a part's matrix is compared with the same part's only, and a figure read from a
        # matrix step (repro bench --matrix-json) with one read so
        tag = ",".join(str(t) for t in (doc.get("shard"), doc.get("matrix_from")) if t)
        for name, value in doc.get("figures", {}).items():
            figures[f"{name}[{tag}]" if tag and name in SHARDED else name] = value
        for bug, row in doc.get("bugs", {}).items():
            figures.update({f"{bug}.{name}": v for name, v in row.items()})
    return {k: v for k, v in figures.items() if isinstance(v, (int, float))}


def _bench_diff(args: argparse.Namespace) -> int:
    before, after = load_bench(args.a), load_bench(args.b)
    slower = [
        (name, before[name], after[name])
        for name in sorted(before.keys() & after.keys())
        if after[name] > SLOWER * before[name] and after[name] - before[name] >= NOISE_S
    ]
    for name, old, new in slower:
        print(f"{name}: {old:.3f}s -> {new:.3f}s ({new / old:.2f}x)")
    print(
        f"{len(slower)} of {len(before.keys() & after.keys())} figure(s) more than {SLOWER:g}x "
        f"slower from {args.a} to {args.b}"
    )
    return 1 if slower else 0


def cmd_diff(args: argparse.Namespace) -> int:
    if _is_bench(args.a) or _is_bench(args.b):
        return _bench_diff(args)
    a, b = _merged(args.a), _merged(args.b)
    devices_a = {r["device"] for r in a["results"]}
    devices_b = {r["device"] for r in b["results"]}
    with_device = not (len(devices_a) == len(devices_b) == 1 and devices_a != devices_b)
    before, after = _keyed(a, with_device), _keyed(b, with_device)
    changed = [(k, before.get(k, "-"), after.get(k, "-")) for k in {*before, *after}]
    changed = sorted(c for c in changed if c[1] != c[2])
    for key, old, new in changed:
        shown = " ".join(str(part) for part in key if part != "")
        print(f"{shown}: {old} -> {new}")
    print(f"{len(changed)} run(s) changed between {args.a} and {args.b}")
    return 1 if changed else 0
