"""Fix-site mutants of car_register_before_replay: regressions of the drafter's graph key,
each leaving some dummy run of the capture loop replaying a draft graph inside the window."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.DRAFT_GRAPH_LORA_KEY
RUNNER = "harness/runner/tensor_parallel.py"
KEY = '            draft_key = ("draft", num_tokens, lora_case)'
GATE = "        if Fix.DRAFT_GRAPH_LORA_KEY in self.fixes:"

MUTANTS = (
    Mutant(
        "lora_case_as_a_flag",
        PART,
        "partial",
        RUNNER,
        KEY,
        KEY.replace("lora_case)", "lora_case > 0)"),
        "the key says LoRA or not (#25914's has_lora), not how many adapters (#32005's counts): "
        "the case of one adapter replays the draft graph of two",
    ),
    Mutant(
        "cases_zero_and_one_merged",
        PART,
        "boundary",
        RUNNER,
        KEY,
        KEY.replace("lora_case)", "lora_case or 1)"),
        "no LoRA keyed as one adapter: the last case replays the one-adapter draft graph",
    ),
    Mutant(
        "cases_by_parity",
        PART,
        "wrong_row",
        RUNNER,
        KEY,
        KEY.replace("lora_case)", "lora_case % 2)"),
        "two adapters and none share a key: the case of none replays the draft graph of two",
    ),
    Mutant(
        "largest_size_for_every_size",
        PART,
        "wrong_row",
        RUNNER,
        KEY,
        KEY.replace("num_tokens, lora_case)", "max(self.capture_sizes), lora_case)"),
        "the drafter's key takes the largest size: a smaller size replays its draft graph",
    ),
    Mutant(
        "key_only_at_the_largest_size",
        PART,
        "partial",
        RUNNER,
        GATE,
        GATE.replace(":", " and num_tokens == max(self.capture_sizes):"),
        "the LoRA case joins the key at the first (largest) size only: the window's later "
        "sizes replay their draft graphs",
    ),
    Mutant(
        "key_only_past_three_cases",
        PART,
        "boundary",
        RUNNER,
        GATE,
        GATE.replace(":", " and len(self.lora_cases) > 3:"),
        "the LoRA case joins the key only for more cases than three: three cases replay",
    ),
)
