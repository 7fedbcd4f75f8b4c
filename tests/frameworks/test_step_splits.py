"""Granularity "step": ess-patch's split of a rollout into optimizer steps is the one the REAL
miles and slime data iterators consume (the samples each step's micro-batches hold).

miles: its ``get_data_iterator`` (static and dynamic batch sizes, one rank) iterated step by
step; slime: its rollout-side ``build_dp_schedule`` over two DP ranks and its ``DataIterator``,
whose steps must also be the rollouts of each global batch.
"""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared helpers
from upstream import import_upstream, miles_parallel_state, skip_reason

from ess_patch.integrations.steps import miles_steps, slime_step_samples

# miles' data module imports its chat templates (sglang): the full tier's stubs
TIER = {"miles": "full", "slime": "loss"}
SKIP = {fw: skip_reason(fw, tier) for fw, tier in TIER.items()}
LENGTHS = [7, 3, 12, 5, 9, 4, 15, 6, 8, 2, 11, 10, 3]  # 13 samples: trailing ones dropped


def _consumed(iterator, num_microbatches, key="sample_id") -> list[list[int]]:
    """The sample ids each optimizer step's micro-batches hold, in the order train() takes them."""
    return [
        sorted(i for _ in range(count) for i in iterator.get_next([key])[key])
        for count in num_microbatches
    ]


@pytest.mark.skipif(SKIP["miles"] is not None, reason=SKIP["miles"] or "")
@pytest.mark.parametrize(
    ("global_batch", "micro_batch", "dynamic"),
    [(4, 1, False), (4, 2, False), (6, 4, False), (6, 1, True), (4, 1, True)],
)
def test_miles_split_is_what_its_data_iterator_consumes(world, global_batch, micro_batch, dynamic):
    data_module = import_upstream("miles.backends.training_utils.data", "full")
    miles_parallel_state()
    args = Namespace(
        global_batch_size=global_batch,
        micro_batch_size=micro_batch,
        use_dynamic_batch_size=dynamic,
        use_dynamic_global_batch_size=False,
        max_tokens_per_gpu=20,
        qkv_format="thd",
    )
    # the dynamic path asserts that the steps use every sample: no trailing one there
    lengths = LENGTHS[:12] if dynamic else LENGTHS
    rollout = {"total_lengths": list(lengths), "sample_id": list(range(len(lengths)))}
    iterators, num_microbatches = data_module.get_data_iterator(args, None, rollout)
    want = _consumed(iterators[0], num_microbatches)
    got = miles_steps(args, rollout, 1)
    assert [sorted(step) for step in got] == want
    assert len(want) == len(lengths) // global_batch >= 2


@pytest.mark.skipif(SKIP["slime"] is not None, reason=SKIP["slime"] or "")
@pytest.mark.parametrize("dynamic", [False, True])
def test_slime_split_is_its_schedule_and_each_step_is_one_global_batch(dynamic):
    dp_schedule = import_upstream("slime.utils.dp_schedule")
    data_module = import_upstream("slime.backends.megatron_utils.data")
    args = Namespace(
        use_dynamic_batch_size=dynamic,
        max_tokens_per_gpu=20,
        micro_batch_size=1,
        balance_by_flops=False,
        balance_data=False,
    )
    config = {"dp_size": 2, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}
    lengths = LENGTHS[:12]
    rollout_ids = [i // 2 for i in range(len(lengths))]  # 2 samples per rollout (n=2)
    partitions, indices, num_microbatches, _ = dp_schedule.build_dp_schedule(
        args, config, lengths, global_batch_size=2, rollout_indices=rollout_ids
    )
    per_step: list[set[int]] = [set() for _ in num_microbatches]
    for rank in range(2):
        local = {
            "num_microbatches": num_microbatches,
            "micro_batch_indices": indices[rank],
            "sample_id": [partitions[rank][i] for i in range(len(partitions[rank]))],
        }
        want = _consumed(data_module.DataIterator(local, indices[rank]), num_microbatches)
        got = slime_step_samples(None, local, 2)
        assert [sorted(local["sample_id"][i] for i in step) for step in got] == want
        for s, step in enumerate(want):
            per_step[s] |= set(step)
    # globally, step s trains on the samples of rollouts 2s and 2s + 1
    assert [sorted(rollout_ids[i] for i in step) for step in per_step] == [
        [2 * s, 2 * s, 2 * s + 1, 2 * s + 1] for s in range(len(per_step))
    ]
