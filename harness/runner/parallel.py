"""Parallel layout of a rank, and the runner's collectives (over torch.distributed).

ParallelConfig says where this rank sits: world size, rank, and the data, tensor and expert
parallel sizes (rank = dp_rank * tensor_parallel_size + tp_rank, as upstream lays out DP
over TP). Collectives is the one door of the runner to torch.distributed: each collective is
first recorded in the rank's trace (one JSON line, flushed: step, op, group, shape, dtype),
then issued, so that the coordinator of the ranks (harness.ranks) sees which collective each
rank waits in, and which a rank skipped, without waiting for the backend's timeout.

A collective of a host tensor goes over the host groups, as upstream's batch metadata goes
over each group's cpu_group (gloo) "to avoid CPU-GPU synchronization" (vllm/v1/worker/gpu/
dp_utils.py; ParallelConfig.has_unfinished_dp): under gloo those are the groups themselves;
under NCCL (one GPU per rank) a gloo twin of each. A device tensor's goes over the backend's.

Trace lines: a header {"rank", "world_size", "groups": {NAME: [members]}} (this rank's own
group of each kind), then per collective {"step", "op", "group", "shape", "dtype"}, and
{"step_end": S} when the rank's step S is over (harness.ranks.read_trace reads them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

GROUP_KINDS = ("dp", "tp")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    world_size: int = 1
    rank: int = 0
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    # the experts' group: 1 (none), or every rank (upstream: EP spans DP x TP)
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        sizes = {
            "world_size": self.world_size,
            "data_parallel_size": self.data_parallel_size,
            "tensor_parallel_size": self.tensor_parallel_size,
            "expert_parallel_size": self.expert_parallel_size,
        }
        for name, size in sizes.items():
            if size < 1:
                raise ValueError(f"ParallelConfig: {name} must be at least 1, got {size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"ParallelConfig: rank {self.rank} not in [0, {self.world_size})")
        if self.data_parallel_size * self.tensor_parallel_size != self.world_size:
            raise ValueError(
                f"ParallelConfig: data_parallel_size {self.data_parallel_size} x "
                f"tensor_parallel_size {self.tensor_parallel_size} != world_size "
                f"{self.world_size}"
            )
        if self.expert_parallel_size not in (1, self.world_size):
            raise ValueError(
                f"ParallelConfig: expert_parallel_size {self.expert_parallel_size}: 1 or the "
                f"world size ({self.world_size})"
            )

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tensor_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel_size

    def groups(self, kind: str) -> list[tuple[int, ...]]:
        """Every group of `kind` ("dp": ranks of one TP position, "tp": ranks of one DP
        rank), in the order every rank creates them."""
        dp, tp = self.data_parallel_size, self.tensor_parallel_size
        if kind == "dp":
            return [tuple(d * tp + t for d in range(dp)) for t in range(tp)]
        if kind == "tp":
            return [tuple(d * tp + t for t in range(tp)) for d in range(dp)]
        raise ValueError(f"unknown group kind {kind!r}; kinds: {', '.join(GROUP_KINDS)}")

    def group(self, kind: str) -> tuple[int, ...]:
        """This rank's group of `kind`."""
        return next(g for g in self.groups(kind) if self.rank in g)


_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


class Collectives:
    """The runner's collectives: recorded in the trace, then issued on the rank's groups. A
    group of one rank issues nothing (its result is its input)."""

    def __init__(self, parallel: ParallelConfig, device: str, trace: str = "") -> None:
        self.parallel, self.device = parallel, device  # device: where collective tensors live
        self.step = 0
        self._trace = open(trace, "a") if trace else None  # noqa: SIM115 (the rank's life)
        self._groups: dict[str, object] = {}
        self._host_groups: dict[str, object] = {}  # under NCCL: each group's gloo twin
        if parallel.world_size > 1:
            import torch.distributed as dist

            twins = dist.is_initialized() and dist.get_backend() != "gloo"
            for kind in GROUP_KINDS:  # every rank creates every group, in one order
                for members in parallel.groups(kind):
                    if len(members) == 1:
                        continue
                    whole = len(members) == parallel.world_size
                    handle = None if whole else dist.new_group(list(members))  # None: default
                    twin = dist.new_group(list(members), backend="gloo") if twins else handle
                    if parallel.rank in members:
                        self._groups[kind], self._host_groups[kind] = handle, twin
        own = {kind: list(parallel.group(kind)) for kind in GROUP_KINDS}
        self._write({"rank": parallel.rank, "world_size": parallel.world_size, "groups": own})

    def _write(self, line: dict) -> None:
        if self._trace is not None:
            self._trace.write(json.dumps(line) + "\n")
            self._trace.flush()

    def _record(self, op: str, group: str, tensor: torch.Tensor) -> bool:
        """Record the collective; whether it must be issued (a group of several ranks)."""
        if group not in GROUP_KINDS:
            raise ValueError(f"unknown group {group!r}")
        dtype = str(tensor.dtype).removeprefix("torch.")
        entry = {"step": self.step, "op": op, "group": group, "shape": list(tensor.shape)}
        self._write({**entry, "dtype": dtype})
        return group in self._groups

    def _issue(self, collective, group: str, tensor: torch.Tensor, **kwargs) -> None:
        """`collective` of `tensor` (in place) on the process group of `group`. Gloo's groups
        take a device tensor through a host copy of our own: the same result, and faster than
        gloo's own path for CUDA tensors (rank_rng_divergence's check on one H200: 1.8 s, 2.2 s
        with gloo's)."""
        import torch.distributed as dist

        if tensor.device.type == "cpu":
            collective(tensor, group=self._host_groups[group], **kwargs)
        elif dist.get_backend(self._groups[group]) == "gloo":
            host = tensor.cpu()
            collective(host, group=self._groups[group], **kwargs)
            tensor.copy_(host)
        else:
            collective(tensor, group=self._groups[group], **kwargs)

    def all_reduce(self, tensor: torch.Tensor, group: str = "dp", op: str = "sum") -> torch.Tensor:
        """In place, over `group`; returns `tensor`."""
        if self._record("all_reduce", group, tensor):
            import torch.distributed as dist

            self._issue(dist.all_reduce, group, tensor, op=getattr(dist.ReduceOp, _OPS[op]))
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int, group: str = "dp") -> torch.Tensor:
        """In place, from global rank `src` of `group`; returns `tensor`."""
        if self._record("broadcast", group, tensor):
            import torch.distributed as dist

            self._issue(dist.broadcast, group, tensor, src=src)
        return tensor

    def end_step(self) -> None:
        """The rank's step is over: it issues no more collectives of this step."""
        self._write({"step_end": self.step})
        self.step += 1
