"""Fix-site mutants of reload_derived_rebind: regressions a refactor of post-load processing or
of the reload could make."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.RELOAD_DERIVED_IN_PLACE
POST_LOAD, MODEL = "harness/runner/post_load.py", "harness/runner/model.py"
COPY = "                self.tensors[name].copy_(fresh)\n"
REFRESH = """        if self.derived is not None:
            self.derived.refresh(self.head, self.embed, self.fixes)
"""
PARAMS = """        for name in ("embed", "head", "mlp", "experts", "gate"):
            if getattr(self, name) is not None:
                getattr(self, name).copy_(weights[name])
"""
ATTN = """        for mine, fresh in zip(self.attn, weights["attn"], strict=True):
            for w, f in zip(mine, fresh, strict=True):
                w.copy_(f)
"""

MUTANTS = (
    Mutant(
        "rebind_storage_through_data",
        PART,
        "unused_state",
        POST_LOAD,
        COPY,
        "                self.tensors[name].data = fresh\n",
        "the tensor object is kept but its storage swapped (the .data assignment of #46009): the "
        "model's tensor is right, a graph captured before reads the old address",
    ),
    Mutant(
        "refresh_a_copy",
        PART,
        "unused_state",
        POST_LOAD,
        COPY,
        "                self.tensors[name].clone().copy_(fresh)\n",
        "the new values are written into a copy of the derived tensor, not into its storage",
    ),
    Mutant(
        "only_the_first_derived_tensor",
        PART,
        "partial",
        POST_LOAD,
        "        for name, fresh in derive(head, embed).items():\n",
        "        for name, fresh in list(derive(head, embed).items())[:1]:\n",
        "the reload refreshes one derived tensor (MLA's pair but not the sinks' copy): the "
        "float32 embedding table keeps the old checkpoint",
    ),
    Mutant(
        "derive_before_the_parameters_reload",
        PART,
        "ordering",
        MODEL,
        PARAMS + ATTN + REFRESH,
        REFRESH + PARAMS + ATTN,
        "post-load processing runs before the checkpoint is written: it derives the previous "
        "weights (after a level-2 wake, the fresh memory's NaN)",
    ),
    Mutant(
        "reload_skips_post_load",
        PART,
        "partial",
        MODEL,
        REFRESH,
        "",
        "the reload writes the parameters only: the derived tensors keep the load's values (a "
        "weight update path that skips process_weights_after_loading)",
    ),
    Mutant(
        "derive_from_the_old_head",
        PART,
        "wrong_row",
        MODEL,
        "            self.derived.refresh(self.head, self.embed, self.fixes)\n",
        "            self.derived.refresh(self.derived.tensors['head_t'].T, self.embed, "
        "self.fixes)\n",
        "the transpose is derived again from the derived tensor itself, not from the reloaded "
        "parameter: it keeps the previous checkpoint's values (NaN after a level-2 wake)",
    ),
)
