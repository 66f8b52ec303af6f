"""Scenario-shaped functions that end in every way a child can, for the isolation tests."""

from __future__ import annotations

import ctypes
import json
import os
import time

from harness.outcome import Skip, WrongResult
from harness.record import Context


def passes(ctx: Context) -> str:
    return f"passed on {ctx.device} with {len(ctx.fixes)} fixes"


def wrong(ctx: Context) -> str:
    raise WrongResult("row 3: 5 vs 7")


def segfaults(ctx: Context) -> str:
    ctypes.string_at(0x10, 8)  # reads an unmapped page
    return "unreachable"


def aborts(ctx: Context) -> str:
    os.abort()


def hangs(ctx: Context) -> str:
    time.sleep(600)
    return "unreachable"


def cuda_assert_error(ctx: Context) -> str:
    raise RuntimeError("CUDA error: device-side assert triggered\nCompile with TORCH_USE_CUDA_DSA")


def triton_illegal_address(ctx: Context) -> str:
    raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")


def plain_bug_in_scenario(ctx: Context) -> str:
    raise KeyError("scenario typo")


def exits_without_report(ctx: Context) -> str:
    os._exit(3)


def skips(ctx: Context) -> str:
    raise Skip("needs a compiler")


def cuda_assert_then_cublas(ctx: Context) -> str:
    """A real device-side assert (embedding bounds), then a first cuBLAS call that fails for it."""
    import torch
    import torch.nn.functional as F

    table = torch.zeros(4, 4, device="cuda")
    F.embedding(torch.tensor([100], device="cuda"), table)
    torch.mm(table, table)
    torch.cuda.synchronize()
    return "unreachable"


def raises_in_code_under_test(ctx: Context) -> str:
    """A ValueError from the runner's LoRA mapping code (id 5 is not an active adapter)."""
    from harness.runner.lora import LoRAMapping, convert_mapping

    convert_mapping(LoRAMapping((5,), (5,)), [None, 1], 64)
    return "unreachable"


def imports_a_missing_module(ctx: Context) -> str:
    import kernels.no_such_kernel  # noqa: F401

    return "unreachable"


def sleeps_then_passes(ctx: Context) -> str:
    time.sleep(3)
    return "slept 3s"


def reads_a_sleeping_pool(ctx: Context) -> str:
    """Read memory of a tag that sleeps: a fault on the GPU (unmapped CuMem memory) and on
    the CPU (PROT_NONE arena pages) alike."""
    import torch

    from harness.runner.sleep_mode import make_pools

    pools = make_pools(ctx.device)
    kv = pools.empty("kv_cache", (1024,), torch.float32).fill_(1.0)
    pools.sleep()
    return f"read {float(kv.sum())} from a sleeping pool"


def writes_a_sleeping_pool(ctx: Context) -> str:
    import torch

    from harness.runner.sleep_mode import make_pools

    pools = make_pools(ctx.device)
    kv = pools.empty("kv_cache", (1024,), torch.float32)
    pools.sleep(offload_tags=("kv_cache",))
    kv.fill_(3.0)
    return f"wrote {float(kv[0])} into a sleeping pool"


def rank_one_segfaults(ctx: Context) -> str:
    """Two ranks: rank 1 dies of SIGSEGV while rank 0 waits for it in an all-reduce."""
    import torch
    import torch.distributed as dist

    if ctx.rank == 1:
        ctypes.string_at(0x10, 8)
    dist.all_reduce(torch.zeros(1))
    return "unreachable"


def rank_zero_faults_late(ctx: Context) -> str:
    """Two ranks: rank 1's collective loses its peer at once (the backend's words for it: an
    effect); rank 0, the cause, dies of SIGSEGV four seconds later, as a rank that faulted on a
    shared GPU can take that long to leave the driver."""
    if ctx.rank == 1:
        raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer [127.0.0.1]")
    time.sleep(4.0)
    ctypes.string_at(0x10, 8)
    return "unreachable"


def rank_one_raises_rank_zero_lingers(ctx: Context) -> str:
    """Two ranks: rank 1 raises at once (no lost peer: the cause); rank 0 goes on for a second
    and a half without a collective (a peer spinning on a flag the dead rank never sets)."""
    if ctx.rank == 1:
        raise RuntimeError("rank 1 broke")
    time.sleep(1.5)
    return "rank 0 ended"


def host_collectives_on_twins(ctx: Context) -> str:
    """Two DP ranks whose backend claims to be NCCL (as with one GPU per rank): Collectives
    makes a gloo twin of each group, and a host tensor's all-reduce goes over it (under a real
    NCCL a host tensor on the NCCL group fails). Under gloo the groups are their own twins."""
    from unittest import mock

    import torch
    import torch.distributed as dist

    from harness.runner.parallel import Collectives, ParallelConfig

    parallel = ParallelConfig(world_size=2, rank=ctx.rank, data_parallel_size=2)
    plain = Collectives(parallel, "cpu")
    if plain._host_groups != plain._groups or plain._groups["dp"] is not None:
        raise WrongResult(f"gloo: host groups {plain._host_groups}, groups {plain._groups}")
    with mock.patch.object(dist, "get_backend", return_value="nccl"):
        twins = Collectives(parallel, "cpu")
    twin = twins._host_groups["dp"]
    if twins._groups["dp"] is not None or twin is None or dist.get_backend(twin) != "gloo":
        raise WrongResult(f"NCCL: host groups {twins._host_groups}, groups {twins._groups}")
    seen = []
    issue = dist.all_reduce
    with mock.patch.object(dist, "all_reduce", lambda t, **kw: seen.append(kw) or issue(t, **kw)):
        counts = twins.all_reduce(torch.tensor([ctx.rank + 1, 10 * (ctx.rank + 1)]))
    if counts.tolist() != [3, 30] or seen[0]["group"] is not twin:
        raise WrongResult(f"all-reduce {counts.tolist()} over {seen}")
    return "host tensors over the gloo twins"


def ranks_hang(ctx: Context) -> str:
    """Every rank hangs in Python (no collective): the run's limit ends it."""
    while True:
        time.sleep(0.05)


def reports_then_lingers(ctx: Context) -> str:
    """A child (or each rank) whose report is written and whose exit is slow: the state of one
    whose CUDA context the driver is tearing down. It writes its own pass report where
    harness.child would (next to its log: the run's report.json, a rank's rank-R.json), with
    its pid, then stays a minute. Whoever decides by the report goes on without it."""
    log = os.readlink("/proc/self/fd/1")
    path = os.path.join(os.path.dirname(log), "report.json")
    if ctx.world_size > 1:
        path = log.removesuffix(".log") + ".json"
    with open(path + ".tmp", "w") as f:
        json.dump({"status": "pass", "detail": f"pid {os.getpid()}"}, f)
    os.replace(path + ".tmp", path)
    time.sleep(60)
    return "unreachable"
