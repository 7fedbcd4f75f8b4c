"""Helpers of the distributed tests (and the collectives benchmark): a global batch of
trajectories, sharded over DP ranks and sliced over CP ranks as miles does, and a counter of
the collectives a block issues."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ess_patch.cp_slicing import local_response_masks

NUM = 13  # uneven over 2 DP ranks


def make_batch(seed: int, num: int = NUM):
    """A global batch: uneven prompt/response lengths, masked tokens, some empty trajectories."""
    gen = torch.Generator().manual_seed(seed)
    batch = []
    for i in range(num):
        response = int(torch.randint(1, 30, (1,), generator=gen))
        prompt = int(torch.randint(1, 20, (1,), generator=gen))
        rollout = -torch.rand(response, generator=gen, dtype=torch.float64) * 2
        staleness = float(torch.randn(1, generator=gen)) * 0.4  # per-trajectory policy lag
        train = (
            rollout + staleness + torch.randn(response, generator=gen, dtype=torch.float64) * 0.1
        )
        mask = (torch.rand(response, generator=gen) > 0.25).to(torch.int64)
        if i % 5 == 2:
            mask.zero_()  # an empty trajectory
        batch.append(
            {
                "total": prompt + response,
                "response": response,
                "lp": train.float(),
                "rlp": rollout.float(),
                "mask": mask,
            }
        )
    return batch


def dp_shard(batch, dp_rank, dp_size):
    """Uneven contiguous shards: rank 0 gets the larger half."""
    bounds = [round(len(batch) * k / dp_size + 0.01) for k in range(dp_size + 1)]
    return batch[bounds[dp_rank] : bounds[dp_rank + 1]]


def cp_local(samples, cp_rank, cp_size):
    """This CP rank's tokens of each sample, sliced as miles slices them."""
    totals = [s["total"] for s in samples]
    responses = [s["response"] for s in samples]

    def slice_(key):
        return local_response_masks([s[key] for s in samples], totals, responses, cp_rank, cp_size)

    return slice_("lp"), slice_("rlp"), slice_("mask")


class CollectiveCounter:
    """Counts the collectives (and bytes) issued through torch.distributed."""

    NAMES = (
        "all_reduce",
        "all_gather",
        "broadcast",
        "all_gather_into_tensor",
        "reduce_scatter",
        "all_to_all",
        "gather",
        "scatter",
        "reduce",
        "barrier",
        "all_gather_object",
        "broadcast_object_list",
    )

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self._saved = {}

    def __enter__(self):
        for name in self.NAMES:
            original = getattr(dist, name)
            self._saved[name] = original

            def counted(*args, _name=name, _orig=original, **kwargs):
                first = args[0] if args else None
                nbytes = (
                    first.numel() * first.element_size() if isinstance(first, torch.Tensor) else 0
                )
                self.calls.append((_name, nbytes))
                return _orig(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)
