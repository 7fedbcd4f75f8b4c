"""Which samples each optimizer step of a rollout trains on, as miles' and slime's loops split it.

Granularity ``"step"`` computes one ESS per optimizer step over that step's mini-batch, so
the advantage hook must know the split before training starts. Both frameworks hand their
train loop a rank-local ``rollout_data`` whose per-sample lists are in the order the data
iterator indexes them, and each optimizer step consumes the next ``num_microbatches[step]``
micro-batches of that iterator (``train`` resets it once per rollout):

- slime @624b824a8: always a rollout-side schedule, ``rollout_data["num_microbatches"]`` (per
  step) and ``["micro_batch_indices"]`` (per micro-batch, local sample indices),
  ``slime/utils/dp_schedule.py`` and ``backends/megatron_utils/data.py::get_data_iterator``.
- miles @31f1ca961 (``backends/training_utils/data.py::get_data_iterator``): the same keys
  when the rollout side scheduled; else ``global_batch_size // effective_dp.size`` local
  samples per step (``dynamic_global_batch_size`` when present), ``num_samples //`` that many
  steps (trailing samples are not trained on); with ``--use-dynamic-batch-size`` each step's
  micro-batches partition its contiguous range, without it the iterator takes
  ``micro_batch_size`` contiguous samples per micro-batch, ``local // micro_batch_size`` of
  them per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["miles_step_samples", "miles_steps", "schedule_steps", "slime_step_samples"]


def schedule_steps(
    num_microbatches: Sequence[int], micro_batch_indices: Sequence[Sequence[int]]
) -> list[list[int]]:
    """Step ``s`` trains on the union of its ``num_microbatches[s]`` consecutive micro-batches.

    Raises:
        ValueError: the schedule names more micro-batches than it has.
    """
    steps: list[list[int]] = []
    start = 0
    for count in num_microbatches:
        batches = micro_batch_indices[start : start + int(count)]
        if len(batches) != int(count):
            raise ValueError(
                f"rollout_data['num_microbatches'] = {list(num_microbatches)} asks for "
                f"{sum(int(c) for c in num_microbatches)} micro-batches but "
                f"rollout_data['micro_batch_indices'] has {len(micro_batch_indices)}"
            )
        steps.append([int(i) for batch in batches for i in batch])
        start += int(count)
    return steps


def miles_steps(args: Any, rollout_data: dict, dp_size: int) -> list[list[int]]:
    """miles' split of this rank's samples into optimizer steps (see the module docstring)."""
    if "micro_batch_indices" in rollout_data:
        return schedule_steps(rollout_data["num_microbatches"], rollout_data["micro_batch_indices"])
    num_samples = len(rollout_data["total_lengths"])
    global_batch = rollout_data.get("dynamic_global_batch_size", args.global_batch_size)
    if not isinstance(global_batch, int):
        raise ValueError(
            f"args.global_batch_size is {global_batch!r}: ess-patch cannot split the rollout into "
            "miles' optimizer steps (granularity 'step') without it"
        )
    local = global_batch // dp_size
    if local <= 0:
        raise ValueError(
            f"global batch size {global_batch} is smaller than the data-parallel size {dp_size}"
        )
    if not getattr(args, "use_dynamic_batch_size", False):
        per_step = (local // args.micro_batch_size) * args.micro_batch_size
    else:
        per_step = local
    return [list(range(s * per_step, (s + 1) * per_step)) for s in range(num_samples // local)]


def miles_step_samples(args: Any, rollout_data: dict, dp_size: int) -> list[list[int]]:
    """:func:`miles_steps` with the size of the DP group the rollout's ESS is reduced over
    (miles' ``effective_dp``, or ``intra_dp`` / ``dp_size`` in older shapes)."""
    return miles_steps(args, rollout_data, dp_size)


def slime_step_samples(_args: Any, rollout_data: dict, _dp_size: int) -> list[list[int]]:
    """slime's split: always its rollout-side schedule."""
    return schedule_steps(rollout_data["num_microbatches"], rollout_data["micro_batch_indices"])
