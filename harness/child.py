"""A scenario child: run one scenario and write a JSON report as its last act.

Forked by harness.forkserver, or spawned by harness.isolate (`main(request, started)` either
way). The request: {"spec": {"target", "fixes", "device", "seed", ["payload"], ["ranks"]},
"report": PATH, "log": PATH, "timeout_s": T}; with "ranks": N > 1 this child coordinates N
spawned rank processes (harness.ranks), each running this module's main with its rank. The
device switch happens before torch, Triton or any kernel module is imported here; the
scenario's own modules are imported only when it runs.

The report's status: "pass", "wrong_result" (an oracle found a divergence), "skipped", or
"exception" with the exception's origin: "code" (raised in the code under test: kernels/,
csrc bindings, the miniature runner), "import" (the project does not import), "build" (a
csrc build failed), or "scenario" (the scenario or the harness itself broke).
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from harness import device as devices
from harness import lifetime, ranks
from harness.fixes import Fix
from harness.outcome import Skip, WrongResult
from harness.record import Context

ROOT = Path(__file__).resolve().parent.parent
CODE_UNDER_TEST = ("kernels", "harness/runner")
PREPARE = "harness.child:prepare_cuda"  # not a scenario: it must not pay for a CUDA context
PROJECT_DIRS = ("kernels", "harness", "repro", "tests")


def _resolve(target: str):
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def origin(error: BaseException) -> tuple[str, str]:
    """(origin, where): who raised `error`, and the innermost project frame as path:line.
    Raised while a module was being imported (any type, from a module's top level, lazy imports
    included): "import", the tree does not import, whatever the scenario would have shown."""
    frames = traceback.extract_tb(error.__traceback__)
    importing = [f for f in frames if f.name == "<module>" and Path(f.filename).is_file()]
    if isinstance(error, (ImportError, SyntaxError)) or importing:
        at = importing[-1] if importing else None
        return "import", (f"{_shown(Path(at.filename))}:{at.lineno} (importing)" if at else "")
    csrc = sys.modules.get("kernels.csrc")
    if csrc is not None and isinstance(error, csrc.BuildError):
        return "build", ""
    for frame in reversed(frames):
        path = Path(frame.filename).resolve()
        if not path.is_relative_to(ROOT):
            continue
        rel = path.relative_to(ROOT).as_posix()
        if rel.split("/")[0] not in PROJECT_DIRS:
            continue  # a virtual environment inside the checkout
        where = f"{rel}:{frame.lineno} in {frame.name}"
        under_test = any(rel.startswith(d + "/") for d in CODE_UNDER_TEST)
        return ("code" if under_test else "scenario"), where
    return "scenario", ""


def _shown(path: Path) -> str:
    path = path.resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def run(spec: dict, started: float, timings: dict[str, float]) -> dict:
    """Run the scenario named by `spec`; never raises. Fills `timings` as it goes."""
    try:
        import torch

        if spec["device"] == "cuda" and spec["target"] != PREPARE and not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
            raise Skip(f"no CUDA device visible to the child (CUDA_VISIBLE_DEVICES={visible})")
        fn = _resolve(spec["target"])
        fixes = frozenset(Fix(n) for n in spec["fixes"])
        if "rank" in spec:  # one rank of several (harness.ranks): the process group first
            ranks.join(spec)
        ctx = Context(
            fixes,
            spec["device"],
            spec["seed"],
            spec.get("payload", ""),
            spec.get("dtype", "float32"),
            spec.get("rank", 0),
            spec.get("world_size", 1),
            spec.get("trace", ""),
        )
        torch.manual_seed(ctx.seed)
        timings["startup_s"] = time.monotonic() - started
        detail = fn(ctx)
        if ctx.device == "cuda":
            torch.cuda.synchronize()
        return {"status": "pass", "detail": detail or ""}
    except WrongResult as e:
        return {"status": "wrong_result", "detail": str(e)}
    except Skip as e:
        return {"status": "skipped", "detail": str(e)}
    except BaseException as e:  # the parent classifies CUDA errors from the message
        traceback.print_exc()
        where_from, where = origin(e)
        message = str(e)[:4000] + _sticky_cuda_error(spec["device"])
        return {
            "status": "exception",
            "type": type(e).__name__,
            "message": message,
            "origin": where_from,
            "where": where,
        }


def _sticky_cuda_error(device: str) -> str:
    """The context's first error, when a later call failed for it (e.g. a device-side assert,
    then cublasCreate reporting CUBLAS_STATUS_INTERNAL_ERROR)."""
    torch = sys.modules.get("torch")
    if device != "cuda" or torch is None:
        return ""
    try:
        torch.cuda.synchronize()
    except Exception as e:
        return f"\nsticky CUDA error at synchronize: {e}"
    return ""


def noop(ctx: Context) -> str:
    """Not a scenario: a child that does nothing (what a child costs: `repro bench`)."""
    return "nothing"


def cuda_context(ctx: Context) -> str:
    """Not a scenario: a child that only makes its CUDA context, the least a cuda run costs
    (`repro bench`: one GPU takes only so many of these a second, however many run at once)."""
    if ctx.device == "cuda":
        import torch

        torch.cuda.synchronize()
    return "context made" if ctx.device == "cuda" else "nothing (cpu)"


def prepare_cuda(ctx: Context) -> str:
    """Not a scenario: build (or load) every csrc extension once, before scenario children
    race to build them under their own time limits."""
    from kernels import csrc

    for name in csrc.EXTENSIONS:
        csrc.load(name)
    return f"csrc extensions ready in {csrc.cache_dir()}"


def main(request: dict, started: float) -> None:
    """Run, write the report atomically, and leave without interpreter teardown."""
    lifetime.arm_own_time_limit(request["timeout_s"])
    if request.get("nice"):  # a check's twin: the first runs keep the CPUs
        os.nice(request["nice"])
    faulthandler.enable()
    # At the time limit the parent asks where a hung child stands (evidence), then kills it.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    spec = request["spec"]
    devices.activate(spec["device"])
    timings: dict[str, float] = {}
    coordinator = spec.get("ranks", 1) > 1  # this child coordinates the scenario's ranks
    if coordinator:
        report = ranks.coordinate(request, started, timings, spawned_rank)
    else:
        report = run(spec, started, timings)
    if "startup_s" in timings:
        timings["scenario_s"] = time.monotonic() - started - timings["startup_s"]
    report["timings"] = timings
    sys.stdout.flush()  # the log is whole before the report exists: a parent may read both
    sys.stderr.flush()  # as soon as the report is there
    path = request["report"]
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)
    # The report is the run's last word: nothing after it changes the verdict (a parent decides
    # on it without waiting for this exit, where the driver tears a CUDA context down: 0.1 s,
    # most of a second after a fault). A coordinator waits for its ranks' exits, bounded.
    if coordinator:
        ranks.reap()
    # NOTE: skip interpreter teardown: after a CUDA fault, context destruction can hang.
    os._exit(0)


def spawned_rank(request_json: str) -> None:
    """Entry point of a rank process (harness.ranks): dies with its coordinator."""
    started = time.monotonic()
    request = json.loads(request_json)
    lifetime.die_with_parent(request["coordinator"])
    main(request, started)


def spawned(request_json: str) -> None:
    """Entry point of a spawned child (`REPRO_ISOLATION=spawn`, under compute-sanitizer)."""
    started = time.monotonic()
    lifetime.die_with_parent(os.getppid())
    main(json.loads(request_json), started)
