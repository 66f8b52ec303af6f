"""A Mamba-like state group for a hybrid runner (RunnerConfig.cache.hybrid): group 0's blocks.

Upstream's hybrid models (Qwen3.5, Nemotron-H) keep attention K/V and Mamba state in one pool of
raw blocks: a block id names the same bytes in the attention groups' view (bfloat16 or fp8 K/V)
and in the Mamba group's (float32 state), so a freed block changes tenants and dtypes. Here each
request owns one state block of group 0, whose value page is read as int32: a convolution window
of the request's last WINDOW token ids, newest first, -1 wherever it is empty. -1 is 0xFFFFFFFF,
NaN read as float32 or as bfloat16, as upstream's float32 state can read as NaN or Inf in
bfloat16. The tiny decoder reads no state: the group is there as the blocks' other tenant.
"""

from __future__ import annotations

import torch

WINDOW = 3  # upstream's convolution width minus one


def state_pages(v_cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, page] int32: each block's value page of `v_cache`, the same bytes."""
    return v_cache.view(v_cache.shape[0], -1).view(torch.int32)


def update_conv_state(
    page: torch.Tensor,  # [page] int32, one request's state block
    token_ids: torch.Tensor,  # [n] int32, the request's tokens of this step
    fresh: bool,  # the request's first step: its state starts empty
) -> None:
    if fresh:
        page.fill_(-1)
    page[:WINDOW] = torch.cat([token_ids.flip(0), page[:WINDOW]])[:WINDOW]
