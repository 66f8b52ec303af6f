"""A scenario child: run one scenario and write a JSON report as the last act.

    python -m harness.child '<spec json>' REPORT_PATH

or, forked by harness.forkserver, `execute()` directly. The device switch happens before
torch, Triton or any kernel module is imported.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import sys
import time
import traceback

from harness import device as devices
from harness.fixes import Fix
from harness.outcome import Skip, WrongResult
from harness.record import Context

STARTED = time.monotonic()  # before this: the interpreter and harness imports, a few ms


def _resolve(target: str):
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def run(spec: dict, started: float, timings: dict[str, float]) -> dict:
    """Run the scenario named by `spec`; never raises. Fills `timings` as it goes."""
    try:
        import torch

        if spec["device"] == "cuda" and not torch.cuda.is_available():
            raise Skip("no CUDA device visible to the child")
        fn = _resolve(spec["target"])
        ctx = Context(frozenset(Fix(n) for n in spec["fixes"]), spec["device"], spec["seed"])
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
        message = str(e)[:4000] + _sticky_cuda_error(spec["device"])
        return {"status": "exception", "type": type(e).__name__, "message": message}


def _sticky_cuda_error(device: str) -> str:
    """The context's first error, when a later call failed for it (e.g. a device-side assert,
    then cublasCreate reporting CUBLAS_STATUS_INTERNAL_ERROR)."""
    if device != "cuda":
        return ""
    import torch

    try:
        torch.cuda.synchronize()
    except Exception as e:
        return f"\nsticky CUDA error at synchronize: {e}"
    return ""


def execute(spec: dict, report_path: str, started: float) -> None:
    """Run, write the report atomically, and leave without interpreter teardown."""
    devices.activate(spec["device"])
    faulthandler.enable()
    timings: dict[str, float] = {}
    report = run(spec, started, timings)
    if "startup_s" in timings:
        timings["scenario_s"] = time.monotonic() - started - timings["startup_s"]
    report["timings"] = timings
    with open(report_path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(report_path + ".tmp", report_path)
    sys.stdout.flush()
    sys.stderr.flush()
    # NOTE: skip interpreter teardown: after a CUDA fault, context destruction can hang.
    os._exit(0)


if __name__ == "__main__":
    execute(json.loads(sys.argv[1]), sys.argv[2], STARTED)
