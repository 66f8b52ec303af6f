"""Fix-site mutants of lora_dummy_run: the dummy LoRA mapping set short, late or wrong."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.LORA_DUMMY_MAPPING
RUNNER = "harness/runner/model_runner.py"
MAPPING = "LoRAMapping((0,) * num_tokens, (0,) * num_reqs, True)"
DUMMY_BRANCH = """            self._set_dummy_lora_state(num_tokens, num_reqs)
            return self._eager(batch, self.kv_cache.metadata(batch))"""

MUTANTS = (
    Mutant(
        "mapping_one_token_short",
        PART,
        "boundary",
        RUNNER,
        MAPPING,
        "LoRAMapping((0,) * (num_tokens - 1), (0,) * num_reqs, True)",
        "the dummy mapping covers one token fewer than the dummy batch",
    ),
    Mutant(
        "prompt_mapping_one_request_short",
        PART,
        "partial",
        RUNNER,
        MAPPING,
        "LoRAMapping((0,) * num_tokens, (0,) * (num_reqs - 1), True)",
        "the prompt mapping (LM head) misses the last dummy request",
    ),
    Mutant(
        "mapping_names_a_real_adapter",
        PART,
        "wrong_row",
        RUNNER,
        MAPPING,
        "LoRAMapping((1,) * num_tokens, (1,) * num_reqs, True)",
        "the dummy mapping uses LoRA id 1 (a loaded adapter) instead of 0 (none)",
    ),
    Mutant(
        "mapping_after_the_dummy_forward",
        PART,
        "ordering",
        RUNNER,
        DUMMY_BRANCH,
        "            out = self._eager(batch, self.kv_cache.metadata(batch))\n"
        "            self._set_dummy_lora_state(num_tokens, num_reqs)\n"
        "            return out",
        "the dummy branch sets the mapping after the forward that needs it",
    ),
    Mutant(
        "capture_hook_maps_the_smallest_size",
        PART,
        "boundary",
        RUNNER,
        "self._set_dummy_lora_state(max(c.graphs.cudagraph_sizes), c.max_num_reqs)",
        "self._set_dummy_lora_state(min(c.graphs.cudagraph_sizes), c.max_num_reqs)",
        "the capture hook maps the smallest capture size; larger captures read unset rows",
    ),
    Mutant(
        "mapping_not_prefill",
        PART,
        "wrong_row",
        RUNNER,
        MAPPING,
        "LoRAMapping((0,) * num_tokens, (0,) * num_reqs, False)",
        "the dummy mapping is marked decode",
        equivalent="is_prefill selects nothing in this runner's LoRA plumbing",
    ),
    Mutant(
        "dummy_mapping_sized_for_capture",
        PART,
        "boundary",
        RUNNER,
        "            self._set_dummy_lora_state(num_tokens, num_reqs)\n",
        "            self._capture_lora_state(None)\n",
        "a dummy run takes the capture hook's state, sized for the largest capture size: a "
        "profile run of max_num_tokens reads the rest unset (found by an independent regression)",
    ),
    Mutant(
        "dummy_mapping_needs_an_adapter",
        PART,
        "partial",
        RUNNER,
        "        adapter_manager = self.lora_manager._adapter_manager\n",
        "        adapter_manager = self.lora_manager._adapter_manager\n"
        "        if all(i is None for i in adapter_manager.lora_index_to_id):\n"
        "            return\n",
        "the dummy mapping is skipped while no adapter is loaded, as at a startup profile run "
        "(found by an independent regression)",
    ),
    Mutant(
        "dummy_mapping_for_graphs_only",
        PART,
        "partial",
        RUNNER,
        "        adapter_manager = self.lora_manager._adapter_manager\n",
        "        if self.config.graphs.cudagraph_mode == CUDAGraphMode.NONE:\n"
        "            return\n"
        "        adapter_manager = self.lora_manager._adapter_manager\n",
        "the dummy mapping is taken for a capture concern and skipped on an eager runner, whose "
        "profile run gathers garbage (found by an independent regression)",
    ),
)
