"""Fix-site mutants of lora_graph_capture: the launch fix applied to part of the LoRA state."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.LORA_CAPTURE_LAUNCH
RUNNER = "harness/runner/model_runner.py"
CLEAR = "\n                    meta.no_lora_flag_cpu[0] = False"
METAS = "for meta in (wrapper.token_mapping_meta, wrapper.prompt_mapping_meta):"
MAPPING = (
    "        adapter_manager.set_adapter_mapping("
    "LoRAMapping((0,) * num_tokens, (0,) * num_reqs, True))\n"
)
FIX = """        if Fix.LORA_CAPTURE_LAUNCH in self.fixes:
            # fix: lora_capture_launch -- launch (so capture) LoRA kernels; programs see -1, exit.
            for wrapper in adapter_manager.distinct_wrappers():
                for meta in (wrapper.token_mapping_meta, wrapper.prompt_mapping_meta):
                    meta.no_lora_flag_cpu[0] = False
                    meta.num_active_loras_cpu[0] = 1
"""

MUTANTS = (
    Mutant(
        "token_meta_only",
        PART,
        "partial",
        RUNNER,
        METAS + CLEAR,
        "for meta in (wrapper.token_mapping_meta,):" + CLEAR,
        "the flags are cleared on the token meta only (the LM head reads the prompt meta)",
    ),
    Mutant(
        "first_wrapper_only",
        PART,
        "partial",
        RUNNER,
        "for wrapper in adapter_manager.distinct_wrappers():\n                for meta",
        "for wrapper in adapter_manager.distinct_wrappers()[:1]:\n                for meta",
        "only the first distinct punica wrapper is fixed",
    ),
    Mutant(
        "flag_cleared_count_left",
        PART,
        "partial",
        RUNNER,
        "                    meta.num_active_loras_cpu[0] = 1\n",
        "",
        "no_lora_flag_cpu is cleared but num_active_loras_cpu stays 0",
    ),
    Mutant(
        "count_set_to_zero",
        PART,
        "boundary",
        RUNNER,
        "                    meta.num_active_loras_cpu[0] = 1\n",
        "                    meta.num_active_loras_cpu[0] = 0\n",
        "num_active_loras_cpu is set to 0 instead of 1",
    ),
    Mutant(
        "flags_before_the_mapping",
        PART,
        "ordering",
        RUNNER,
        MAPPING + FIX,
        FIX + MAPPING,
        "the flags are cleared before the dummy mapping, which sets them again",
    ),
    Mutant(
        "every_prefix_not_every_wrapper",
        PART,
        "partial",
        RUNNER,
        "for wrapper in adapter_manager.distinct_wrappers():\n                for meta",
        "for wrapper in adapter_manager.punica_wrapper_mapping.values():\n                for meta",
        "the fix walks the prefixes (shared wrappers twice) instead of distinct wrappers",
        equivalent="clearing the same flags twice changes nothing",
    ),
)
