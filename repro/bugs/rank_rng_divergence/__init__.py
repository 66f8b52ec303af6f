"""rank_rng_divergence (vLLM #17929): tensor-parallel ranks with an unset seed sample apart.

Under tensor parallelism every rank runs the sampler on the same logits; where each worker's
random state is its own (V1's default seed was None: each worker process unseeded), the ranks
draw different uniforms, so speculative decoding's rejection sampler accepts different drafts
on different ranks. The ranks then disagree on how many tokens they kept, and the drafter's
tensor-parallel collectives, whose shape is that count, no longer match. The fix: the unset
seed defaults to 0, which every worker seeds with. Runs as two rank processes
(Scenario.ranks): `python -m repro.bugs.rank_rng_divergence`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

MISMATCH = ByDevice.both(Outcome.COLLECTIVE_MISMATCH)
PART = Fix.SEED_DEFAULT_ZERO

# How true to upstream (DESIGN.md 15), graded by what was read (search, issues and code corpora).
FIDELITY = Fidelity(
    grade="simplified",
    evidence=(
        "#17929's description (merged, 2025-05-10: with seed=None, V1's tensor-parallel "
        "workers sample different tokens independently, harmless while only rank 0's output "
        "was used, a problem for spec decoding, which needs the workers to agree; fix: the "
        "default seed becomes 0 in V1) and its review hunk (ModelConfig.__post_init__ sets "
        "the default seed); vLLM docs/usage/reproducibility.md (V1's seed defaults to 0 and "
        "cannot be unset because workers must sample alike for spec decoding, citing #17929); "
        "issue #17498's title (rejection sampler accepts different tokens when TP > 1 and "
        "temperature > 0); #31288's description (closed: ngram drafts diverging across TP "
        "ranks under external_launcher, numba's parallel execution; fix: rank 0 proposes and "
        "broadcasts, for issue #31154); #31307's description (closed, same author and issue: "
        "ngram and suffix drafts broadcast from rank 0; divergent draft counts made the ranks' "
        "num_tokens differ and NCCL collectives hang)"
    ),
    not_verified=(
        "#17929's diff beyond its one review hunk; issue #17498's body and its reproducer; "
        "issue #31154 itself (only the two PRs that cite it); which drafter collective "
        "upstream hangs in first"
    ),
    what=(
        "the runner models probabilistic rejection sampling of one request's drafts (the "
        "uniform draws from the runner's sampling generator; the recovered and bonus tokens "
        "are the target's most probable, not sampled) and the drafter's first tensor-parallel "
        "all-reduce over the kept tokens (upstream: EAGLE's prepare_inputs drops rejected "
        "tokens); each rank runs its own engine loop (an external launcher's layout); an "
        "unseeded worker's random state is its process's initial seed, which the scenario sets "
        "apart per rank (upstream: OS entropy); #31288/#31307's broadcast fix is not modelled "
        "(its proposers are not random); the buggy outcome is the harness's trace oracle "
        "(collective_mismatch), where upstream saw an NCCL hang or diverging outputs"
    ),
)

RECORD = BugRecord(
    id="rank_rng_divergence",
    title="Tensor-parallel ranks with an unset seed accept different drafts, then mismatch",
    upstream="https://github.com/vllm-project/vllm/pull/17929",
    symptom=(
        "with TP > 1, speculative decoding and temperature > 0, the rejection sampler accepts "
        "different tokens on different TP ranks (#17498); the ranks' next collectives differ "
        "in shape (an NCCL hang, as #31307 reports for diverging draft counts) or the ranks "
        "go on with different tokens"
    ),
    root_cause=(
        "V1's default seed was None, so each worker process kept its own random state; the "
        "rejection sampler's uniforms differed per rank, and the count of accepted tokens "
        "(the shape of the drafter's input) with them"
    ),
    trigger=(
        "two TP ranks, seed unset, a draft whose acceptance ratio lies between the two "
        "ranks' uniform draws"
    ),
    fix_parts=(PART,),
    buggy_outcome=MISMATCH,
    scenarios=(
        Scenario(
            "tp_ranks_verify_drafts",
            (Expect(frozenset({PART}), MISMATCH),),
            timeout_s=120.0,
            axes=Axes(
                graph_modes=("NONE",),
                states=(
                    "one draft",
                    "several drafts",
                    "rejections in a row",
                    "TP ranks sample drafts' acceptance, seed unset",
                    "the sampling stream goes on across verify steps",
                ),
            ),
            signature=(
                r"step 1: rank \d all_reduce\(tp, \(\d+, \d+\), \w+\) vs rank \d "
                r"all_reduce\(tp, \(\d+, \d+\), \w+\)"
            ),
            ranks=4,  # DP 2 x TP 2: the fix holds under data parallelism too
        ),
        Scenario(
            "tp_pair_verify_drafts",
            (Expect(frozenset({PART}), MISMATCH),),
            timeout_s=120.0,
            axes=Axes(
                graph_modes=("NONE",),
                states=("several drafts", "TP ranks sample drafts' acceptance, seed unset"),
            ),
            signature=(
                r"step 1: rank \d all_reduce\(tp, \(\d+, \d+\), \w+\) vs rank \d "
                r"all_reduce\(tp, \(\d+, \d+\), \w+\)"
            ),
            ranks=2,  # TP 2 alone: NCCL with one GPU per rank on a two-GPU machine
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    fuzz=(
        "not drawn yet: ranks (a tensor-parallel world of two workers) and speculative "
        "verify steps with draft probabilities; a program drives one worker and no drafts"
    ),
    anchors=(
        (
            PART,
            "vllm/config.py, ModelConfig.__post_init__ (#17929): in V1 an unset seed becomes "
            "0, so each worker's set_random_seed seeds every TP rank alike (the rejection "
            "sampler, vllm/v1/sample/rejection_sampler.py, draws its uniforms from that state)",
        ),
    ),
    history=(
        "Verified upstream (search, issues and code corpora): #17929 (merged, 2025-05-10) "
        "made V1's default seed 0 so TP workers sample alike for spec decoding; issue #17498 "
        "(closed) reported the rejection sampler accepting different tokens across TP ranks "
        "at temperature > 0; vLLM's reproducibility doc says the V1 seed cannot be unset for "
        "this reason. Siblings: #31288 and #31307 (both closed, unmerged, 2025-12-24, for issue "
        "#31154) broadcast TP rank 0's ngram (and suffix) drafts, since numba's parallel "
        "proposer diverged across ranks although their seeds agreed: a divergence of the "
        "proposer, not of the seed, so not this fix part. Relatives in this catalogue: "
        "dp_zero_token_skip (ranks that skip a collective)."
    ),
)
