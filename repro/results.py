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

import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from harness import device as devices
from harness.fixes import ALL_FIXES, describe
from harness.isolate import ROOT, Result
from harness.record import BugRecord
from repro import registry

SCHEMA_ID = "repro-results/1"
SCHEMA_FILE = Path(__file__).with_name("results.schema.json")


def result_json(r: Result, bug: BugRecord | None = None) -> dict:
    bug = bug or registry.get(r.job.bug)
    return {
        "bug": r.job.bug,
        "scenario": r.job.scenario,
        "variant": describe(r.job.fixes, bug.fix_parts),
        "fixes_off": sorted(f.value for f in ALL_FIXES - r.job.fixes),
        "device": r.job.device,
        "gpu": r.gpu,
        "outcome": r.outcome.value,
        "expected": bug.scenario(r.job.scenario).expected(r.job.fixes, r.job.device).value,
        "seed": r.job.seed,
        "seconds": round(r.seconds, 3),
        "scenario_seconds": None if r.scenario_seconds is None else round(r.scenario_seconds, 3),
        "evidence": r.evidence,
    }


def document(rows: list[dict], **extra: object) -> dict:
    """The results document around `rows` (and `extra` keys, e.g. a check's verdict)."""
    devices_used = {row["device"] for row in rows}
    return {
        "schema": SCHEMA_ID,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["repro", *sys.argv[1:]]),
        "provenance": provenance(devices_used),
        "results": rows,
        **extra,
    }


def write(path: str, doc: dict) -> None:
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


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
    found = {}
    for name in ("torch", "triton", "numpy"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
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


def write_junit(path: str, cells: list) -> None:
    """One test case per cell (class bug.variant.device), its evidence in system-out; a
    failure carries the evidence as its message."""
    suite = ET.Element(
        "testsuite",
        name="repro-matrix",
        tests=str(len(cells)),
        failures=str(sum(not c.ok for c in cells)),
    )
    for c in cells:
        case = ET.SubElement(
            suite,
            "testcase",
            classname=junit_class(c.result.job.bug, c.variant, c.result.job.device),
            name=f"{c.result.job.scenario}[seed {c.result.job.seed}]",
            time=f"{c.result.seconds:.3f}",
        )
        evidence = f"{c.result.outcome.value} (expected {c.expected.value})\n{c.result.evidence}"
        if c.result.outcome.value == "skipped" and c.expected.value != "skipped":
            ET.SubElement(case, "skipped", message=c.result.evidence)
        elif not c.ok:
            message = f"{c.result.outcome.value}, expected {c.expected.value}: {c.result.evidence}"
            ET.SubElement(case, "failure", message=message).text = c.result.evidence
        ET.SubElement(case, "system-out").text = evidence
    ET.ElementTree(suite).write(path, encoding="unicode", xml_declaration=True)


def junit_class(bug: str, variant: str, device: str) -> str:
    """bug.variant.device, with no spaces (JUnit tools split class names on dots)."""
    return f"{bug}.{variant.replace(' ', '-').replace('.', '_')}.{device}"
