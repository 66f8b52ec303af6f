"""Fix-site mutants of graph_output_alias: copies that still alias the pool, or come late."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.GRAPH_OUTPUT_COPY_BEFORE_DRAFT
RUNNER = "harness/runner/model_runner.py"
COPY = "            hidden = hidden.clone()\n"
GUARD = "        if Fix.GRAPH_OUTPUT_COPY_BEFORE_DRAFT in self.fixes:\n"
DRAFT = (
    "        self.draft_hidden[: desc.num_tokens].copy_(hidden)\n"
    "        self.drafter_graphs.run(desc)\n"
)

MUTANTS = (
    Mutant(
        "copy_after_the_drafter",
        PART,
        "ordering",
        RUNNER,
        COPY + DRAFT,
        "            pass\n" + DRAFT + "        hidden = hidden.clone()\n",
        "the hidden states are copied once the drafter has replayed: a copy of its outputs",
    ),
    Mutant(
        "detach_for_a_copy",
        PART,
        "unused_state",
        RUNNER,
        COPY,
        "            hidden = hidden.detach()\n",
        "detach() taken for a copy: a new tensor on the same pool memory",
    ),
    Mutant(
        "contiguous_for_a_copy",
        PART,
        "unused_state",
        RUNNER,
        COPY,
        "            hidden = hidden.contiguous()\n",
        "contiguous() copies only a strided tensor: the graph output is contiguous already",
    ),
    Mutant(
        "logits_copied_instead",
        PART,
        "wrong_row",
        RUNNER,
        COPY,
        "            logits = logits.clone()\n",
        "the copy protects the sampler's logits (already consumed) and leaves the hidden states",
    ),
    Mutant(
        "copy_for_piecewise_only",
        PART,
        "partial",
        RUNNER,
        GUARD,
        GUARD.replace(":\n", " and desc.cg_mode == PIECEWISE:\n"),
        "only the PIECEWISE path the upstream report names copies; FULL replays share the pool",
    ),
    Mutant(
        "copy_for_prefill_only",
        PART,
        "partial",
        RUNNER,
        GUARD,
        GUARD.replace(":\n", " and batch.num_tokens > batch.num_reqs:\n"),
        "only prefill steps (prompt logprobs' steps) copy: a replayed decode step's hidden "
        "states are the drafter's",
    ),
    Mutant(
        "copy_with_prompt_logprobs_only",
        PART,
        "partial",
        RUNNER,
        GUARD,
        GUARD.replace(":\n", " and self.config.prompt_logprobs:\n"),
        "only a runner reading prompt logprobs copies: with them off, the hidden states the "
        "step returns are the drafter's",
    ),
)
