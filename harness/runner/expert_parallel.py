"""An expert-parallel MoE layer whose decode step replays a captured graph per batch bucket.

Every rank owns `num_experts / ep` experts (top-1 routing, a softmax gate; the router and the
experts are seeded alike on every rank, each keeping its own experts' weights). A decode step:

1. the ranks agree on their token counts (a traced all-reduce, outside any graph; upstream:
   DP attention's global_num_tokens), in both variants;
2. each rank picks the graph bucket (a capture size, the rows its graphs were captured for):
   from the count every rank agreed, their max (fix part `ep_graph_bucket_agreed`, SGLang
   #30450), or from its own local count (the bug: SGLang #29461's regression, issue #30242);
3. the bucket's three graphs replay with a barrier (a traced all-reduce, outside the graphs)
   after the first two: `dispatch` (the gate in torch, then kernels.ep_dispatch writes every
   slot of the rank's bucket into every peer's receive rows, at rows laid out by the bucket:
   upstream's one-sided all-to-all with its `[ep_size, runtime_max_tokens_per_rank, hidden]`
   geometry), `combine` (the rank's experts on its own receive rows, read by its own bucket,
   products into each source's out rows; then the receive rows poisoned again), `finish`
   (the gate's weight applied, the out rows poisoned again).

Ranks whose buckets differ disagree on where a source's rows start: the larger-bucket rank
reads receive rows no peer wrote this step, whose poisoned expert index (int32 max) sends the
expert load to a wild address. Receive and out buffers live in PeerMemory (one per rank,
mapped in every rank), filled with poison and poisoned again after each use.
"""

from __future__ import annotations

from pathlib import Path

import torch

from harness.fixes import ALL_FIXES, Fix, Variant
from harness.runner.cudagraph import Graph, Launcher, capturing, host_sync, poisoned_pool
from harness.runner.parallel import Collectives, ParallelConfig
from harness.runner.peer_memory import PeerMemory
from kernels.ep_dispatch import POISON_IDX, ep_dispatch, ep_expert_combine

PHASES = ("dispatch", "combine", "finish")


class ExpertParallelMoE:
    """This rank's share of an EP MoE layer of `hidden` x `hidden` experts, with graphs captured
    for each of `capture_sizes` (rows per rank); `directory`: the run's private directory (the
    CPU's peer files)."""

    def __init__(
        self,
        parallel: ParallelConfig,
        collectives: Collectives,
        device: str,
        directory: str | Path,
        fixes: Variant = ALL_FIXES,
        hidden: int = 16,
        num_experts: int = 4,
        capture_sizes: tuple[int, ...] = (2, 4, 8),
        seed: int = 0,
    ) -> None:
        ep = parallel.world_size
        if parallel.expert_parallel_size != ep or num_experts % ep:
            raise ValueError(f"{num_experts} experts over an EP group of {ep} ranks")
        self.parallel, self.collectives, self.device, self.fixes = (
            parallel,
            collectives,
            device,
            fixes,
        )
        self.rank, self.ep, self.hidden = parallel.rank, ep, hidden
        self.experts_per_rank = num_experts // ep
        self.capture_sizes = tuple(sorted(capture_sizes))
        rows = self.capture_sizes[-1]
        gen = torch.Generator().manual_seed(seed)
        self.router = torch.randn(hidden, num_experts, generator=gen)  # every rank's alike
        self.all_experts = torch.randn(num_experts, hidden, hidden, generator=gen) / hidden**0.5
        mine = slice(self.rank * self.experts_per_rank, (self.rank + 1) * self.experts_per_rank)
        self.weights = self.all_experts[mine].contiguous().to(device)
        router = self.router.to(device)
        peers = (parallel, device, directory)
        self.recv_idx = PeerMemory("ep-recv-idx", ep * rows, torch.int32, *peers, fill=POISON_IDX)
        nan = float("nan")
        self.recv_x = PeerMemory("ep-recv-x", ep * rows * hidden, torch.float32, *peers, fill=nan)
        self.out = PeerMemory("ep-out", rows * hidden, torch.float32, *peers, fill=nan)
        # the graphs' persistent inputs and outputs (refreshed in place before each replay)
        self.x = torch.zeros(rows, hidden, device=device)
        self.num_tokens = torch.zeros(1, dtype=torch.int32, device=device)
        self.expert = torch.zeros(rows, dtype=torch.int32, device=device)
        self.gate = torch.zeros(rows, device=device)
        self.y = torch.zeros(rows, hidden, device=device)
        self._router = router
        self.launcher = Launcher()
        self.graphs: dict[int, dict[str, Graph]] = {}
        self.counts_across_ep: list[int] | None = None  # the last step's agreed counts
        self.rows: int | None = None  # the last step's bucket
        self._capture()

    # -- the phases (device work only: what a graph records) --------------------------------

    def _dispatch(self, rows: int) -> None:
        probs = torch.softmax(self.x[:rows] @ self._router, dim=-1)
        gate, expert = probs.max(dim=-1)
        self.gate[:rows].copy_(gate)
        self.expert[:rows].copy_(expert)
        self.launcher(
            ep_dispatch,
            self.x,
            self.expert,
            self.num_tokens,
            self.recv_idx.table,
            self.recv_x.table,
            rows,
            self.rank,
            self.experts_per_rank,
        )

    def _combine(self, rows: int) -> None:
        tables = (self.recv_idx.table, self.recv_x.table, self.out.table)
        self.launcher(ep_expert_combine, self.weights, *tables, rows, self.rank)
        self.recv_idx.local.fill_(POISON_IDX)  # read: poisoned for the next step
        self.recv_x.local.fill_(float("nan"))

    def _finish(self, rows: int) -> None:
        out = self.out.local.view(-1, self.hidden)[:rows]
        self.y[:rows].copy_(out * self.gate[:rows, None])
        self.out.local.fill_(float("nan"))

    def _capture(self) -> None:
        """Warm up (launches of no slots: nothing written; the gate's ops), then capture each
        bucket's three graphs."""
        ep_dispatch(self.x, self.expert, self.num_tokens, self.recv_idx.table,
                    self.recv_x.table, 0, self.rank, self.experts_per_rank)  # fmt: skip
        tables = (self.recv_idx.table, self.recv_x.table, self.out.table)
        ep_expert_combine(self.weights, *tables, 0, self.rank)
        torch.softmax(self.x @ self._router, dim=-1).max(dim=-1)
        pool = None
        if self.device == "cuda":
            pool, self._primer = poisoned_pool()
        for rows in self.capture_sizes:
            graphs = {}
            for name, phase in zip(PHASES, (self._dispatch, self._combine, self._finish),
                                   strict=True):  # fmt: skip
                with capturing(self.launcher, self.device, pool) as graph:
                    phase(rows)
                graphs[name] = graph
            self.graphs[rows] = graphs

    # -- a step -----------------------------------------------------------------------------

    def bucket(self, local: int, agreed: int) -> int:
        """The capture size this rank replays: the smallest that holds the count it goes by."""
        count = local
        if Fix.EP_GRAPH_BUCKET_AGREED in self.fixes:
            # fix: ep_graph_bucket_agreed -- every EP rank replays the bucket of the agreed count
            count = agreed
        fits = [size for size in self.capture_sizes if size >= max(count, 1)]
        if not fits:
            raise ValueError(f"{count} tokens past the largest capture size {self.capture_sizes}")
        return fits[0]

    def _barrier(self) -> None:
        """Every rank's last phase done (its peer writes landed) before any rank's next one."""
        host_sync(self.launcher, self.device)
        self.collectives.all_reduce(torch.zeros(1, dtype=torch.int32, device=self.device))

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """One decode step of this rank's tokens `x` [n, hidden] (n may be 0: an idle rank
        still joins the step); the layer's output [n, hidden]."""
        n = x.shape[0]
        counts = torch.zeros(self.ep, dtype=torch.int32, device=self.device)
        counts[self.rank] = n
        self.collectives.all_reduce(counts)  # the token counts every rank agrees on
        self.counts_across_ep = [int(c) for c in counts.tolist()]
        rows = self.rows = self.bucket(n, max(self.counts_across_ep))
        if n > rows:
            raise ValueError(f"{n} tokens past the bucket of {rows} rows")
        self.x.zero_()
        self.x[:n].copy_(x)
        self.num_tokens.fill_(n)
        graphs = self.graphs[rows]
        graphs["dispatch"].replay()
        self._barrier()
        graphs["combine"].replay()
        self._barrier()
        graphs["finish"].replay()
        out = self.y[:n].clone()
        self.collectives.end_step()
        return out

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output in float64 (every expert's weights, on the CPU)."""
        x = x.detach().double().cpu()
        probs = torch.softmax(x @ self.router.double(), dim=-1)
        gate, expert = probs.max(dim=-1)
        experts = self.all_experts.double()[expert]  # [n, hidden, hidden]: each token's
        return gate[:, None] * torch.einsum("nk,nkh->nh", x, experts)
