"""Results people can read and compare: a versioned JSON document with provenance, and JUnit.

The document (schema: results.schema.json beside this file, "repro-results/1"):
  {"schema", "created", "command", "provenance": {project commit and dirtiness, Python and
   package versions, torch's CUDA, the host, its GPUs (name, compute capability, driver) read
   from nvidia-smi, whether the CPU runs went through Triton's interpreter}, "results": [one row
   per run: bug, scenario, variant, fixes off, device, GPU, seed, outcome, expected, evidence,
   timings], and for `check`, "verdict": {"exit", "text"}}
Nothing here imports torch: versions come from package metadata, GPUs from nvidia-smi.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from harness import device as devices
from harness.fixes import ALL_FIXES, describe
from harness.isolate import ROOT, Result
from harness.record import BugRecord
from repro import registry

SCHEMA_ID = "repro-results/1"
SCHEMA_FILE = Path(__file__).with_name("results.schema.json")


def problem(doc: object) -> str | None:
    """The first way `doc` breaks results.schema.json (where and what), or None. A validator of
    the keywords that schema uses (jsonschema is a test extra; GPU runners may lack it)."""
    schema = json.loads(SCHEMA_FILE.read_text())
    return _problem(doc, schema, schema, "document")


_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}
SCHEMA_KEYWORDS = {
    "$schema", "$id", "$defs", "title", "$ref", "type", "const", "enum", "anyOf", "required",
    "properties", "additionalProperties", "items",
}  # fmt: skip


def _equal(a: object, b: object) -> bool:
    """JSON equality: true is not 1."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def _problem(value: object, schema: dict, root: dict, where: str) -> str | None:
    if "$ref" in schema:
        schema = root["$defs"][schema["$ref"].removeprefix("#/$defs/")]
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_TYPES[t](value) for t in types):
            return f"{where}: {value!r:.60} is not of type {' or '.join(types)}"
    if "const" in schema and not _equal(value, schema["const"]):
        return f"{where}: {value!r:.60} is not {schema['const']!r}"
    if "enum" in schema and not any(_equal(value, e) for e in schema["enum"]):
        return f"{where}: {value!r:.60} is not one of {', '.join(map(str, schema['enum']))}"
    if "anyOf" in schema and all(_problem(value, s, root, where) for s in schema["anyOf"]):
        return f"{where}: {value!r:.60} matches none of its allowed forms"
    if isinstance(value, dict):
        for key in schema.get("required", ()):
            if key not in value:
                return f"{where}: {key!r} is missing"
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = schema.get("properties", {}).get(key, extra)
            found = _problem(item, sub, root, f"{where}.{key}") if sub else None
            if found:
                return found
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found = _problem(item, schema["items"], root, f"{where}[{i}]")
            if found:
                return found
    return None


def result_json(r: Result, bug: BugRecord | None = None) -> dict:
    bug = bug or registry.get(r.job.bug)
    return {
        "bug": r.job.bug,
        "scenario": r.job.scenario,
        "variant": describe(r.job.fixes, bug.fix_parts),
        "fixes_off": sorted(f.value for f in ALL_FIXES - r.job.fixes),
        "device": r.job.device,
        "dtype": r.job.dtype,
        "gpu": r.gpu,
        "outcome": r.outcome.value,
        "expected": bug.scenario(r.job.scenario).expected(r.job.fixes, r.job.device).value,
        "seed": r.job.seed,
        "seconds": round(r.seconds, 3),
        "scenario_seconds": None if r.scenario_seconds is None else round(r.scenario_seconds, 3),
        "evidence": r.evidence,
    }


def document(rows: list[dict], devices_used: set[str] | None = None, **extra: object) -> dict:
    """The results document around `rows` (and `extra` keys, e.g. a check's verdict)."""
    devices_used = {row["device"] for row in rows} if devices_used is None else devices_used
    return {
        "schema": SCHEMA_ID,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["repro", *sys.argv[1:]]),
        "provenance": provenance(devices_used),
        "results": rows,
        **extra,
    }


def write(path: str, doc: dict) -> None:
    replace(path, json.dumps(doc, indent=2) + "\n")


def replace(path: str, text: str) -> None:
    """Write `text` to `path` atomically: a killed writer leaves the old file or the new one. A
    symlink is followed (it stays); a path that is not a regular file (/dev/stdout, a pipe) is
    written in place."""
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():
        with open(target, "w") as out:
            out.write(text)
        return
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            os.fchmod(out.fileno(), 0o666 & ~_umask())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class LiveJson:
    """A --json document of a run in progress: rewritten atomically after every finished run
    (a killed command leaves a valid document with every run that finished), "complete": false
    until `finish`. Rows are serialized once, so each rewrite only joins them."""

    def __init__(self, path: str, devices_used: set[str], **extra: object) -> None:
        head = document([], devices_used, **extra)
        del head["results"]
        self.path, self.head, self.rows = path, head, []

    def add(self, row: dict) -> None:
        self.rows.append(json.dumps(row))
        self._write(complete=False)

    def finish(self, rows: list[dict], **extra: object) -> None:
        """The whole document, rows in the given order."""
        self.head.update(extra)
        self.rows = [json.dumps(row) for row in rows]
        self._write(complete=True)

    def _write(self, complete: bool) -> None:
        head = json.dumps({**self.head, "complete": complete}, indent=2)
        body = ",\n    ".join(self.rows)
        replace(self.path, f'{head[:-2]},\n  "results": [\n    {body}\n  ]\n}}\n')


def provenance(devices_used: set[str]) -> dict:
    return {
        "project": _project(),
        "python": platform.python_version(),
        "packages": _packages(),
        "torch_cuda": devices.torch_cuda_version(),
        "host": {"machine": platform.machine(), "cpu": _cpu_model(), "cpus": os.cpu_count()},
        "gpus": _gpus() if "cuda" in devices_used else [],
        "interpreter": "cpu" in devices_used,  # CPU runs: Triton's interpreter
    }


def _project() -> dict:
    def git(*args: str) -> str | None:
        if not shutil.which("git"):
            return None
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "root": str(ROOT),
        "commit": git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
    }


def _packages() -> dict[str, str | None]:
    from importlib import metadata  # here: 10-19 ms that every command's import paid

    found = {}
    for name in ("torch", "triton", "numpy"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _gpus() -> list[dict]:
    """Name, compute capability and driver of each GPU, from nvidia-smi (no CUDA init)."""
    if not shutil.which("nvidia-smi"):
        return []
    query = "index,name,compute_cap,driver_version"
    done = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    gpus = []
    for line in done.stdout.strip().splitlines():
        index, name, cap, driver = (part.strip() for part in line.split(","))
        gpus.append({"index": index, "name": name, "compute_capability": cap, "driver": driver})
    return gpus


class LiveJunit:
    """A --junit file of a run in progress, rewritten atomically after every finished run: one
    test case per cell (class bug.variant.device), its evidence in system-out; a failure carries
    the evidence as its message; a run that could not run (skipped, interrupted) is skipped, not
    failed. The property "complete" is false until `finish`."""

    def __init__(self, path: str) -> None:
        self.path, self.cases, self.failures, self.skipped = path, [], 0, 0

    def add(self, cell) -> None:
        self.cases.append(self._case(cell))
        self._write(complete=False)

    def finish(self, cells: list) -> None:
        self.cases, self.failures, self.skipped = [], 0, 0
        self.cases = [self._case(c) for c in cells]
        self._write(complete=True)

    def _case(self, c) -> str:
        job = c.result.job
        row = {"bug": job.bug, "variant": c.variant, "device": job.device}
        row |= {"scenario": job.scenario, "seed": job.seed, "seconds": c.result.seconds}
        row |= {"outcome": c.result.outcome.value, "expected": c.expected.value}
        return self._row_case({**row, "evidence": c.result.evidence}, c.ok)

    def _row_case(self, row: dict, ok: bool) -> str:
        """One test case of a result row (result_json's keys), counted."""
        case = ET.Element(
            "testcase",
            classname=junit_class(row["bug"], row["variant"], row["device"]),
            name=f"{row['scenario']}[seed {row['seed']}]",
            time=f"{row['seconds']:.3f}",
        )
        outcome, expected, evidence = row["outcome"], row["expected"], row["evidence"]
        if outcome == "skipped" and expected != "skipped":
            ET.SubElement(case, "skipped", message=evidence)
            self.skipped += 1
        elif not ok:
            message = f"{outcome}, expected {expected}: {evidence}"
            ET.SubElement(case, "failure", message=message).text = evidence
            self.failures += 1
        ET.SubElement(case, "system-out").text = f"{outcome} (expected {expected})\n{evidence}"
        return ET.tostring(case, encoding="unicode")

    def rows(self, rows: list[dict]) -> None:
        """The whole file from result rows (documents read back: a sharded run's parts)."""
        self.cases, self.failures, self.skipped = [], 0, 0
        self.cases = [self._row_case(r, r["outcome"] == r["expected"]) for r in rows]
        self._write(complete=True)

    def _write(self, complete: bool) -> None:
        suite = ET.Element(
            "testsuite",
            name="repro-matrix",
            tests=str(len(self.cases)),
            failures=str(self.failures),
            skipped=str(self.skipped),
        )
        properties = ET.SubElement(suite, "properties")
        ET.SubElement(properties, "property", name="complete", value=str(complete).lower())
        head, _, _ = ET.tostring(suite, encoding="unicode").rpartition("</testsuite>")
        cases = "".join(self.cases)
        replace(self.path, f"<?xml version='1.0' encoding='utf-8'?>\n{head}{cases}</testsuite>\n")


def write_junit(path: str, cells: list) -> None:
    LiveJunit(path).finish(cells)


def junit_class(bug: str, variant: str, device: str) -> str:
    """bug.variant.device, with no spaces (JUnit tools split class names on dots)."""
    return f"{bug}.{variant.replace(' ', '-').replace('.', '_')}.{device}"
