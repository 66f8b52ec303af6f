"""Post-load processing: runtime tensors the forward reads, derived from the parameters after
every load (upstream: a layer's process_weights_after_loading, which MLA uses to absorb
kv_b_proj into W_UV and W_UK_T, and FlashInfer to keep a float32 copy of the attention sinks).

With ModelConfig.derived_weights the decoder derives two: the LM head transposed and made
contiguous (the logits GEMM's operand, [hidden, vocab]: a permuted copy, as W_UK_T is) and a
float32 copy of the embedding table (the gather's operand: a dtype-converted copy, as the
sinks' is). The first derivation lands in the weights pool with the parameters; every
reload_weights() (a trainer's weight update, the reload of a level-2 wake) derives them again.
The fix part of vLLM #48251 writes the new values into the tensors' existing storage; without
it the reload binds new tensors: eager steps read those, while a graph captured before the
reload replays the old storage (the old weights after a plain reload, the wake's 0xFF bytes,
NaN, after a level-2 sleep).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from harness.fixes import Fix, Variant


def derive(head: torch.Tensor, embed: torch.Tensor) -> dict[str, torch.Tensor]:
    """The derived tensors of these parameters, by name (new allocations)."""
    return {
        "head_t": head.T.contiguous(),  # [hidden, vocab]
        "embed_f32": embed.to(torch.float32, copy=True),  # [vocab, hidden]
    }


class DerivedWeights:
    """The derived tensors (`tensors[name]`), and their refresh at a reload."""

    def __init__(
        self,
        head: torch.Tensor,
        embed: torch.Tensor,
        place: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.tensors = {name: place(t) for name, t in derive(head, embed).items()}

    def refresh(self, head: torch.Tensor, embed: torch.Tensor, fixes: Variant) -> None:
        """Derive again from the reloaded parameters."""
        for name, fresh in derive(head, embed).items():
            if Fix.RELOAD_DERIVED_IN_PLACE in fixes:
                # fix: reload_derived_in_place -- graphs captured before the reload read this
                # storage: write the new values into it
                self.tensors[name].copy_(fresh)
            else:
                self.tensors[name] = fresh  # NOTE: upstream's rebinding (an attribute set)
