"""A drafter among data-parallel ranks: after each step, `num_speculative_tokens` draft tokens
per request (upstream: the EAGLE/MTP proposer that gpu_model_runner's sample_tokens calls).

Each draft step first agrees with the other DP ranks on each rank's draft batch, (tokens,
requests) per rank (upstream: the drafter's forward pads to the DP ranks' batch through
coordinate_batch_across_dp, and a MoE drafter's experts exchange tokens across the ranks), so
every DP rank must run as many draft steps as its peers, every step. The draft model is the
target's embedding and LM head, greedy: draft i+1 = argmax(embed[draft i] @ head.T), from the
step's sampled token, in float32 (the weights are small integers: exact in every dtype).

Near max_model_len a batch cannot take its drafts (its longest sequence plus the drafts past
max_model_len; upstream: _input_fits_in_drafter, decided by each rank on its own batch): the
rank proposes none. The fix part of vLLM #40589 (#44954 for issue #44185) lives here: such a
rank still runs the drafter's dummy steps, as an idle rank's dummy run does.
"""

from __future__ import annotations

import torch

from harness.fixes import Fix
from harness.runner.input_batch import Request
from harness.runner.model import TinyLoRADecoder
from harness.runner.parallel import Collectives, ParallelConfig


class Drafter:
    def __init__(
        self,
        model: TinyLoRADecoder,
        num_speculative_tokens: int,
        max_model_len: int,
        parallel: ParallelConfig,
        collectives: Collectives,
        fixes,
    ) -> None:
        self.model, self.k, self.max_model_len = model, num_speculative_tokens, max_model_len
        self.parallel, self.collectives, self.fixes = parallel, collectives, fixes
        # each draft step's agreement of the last proposal or dummy run: per DP rank, its draft
        # batch's (tokens, requests) (None: one DP rank, nothing agreed)
        self.batches_across_dp: list[list[list[int]]] | None = None

    def fits(self, requests: list[Request]) -> bool:
        """Whether the batch can take its drafts: its longest sequence after this step, plus
        the drafts, within max_model_len."""
        longest = max(q.num_computed_tokens + len(q.token_ids) for q in requests)
        return longest + self.k <= self.max_model_len

    def propose(self, requests: list[Request], logits: torch.Tensor) -> torch.Tensor | None:
        """[num_reqs, k] draft tokens after each request's sampled one (None: the batch cannot
        take drafts)."""
        if not self.fits(requests):
            if Fix.DP_DRAFTER_DUMMY_RUN in self.fixes and self.parallel.data_parallel_size > 1:
                # fix: dp_drafter_dummy_run -- the ranks whose batches fit run the drafter's
                # steps, each agreeing with this rank: it joins them with dummy steps
                self.dummy_run()
            return None
        self.batches_across_dp = [] if self.parallel.data_parallel_size > 1 else None
        num_tokens = sum(len(q.token_ids) for q in requests)  # the first step reads them all
        tokens, drafts = logits.argmax(-1), []
        for _ in range(self.k):
            tokens = self._draft_step(tokens, num_tokens)
            drafts.append(tokens)
            num_tokens = len(requests)  # later steps: one token per request
        return torch.stack(drafts, 1)

    def dummy_run(self, num_tokens: int = 1) -> None:
        """The drafter's steps on a dummy batch of one request (upstream: drafter.dummy_run),
        joining each step's agreement; no drafts."""
        self.batches_across_dp = [] if self.parallel.data_parallel_size > 1 else None
        tokens = torch.zeros(1, dtype=torch.int64, device=self.model.device)
        for _ in range(self.k):
            tokens = self._draft_step(tokens, num_tokens)

    def _draft_step(self, tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """One draft step for `tokens` (one per request), `num_tokens` in its batch."""
        self._coordinate_dp(num_tokens, len(tokens))
        scores = self.model.embed[tokens].float() @ self.model.head.float().T
        return scores.argmax(-1)

    def _coordinate_dp(self, num_tokens: int, num_reqs: int) -> None:
        """Agree with the other DP ranks on each one's draft batch (an all-reduce of one
        (tokens, requests) row per DP rank). Every DP rank must join each draft step's."""
        p = self.parallel
        if p.data_parallel_size == 1:
            return
        batches = torch.zeros(p.data_parallel_size, 2, dtype=torch.int32, device=self.model.device)
        batches[p.dp_rank, 0], batches[p.dp_rank, 1] = num_tokens, num_reqs
        self.collectives.all_reduce(batches, "dp")
        self.batches_across_dp.append(batches.tolist())
