"""ESS of a rollout's trajectory weights: pure tensor math, no torch.distributed.

The computation is split in three steps so that the reduction layer can put its
collectives between them:

1. :func:`trajectory_stats` -- per trajectory ``[sum of masked d_t, token count,
   non-finite count]`` from this rank's tokens (CP ranks all-reduce this table);
2. :func:`summarize` -- per rank ``[max m, S1, S2, counts, flags]`` with
   ``S1 = sum exp(m - max)`` and ``S2 = sum exp(2 (m - max))`` (DP ranks gather it);
3. :func:`combine` + :func:`finalize` -- merge the per-rank summaries with one global
   shift and turn them into an :class:`EssLrResult`.

Everything is accumulated in float64 and shifted by the largest ``m_i``, so product
mode over thousands of tokens never overflows. The number of tensor operations does
not depend on the number of trajectories (one kernel launch each on a GPU).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .config import EssLrConfig
from .result import EssLrResult

__all__ = [
    "SUMMARY_SIZE",
    "Flags",
    "InvalidInputsElsewhereError",
    "NonFiniteLogProbError",
    "combine",
    "finalize",
    "summarize",
    "summarize_steps",
    "trajectory_stats",
    "validate_inputs",
    "validate_steps",
]

_ACC = torch.float64

# Layout of a per-rank summary vector (float64).
_MAX, _S1, _S2, _N_VALID, _N_EMPTY, _N_BAD, _BAD_INDEX, _RANK, _MISSING, _INVALID = range(10)
SUMMARY_SIZE = 10


class Flags(NamedTuple):
    """Per-rank conditions every rank must learn about: bools, or 0-dim tensors after a
    reduction (kept on device so that no host synchronisation is needed)."""

    missing: bool | torch.Tensor = False
    invalid: bool | torch.Tensor = False


class InvalidInputsElsewhereError(ValueError):
    """Another rank's inputs failed validation; that rank raised the detailed error."""


class NonFiniteLogProbError(FloatingPointError):
    """A masked token's train/rollout log-ratio was NaN or infinite (``nonfinite="raise"``)."""


def validate_inputs(
    log_probs: Sequence[torch.Tensor],
    rollout_log_probs: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
) -> None:
    """Raise ``ValueError``/``TypeError`` naming the sample index if the inputs don't line up.

    Only metadata is read: no tensor operation is dispatched.
    """
    names = ("log_probs", "rollout_log_probs", "loss_masks")
    seqs = (log_probs, rollout_log_probs, loss_masks)
    for name, seq in zip(names, seqs, strict=True):
        if isinstance(seq, torch.Tensor) or not isinstance(seq, Sequence):
            raise TypeError(
                f"{name} must be a sequence (list/tuple) of 1-D tensors, one per trajectory; "
                f"got {type(seq).__name__}"
            )
    counts = [len(s) for s in seqs]
    if len(set(counts)) != 1:
        raise ValueError(
            "log_probs, rollout_log_probs and loss_masks must hold one tensor per trajectory "
            f"each; got {counts[0]}, {counts[1]} and {counts[2]} tensors"
        )
    for i, (lp, rlp, mask) in enumerate(zip(log_probs, rollout_log_probs, loss_masks, strict=True)):
        for name, t in zip(names, (lp, rlp, mask), strict=True):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}[{i}] is a {type(t).__name__}, expected a torch.Tensor")
            if t.dim() != 1:
                raise ValueError(
                    f"{name}[{i}] has shape {tuple(t.shape)}; expected a 1-D tensor of "
                    f"per-token values for sample {i}"
                )
        for name, t in (("log_probs", lp), ("rollout_log_probs", rlp)):
            if not t.is_floating_point():
                raise TypeError(
                    f"{name}[{i}] has dtype {t.dtype}; log-probs must be floating point"
                )
        if mask.is_complex():
            raise TypeError(f"loss_masks[{i}] has dtype {mask.dtype}; expected bool, int or float")
        if not (lp.shape[0] == rlp.shape[0] == mask.shape[0]):
            raise ValueError(
                f"sample {i}: log_probs has {lp.shape[0]} tokens, rollout_log_probs "
                f"{rlp.shape[0]}, loss_masks {mask.shape[0]}; they must be aligned token by token "
                "(pass the masks sliced to this rank's tokens)"
            )
        if not (lp.device == rlp.device == mask.device):
            raise ValueError(
                f"sample {i}: log_probs on {lp.device}, rollout_log_probs on {rlp.device}, "
                f"loss_masks on {mask.device}; put them on one device"
            )


def trajectory_stats(
    log_probs: Sequence[torch.Tensor],
    rollout_log_probs: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
) -> torch.Tensor:
    """Per-trajectory ``[sum of masked d_t, masked tokens, non-finite flag]``.

    Returns a float64 tensor of shape ``[B, 3]``. A trajectory whose masked log-ratios
    include a NaN/inf (or whose sum is not finite) gets sum 0 and flag 1, so that a sum
    over ranks stays meaningful and still marks it. A mask entry counts when it is non-zero.

    Cost: a fixed number of tensor operations whatever B (one kernel launch each on a GPU,
    no host synchronisation): three concatenations, one widening to float64 (the
    subtraction ``lp - rlp`` of fp32/bf16 inputs is then exact), one masked fill and two
    segment sums (``torch.segment_reduce`` over the lengths, in float64, sequential within
    each trajectory: the masked log-ratios, then the masked-out token counts in the same
    buffer). No per-token segment index and no per-token finiteness test are built: a
    non-finite masked d_t makes its trajectory's float64 sum non-finite (finite fp32/bf16
    inputs cannot overflow a float64 sum).
    """
    validate_inputs(log_probs, rollout_log_probs, loss_masks)
    num = len(log_probs)
    if num == 0:
        return torch.zeros((0, 3), dtype=_ACC)
    device = log_probs[0].device
    offsets = [0]
    for t in log_probs:
        offsets.append(offsets[-1] + t.shape[0])
    bounds = torch.tensor(offsets, dtype=torch.int64)
    if device.type != "cpu":
        # pinned + non_blocking: the upload does not wait for the device (no host sync)
        bounds = bounds.pin_memory().to(device, non_blocking=True)
    lengths = bounds.diff()
    lp = torch.cat(list(log_probs))  # same-dtype concatenations: one op each whatever B
    rlp = torch.cat(list(rollout_log_probs))
    masks = torch.cat(list(loss_masks))
    if masks.is_floating_point() and bool(torch.isnan(masks).any()):
        # NaN != 0 would count as masked-in: say which sample instead of guessing
        bad = next(i for i, m in enumerate(loss_masks) if bool(torch.isnan(m).any()))
        raise ValueError(
            f"loss_masks[{bad}] holds NaN; a mask entry must be 0 (ignored) or non-zero "
            "(counted). Fix the mask (e.g. torch.nan_to_num) before ESS-LR"
        )
    unmasked = masks == 0
    del masks
    diff = lp.to(_ACC)  # a fresh float64 copy (cat's own output if the inputs are float64)
    del lp
    diff.sub_(rlp)  # computed in float64: exact for fp32/bf16 inputs
    del rlp
    diff.masked_fill_(unmasked, 0.0)  # masked-out tokens are ignored even when NaN
    sums = torch.segment_reduce(diff, "sum", lengths=lengths, unsafe=True)
    diff.copy_(unmasked)  # reuse the buffer: per-trajectory count of masked-out tokens
    skipped = torch.segment_reduce(diff, "sum", lengths=lengths, unsafe=True)
    del diff
    finite = torch.isfinite(sums)
    return torch.stack(
        [torch.where(finite, sums, 0.0), lengths.to(_ACC) - skipped, (~finite).to(_ACC)], 1
    )


def summarize(
    stats: torch.Tensor,
    config: EssLrConfig,
    *,
    rank: int = 0,
    flags: Flags | None = None,
) -> torch.Tensor:
    """Reduce this rank's (CP-complete) trajectory table to a summary vector.

    ``flags`` mark missing or invalid inputs; they travel with the summary so that every
    rank reaches the same outcome.
    """
    flags = Flags() if flags is None else flags
    out = torch.zeros(SUMMARY_SIZE, dtype=_ACC, device=stats.device)
    out[_MAX] = -math.inf
    out[_BAD_INDEX] = -1.0
    out[_RANK] = float(rank)
    out[_MISSING] = flags.missing
    out[_INVALID] = flags.invalid
    total, count, bad = stats[:, 0], stats[:, 1], stats[:, 2]
    is_bad = bad > 0
    m = total / count.clamp_min(1.0) if config.weight_mode == "geometric" else total
    is_bad = is_bad | ~torch.isfinite(m)
    if config.weight_clip is not None:
        # w_i = min(w_i, clip), in log space (before any shift: the clip is on the true weight)
        m = m.clamp_max(math.log(config.weight_clip))
    valid = (count > 0) & ~is_bad
    m = torch.where(valid, m, -math.inf)
    shift = m.max() if m.numel() else out[_MAX]
    # All -inf (nothing valid) would make (m - shift) NaN; shift by 0 instead.
    safe_shift = torch.where(torch.isfinite(shift), shift, 0.0)
    w = torch.exp(m - safe_shift)
    first_bad = (
        torch.where(is_bad, torch.arange(m.numel(), device=m.device, dtype=_ACC), math.inf).min()
        if m.numel()
        else out[_BAD_INDEX]
    )
    out[_MAX] = shift
    out[_S1] = w.sum()
    out[_S2] = (w * w).sum()
    out[_N_VALID] = valid.sum()
    out[_N_EMPTY] = ((count == 0) & ~is_bad).sum()
    out[_N_BAD] = is_bad.sum()
    out[_BAD_INDEX] = torch.where(torch.isfinite(first_bad), first_bad, -1.0)
    return out


def combine(summaries: torch.Tensor) -> torch.Tensor:
    """Merge per-rank summaries (shape ``[R, SUMMARY_SIZE]``) under one global shift."""
    if summaries.dim() == 1:
        return summaries
    maxes = summaries[:, _MAX]
    shift = maxes.max()
    safe_shift = torch.where(torch.isfinite(shift), shift, 0.0)
    # A rank with nothing valid has max -inf and S1 = S2 = 0: its factor is exp(-inf) = 0.
    factor = torch.exp(maxes - safe_shift)
    out = torch.empty(SUMMARY_SIZE, dtype=_ACC, device=summaries.device)
    out[_MAX] = shift
    out[_S1] = (summaries[:, _S1] * factor).sum()
    out[_S2] = (summaries[:, _S2] * factor * factor).sum()
    for col in (_N_VALID, _N_EMPTY, _N_BAD, _MISSING, _INVALID):
        out[col] = summaries[:, col].sum()
    has_bad = summaries[:, _N_BAD] > 0
    first = torch.argmax(has_bad.to(torch.int8))  # first row with a bad trajectory
    # index_select with a tensor index: no .item() (a host sync on a GPU)
    row = summaries.index_select(0, first.reshape(1))[0]
    out[_BAD_INDEX] = row[_BAD_INDEX]
    out[_RANK] = row[_RANK]
    return out


def finalize(summary: torch.Tensor, config: EssLrConfig) -> EssLrResult:
    """Turn a (global) summary into the result; the only host synchronisation."""
    s = summary.tolist()
    n_valid, n_empty, n_bad = int(s[_N_VALID]), int(s[_N_EMPTY]), int(s[_N_BAD])
    if s[_INVALID] > 0:
        raise InvalidInputsElsewhereError(
            f"ESS-LR inputs failed validation on {int(s[_INVALID])} other rank(s); see the "
            "error raised there (it names the sample). Every rank stops here rather than "
            "waiting on a collective"
        )
    if s[_MISSING] > 0:
        return EssLrResult.noop("missing", num_empty=n_empty)
    if n_bad > 0:
        if config.nonfinite == "raise":
            raise NonFiniteLogProbError(
                f"non-finite train/rollout log-prob ratio in {n_bad} trajectory(ies); first: "
                f"sample index {int(s[_BAD_INDEX])} of data-parallel rank {int(s[_RANK])}. "
                "Check the log-probs fed to ESS-LR, or set nonfinite='floor' "
                "(--ess-lr-nonfinite floor) to train those steps at the floor LR instead"
            )
        return EssLrResult(
            scale=config.floor,
            rho=math.nan,
            ess=math.nan,
            num_trajectories=n_valid,
            num_empty=n_empty,
            num_nonfinite=n_bad,
            status="nonfinite",
        )
    if n_valid == 0:
        return EssLrResult.noop("no_valid", num_empty=n_empty)
    # After the shift the largest weight is exactly 1: 1 <= S2 <= S1 <= B, no overflow.
    ess = s[_S1] * s[_S1] / s[_S2]
    rho = min(1.0, max(1.0 / n_valid, ess / n_valid))
    ratio = rho / config.base_ratio
    raw = math.sqrt(ratio) if config.rule == "sqrt" else ratio
    scale = min(1.0, max(config.floor, raw))
    return EssLrResult(scale=scale, rho=rho, ess=ess, num_trajectories=n_valid, num_empty=n_empty)


def validate_steps(steps: Sequence[Sequence[int]], num_trajectories: int) -> list[list[int]]:
    """``steps`` as lists of ints, or ``ValueError``/``TypeError`` naming the step and index.

    ``steps[s]`` holds the indices (into this rank's trajectories) of the samples that
    optimizer step ``s`` trains on; a step may hold none on this rank.
    """
    if isinstance(steps, torch.Tensor) or not isinstance(steps, Sequence):
        raise TypeError(
            "steps must be a sequence with one sequence of trajectory indices per optimizer "
            f"step; got {type(steps).__name__}"
        )
    out = []
    for s, indices in enumerate(steps):
        if isinstance(indices, str | bytes) or not isinstance(indices, Sequence):
            raise TypeError(
                f"steps[{s}] is a {type(indices).__name__}; expected a sequence of trajectory "
                "indices (ints)"
            )
        row = []
        for item in indices:
            try:  # ints, numpy / 0-dim torch integers (schedules may arrive as either)
                i = operator.index(item)
            except TypeError:
                i = None
            if i is None or isinstance(item, bool):
                raise TypeError(f"steps[{s}] holds {item!r}; trajectory indices are ints")
            if not 0 <= i < num_trajectories:
                raise ValueError(
                    f"steps[{s}] holds trajectory index {i}, but this rank has "
                    f"{num_trajectories} trajectories (indices 0..{num_trajectories - 1})"
                )
            row.append(i)
        out.append(row)
    return out


def summarize_steps(
    stats: torch.Tensor,
    steps: Sequence[Sequence[int]],
    config: EssLrConfig,
    *,
    rank: int = 0,
    flags: Flags | None = None,
) -> torch.Tensor:
    """One :func:`summarize` row per optimizer step (shape ``[S, SUMMARY_SIZE]``): row ``s``
    over the trajectories ``steps[s]`` (see :func:`validate_steps`). The sample index a row
    names (the first non-finite one) indexes ``stats``, as in :func:`summarize`."""
    rows = []
    for indices in steps:
        index = torch.tensor(list(indices), dtype=torch.int64, device=stats.device)
        row = summarize(stats.index_select(0, index), config, rank=rank, flags=flags)
        if index.numel():
            bad = row[_BAD_INDEX]
            mapped = index.to(_ACC)[bad.clamp_min(0).to(torch.int64)]
            row[_BAD_INDEX] = torch.where(bad >= 0, mapped, bad)
        rows.append(row)
    if not rows:
        return torch.zeros((0, SUMMARY_SIZE), dtype=_ACC, device=stats.device)
    return torch.stack(rows)
