"""A tensor-parallel target and drafter over the custom all-reduce, with CUDA graphs per batch
descriptor (the runner's TP path in miniature).

Each model is one row-parallel projection (upstream: RowParallelLinear): rank r holds rows
[r*s, (r+1)*s) of the weight and multiplies columns [r*s, (r+1)*s) of the hidden states by
them; the partial sums are all-reduced across the TP ranks (custom_allreduce.py), so every rank
ends with hidden @ weight. A dummy run runs the target and then the drafter (upstream:
_dummy_run runs drafter.dummy_run after the target), each through its graph when one is
captured for its key: captured while capturing, replayed once captured (upstream: the
CUDA-graph wrapper replays an entry it has, captures one it lacks).

`capture_model` captures every size and LoRA case, largest size first, inside the custom
all-reduce's capture window, as upstream's capture loop runs inside graph_capture(): with LoRA
graphs specialised (vLLM #25914, #32005) each size's dummy run runs once per LoRA case. The
target's key holds the LoRA case; the drafter's holds it only with the fix part of vLLM #28318:
without it, the second case of a size finds the draft graph captured by the first and replays
it, inside the window, before its all-reduce's rank-data rows are registered (vLLM #28334).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from harness.fixes import ALL_FIXES, Fix, Variant
from harness.runner.cudagraph import Graph, Launcher, capturing, poisoned_pool
from harness.runner.custom_allreduce import CustomAllReduce
from harness.runner.parallel import ParallelConfig

Key = tuple  # ("target" | "draft", num_tokens[, lora_case])


class RowParallelLinear:
    """out = hidden @ weight, this rank's rows of `weight` (the full weight, every rank's
    alike) times its columns of `hidden`, the partial sums all-reduced."""

    def __init__(self, weight: torch.Tensor, parallel: ParallelConfig, comm: CustomAllReduce):
        rows = weight.shape[0] // parallel.tensor_parallel_size
        self.cols = slice(parallel.tp_rank * rows, (parallel.tp_rank + 1) * rows)
        self.weight = weight[self.cols].contiguous()
        self.comm = comm

    def forward(self, hidden: torch.Tensor, out: torch.Tensor) -> None:
        partial = self.comm.alloc(out.numel()).view(out.shape)  # captured: the graph's memory
        self.comm.launch(torch.matmul, hidden[:, self.cols], self.weight, out=partial)
        self.comm.all_reduce(partial, out)


class TPSpecRunner:
    """A target and a drafter of one row-parallel projection each, over one custom
    all-reduce; persistent hidden states (`hidden`), outputs (`target_out`, `draft_out`)."""

    def __init__(
        self,
        parallel: ParallelConfig,
        device: str,
        directory: str,
        fixes: Variant = ALL_FIXES,
        hidden_size: int = 16,
        max_num_tokens: int = 8,
        capture_sizes: tuple[int, ...] = (8, 4),
        lora_cases: tuple[int, ...] = (1, 0),
        seed: int = 0,
        name: str = "car",  # the all-reduce's buffers' name (unique within a run)
        lag_rank: int | None = None,  # the all-reduce's lagging rank (a forced order)
    ) -> None:
        self.parallel, self.device, self.fixes = parallel, device, fixes
        self.capture_sizes, self.lora_cases = capture_sizes, lora_cases
        self.launch = Launcher()
        self.comm = CustomAllReduce(
            parallel,
            device,
            directory,
            self.launch,
            fixes,
            max_numel=max_num_tokens * hidden_size,
            name=name,
            lag_rank=lag_rank,
        )
        g = torch.Generator().manual_seed(seed)  # every rank's weights alike
        shape = (hidden_size, hidden_size)
        self.weights = {m: torch.randn(shape, generator=g) for m in ("target", "draft")}
        self.layers = {
            m: RowParallelLinear(w.to(device), parallel, self.comm) for m, w in self.weights.items()
        }
        zeros = lambda: torch.zeros(max_num_tokens, hidden_size, device=device)
        self.hidden, self.target_out, self.draft_out = zeros(), zeros(), zeros()
        self.graphs: dict[Key, Graph] = {}
        self.replayed_in_window: list[Key] = []  # what the scenario reports
        self.replayed: list[Key] = []  # every graph replayed after the window, in order
        # called before each model's run outside the capture window (a scenario's forced order
        # of the ranks' all-reduces: each run holds one)
        self.order: Callable[[], None] | None = None
        self.pool = None  # GPU: one poisoned pool for every graph, made at the first capture

    # -- forward ------------------------------------------------------------------------------

    def _forward(self, model: str, n: int) -> None:
        out = self.target_out if model == "target" else self.draft_out
        source = self.hidden if model == "target" else self.target_out  # the drafter reads it
        self.layers[model].forward(source[:n], out[:n])

    def _run(self, key: Key, graphs: bool) -> None:
        """With graphs: replay `key`'s graph if captured, else capture it inside the capture
        window (elsewhere: eager, as a descriptor no graph serves). Without: eager."""
        model, n = key[0], key[1]
        if self.order is not None and not self.comm.in_window:
            self.order()
        if graphs and key in self.graphs:
            (self.replayed_in_window if self.comm.in_window else self.replayed).append(key)
            self.graphs[key].replay()
        elif graphs and self.comm.in_window:
            if self.device == "cuda" and self.pool is None:
                self.pool, self._primer = poisoned_pool()
            with capturing(self.launch, self.device, self.pool) as graph:
                self._forward(model, n)
            self.graphs[key] = graph
        else:
            self._forward(model, n)

    def dummy_run(
        self, num_tokens: int, lora_case: int, graphs: bool = False, draft: bool = True
    ) -> None:
        """The target's run at `num_tokens` for `lora_case`, then the drafter's (graphs:
        through their graphs, captured if missing inside the capture window)."""
        self._run(("target", num_tokens, lora_case), graphs)
        if not draft:
            return
        draft_key: Key = ("draft", num_tokens)  # upstream: the drafter's own descriptor
        if Fix.DRAFT_GRAPH_LORA_KEY in self.fixes:
            # fix: draft_graph_lora_key -- the drafter's dummy run takes the target's descriptor,
            # its LoRA case with it, so each case captures its own draft graph (none replays)
            draft_key = ("draft", num_tokens, lora_case)
        self._run(draft_key, graphs)

    def capture_model(self) -> None:
        """Inside the custom all-reduce's capture window, per size (largest first) and LoRA
        case: an eager warm-up dummy run, then the dummy run captured. The window's end
        registers every captured all-reduce."""
        with self.comm.capture():
            for n in sorted(self.capture_sizes, reverse=True):
                for case in self.lora_cases:
                    self.dummy_run(n, case, graphs=False)  # warm-up (compiles, tunes)
                    self.dummy_run(n, case, graphs=True)

    # -- steps --------------------------------------------------------------------------------

    def step(
        self, hidden: torch.Tensor, lora_case: int, use_graph: bool = True, draft: bool = True
    ):
        """A step of `hidden` (its rows the step's tokens): the target, then the drafter (not
        without `draft`), each replaying its graph for the smallest captured size that fits
        (eager: none fits, or not use_graph). Views of target_out and draft_out."""
        n = hidden.shape[0]
        self.hidden[:n].copy_(hidden)
        fits = [s for s in self.capture_sizes if s >= n] if use_graph else []
        size = min(fits) if fits else n
        self.hidden[n:size].zero_()  # padding rows
        self.dummy_run(size, lora_case, graphs=bool(fits), draft=draft)
        return self.target_out[:n], self.draft_out[:n]
