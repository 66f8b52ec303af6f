"""A speculator's draft prefill: each request's last hidden state, gathered through a
persistent last_token_indices buffer, through the draft model (here the identity) and the LM
head it shares with the target: its draft logits.

NOTE: last_token_indices [max_num_reqs] and the outputs are persistent: a FULL graph captured
for N padded requests gathers the first N indices at every replay (upstream: the speculator's
FULL prefill graph). prepare() writes the live requests' indices every step; the entries past
them keep what an earlier step with more requests wrote unless they are padded (vLLM #39773).
They are stale, not poison: the buffer is made at start-up, not by a capture.
"""

from __future__ import annotations

import torch

from harness.fixes import Fix, Variant
from harness.runner.cudagraph import Launcher
from harness.runner.input_batch import InputBatch


class DraftPrefill:
    def __init__(
        self, max_num_reqs: int, lm_head: torch.Tensor, device: str, fixes: Variant
    ) -> None:
        vocab, hidden = lm_head.shape
        self.lm_head, self.fixes = lm_head, fixes  # [vocab, hidden], the target's
        self.last_token_indices = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.sample = torch.zeros(max_num_reqs, hidden, dtype=lm_head.dtype, device=device)
        self.draft_logits = torch.zeros(max_num_reqs, vocab, dtype=lm_head.dtype, device=device)

    def prepare(self, batch: InputBatch) -> None:
        """Before the step's forward: the index of each live request's last token (upstream:
        prepare_prefill_inputs, which also corrects for rejected tokens: none here)."""
        r = batch.num_reqs
        torch.sub(batch.query_start_loc[1 : r + 1], 1, out=self.last_token_indices[:r])
        if Fix.SPEC_PAD_LAST_TOKEN_INDICES in self.fixes:
            # fix: spec_pad_last_token_indices -- a graph for more requests gathers these too.
            self.last_token_indices[r:].zero_()

    def forward(self, hidden_states: torch.Tensor, num_reqs: int, launch: Launcher) -> None:
        """Draft logits of the first `num_reqs` requests (padding included in a FULL graph)
        from the step's hidden states [num_tokens, hidden]; an index past them fails the
        gather (a device-side assert on the GPU, IndexError on the CPU)."""
        sample, logits = self.sample[:num_reqs], self.draft_logits[:num_reqs]
        launch(torch.index_select, hidden_states, 0, self.last_token_indices[:num_reqs], out=sample)
        launch(torch.mm, sample, self.lm_head.T, out=logits)
