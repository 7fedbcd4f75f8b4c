"""Rank-side helper for the proxy's vocabulary-parallel test (runs inside ``harness.run_ranks``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ess_patch.proxy import proxy_sq_norms


def vocab_parallel(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the vocabulary (the world is the TP group): the proxy's norms."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = logits.chunk(world, dim=-1)[rank]
    start = rank * shard.shape[-1]
    return proxy_sq_norms(shard, tokens, mask, tp_group=dist.group.WORLD, vocab_start=start)
