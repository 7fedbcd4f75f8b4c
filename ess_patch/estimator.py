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
mode over thousands of tokens never overflows. One torch path on every device: the
number of tensor operations does not depend on the number of trajectories (one kernel
launch each on a GPU), and the only host synchronisation is :func:`finalize`'s (plus the
NaN check of floating-point masks, see :func:`trajectory_stats`).
"""

from __future__ import annotations

import array
import math
import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .config import EssLrConfig
from .errors import EssPatchError, EssPatchTypeError, EssPatchValueError
from .result import EssLrResult

__all__ = [
    "SUMMARY_SIZE",
    "Flags",
    "InvalidInputsElsewhereError",
    "NonFiniteLogProbError",
    "combine",
    "finalize",
    "result",
    "scale_of",
    "summarize",
    "trajectory_stats",
    "validate_inputs",
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


class InvalidInputsElsewhereError(EssPatchError, ValueError):
    """Another rank's inputs failed validation; that rank raised the detailed error."""


class NonFiniteLogProbError(EssPatchError, FloatingPointError):
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
            raise EssPatchTypeError(
                f"{name} must be a sequence (list/tuple) of 1-D tensors, one per trajectory; "
                f"got {type(seq).__name__}"
            )
    counts = [len(s) for s in seqs]
    if len(set(counts)) != 1:
        raise EssPatchValueError(
            "log_probs, rollout_log_probs and loss_masks must hold one tensor per trajectory "
            f"each; got {counts[0]}, {counts[1]} and {counts[2]} tensors"
        )
    for i, (lp, rlp, mask) in enumerate(zip(log_probs, rollout_log_probs, loss_masks, strict=True)):
        for name, t in zip(names, (lp, rlp, mask), strict=True):
            if not isinstance(t, torch.Tensor):
                raise EssPatchTypeError(
                    f"{name}[{i}] is a {type(t).__name__}, expected a torch.Tensor"
                )
            if t.dim() != 1:
                raise EssPatchValueError(
                    f"{name}[{i}] has shape {tuple(t.shape)}; expected a 1-D tensor of "
                    f"per-token values for sample {i}"
                )
        for name, t in (("log_probs", lp), ("rollout_log_probs", rlp)):
            if not t.is_floating_point():
                raise EssPatchTypeError(
                    f"{name}[{i}] has dtype {t.dtype}; log-probs must be floating point"
                )
        if mask.is_complex():
            raise EssPatchTypeError(
                f"loss_masks[{i}] has dtype {mask.dtype}; expected bool, int or float"
            )
        if not (lp.shape[0] == rlp.shape[0] == mask.shape[0]):
            raise EssPatchValueError(
                f"sample {i}: log_probs has {lp.shape[0]} tokens, rollout_log_probs "
                f"{rlp.shape[0]}, loss_masks {mask.shape[0]}; they must be aligned token by token "
                "(pass the masks sliced to this rank's tokens)"
            )
        if not (lp.device == rlp.device == mask.device):
            raise EssPatchValueError(
                f"sample {i}: log_probs on {lp.device}, rollout_log_probs on {rlp.device}, "
                f"loss_masks on {mask.device}; put them on one device"
            )


def _checked_lengths(
    log_probs: Sequence[torch.Tensor],
    rollout_log_probs: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
) -> list[int]:
    """Each trajectory's token count, after :func:`validate_inputs`' checks done as a few
    C-level passes over the metadata.

    ``map``/``set`` over the tensors' sizes and dtypes cost ~0.3 us per trajectory, where
    :func:`validate_inputs`' per-sample Python loop costs ~1.7 us. Only when a check fails
    does that loop run, to raise its error naming the sample. Devices are compared for the
    first sample only; the concatenations raise on a later tensor on another device, and the
    caller then runs the loop. The masks' dtypes are read from their concatenation.
    """
    seqs = (log_probs, rollout_log_probs, loss_masks)
    if any(isinstance(s, torch.Tensor) or not isinstance(s, Sequence) for s in seqs) or not (
        len(log_probs) == len(rollout_log_probs) == len(loss_masks)
    ):
        validate_inputs(*seqs)
    try:
        lengths = list(map(_numel, log_probs))  # TypeError on a non-tensor
        # torch.cat raises on tensors of different dims, but skips 1-D empty ones: so all are
        # 1-D if the first non-empty one of each list is (all of them if all are empty)
        first = next((i for i, n in enumerate(lengths) if n), None)
        probe = range(len(lengths)) if first is None else (first,)
        ok = (
            lengths == list(map(_numel, rollout_log_probs)) == list(map(_numel, loss_masks))
            and all(s[i].dim() == 1 for s in seqs for i in probe)
            and (
                not lengths
                or log_probs[0].device == rollout_log_probs[0].device == loss_masks[0].device
            )
            and all(t.is_floating_point for s in seqs[:2] for t in set(map(_dtype, s)))
        )
    except (TypeError, AttributeError):  # not a tensor
        ok = False
    if not ok:
        validate_inputs(*seqs)  # raises, naming the sample
        raise EssPatchValueError(
            "ESS-LR inputs do not line up (see validate_inputs)"
        )  # not reached
    return lengths


_numel = torch.Tensor.numel
_dtype = operator.attrgetter("dtype")


def trajectory_stats(
    log_probs: Sequence[torch.Tensor],
    rollout_log_probs: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
) -> torch.Tensor:
    """Per-trajectory ``[sum of masked d_t, masked tokens, non-finite flag]``.

    Returns a float64 tensor of shape ``[B, 3]`` on the inputs' device. A trajectory whose
    masked log-ratios include a NaN/inf (or whose sum is not finite) gets sum 0 and flag 1,
    so that a sum over ranks stays meaningful and still marks it. A mask entry counts when
    it is non-zero; a NaN mask entry raises ``ValueError`` naming the sample.

    ``d_t = lp_t - rlp_t`` is computed in float64 (exact for fp32/bf16/fp16 inputs) and
    summed per trajectory in float64. No per-token finiteness test is built: a non-finite
    masked ``d_t`` makes its trajectory's float64 sum non-finite (finite fp32/bf16 inputs
    cannot overflow it). Masked-out tokens are ignored even when NaN.

    The work is a fixed sequence of torch operations over the concatenated tokens (its
    length does not depend on B: one kernel launch each on a GPU), with one segment sum
    for the differences and the counts together.
    The per-trajectory lengths reach a CUDA device from pinned memory without a host
    synchronisation; floating-point masks cost one (their NaN check), integer and bool
    masks none.

    Raises:
        ValueError / TypeError: inputs that do not line up, naming the sample.
    """
    lengths = _checked_lengths(log_probs, rollout_log_probs, loss_masks)
    if not lengths:
        return torch.zeros((0, 3), dtype=_ACC)
    try:
        with torch.no_grad():
            return _stats(log_probs, rollout_log_probs, loss_masks, lengths)
    except (RuntimeError, TypeError):
        # e.g. a tensor on another device: the per-sample checks name it; if they pass,
        # the error was not about the inputs' layout and is raised as it is
        validate_inputs(log_probs, rollout_log_probs, loss_masks)
        raise


def _stats(
    log_probs: Sequence[torch.Tensor],
    rollout_log_probs: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    lengths: list[int],
) -> torch.Tensor:
    lp = torch.cat(log_probs)  # mixed dtypes promote
    rlp = torch.cat(rollout_log_probs)
    masks = torch.cat(loss_masks)
    # torch.cat compares dims only across tensors: one alone (or after empty ones) keeps its
    # shape. A TypeError makes the caller run validate_inputs, which names the sample.
    if masks.is_complex() or lp.dim() != 1 or rlp.dim() != 1 or masks.dim() != 1:
        raise EssPatchTypeError("a complex or non-1-D input tensor")
    if masks.is_floating_point() and bool(torch.isnan(masks).any()):
        # NaN != 0 would count as masked-in: say which sample instead of guessing
        bad = next(i for i, m in enumerate(loss_masks) if bool(torch.isnan(m).any()))
        raise EssPatchValueError(
            f"loss_masks[{bad}] holds NaN; a mask entry must be 0 (ignored) or non-zero "
            "(counted). Fix the mask (e.g. torch.nan_to_num) before ESS-LR"
        )
    keep = masks if masks.dtype == torch.bool else masks != 0
    # One float64 workspace, [tokens, 2]: column 0 the differences, column 1 the counts, so
    # that one segment sum reduces both, and the buffer is allocated (page-faulted, on CPU)
    # once: fresh memory costs more than the passes over it there.
    work = torch.empty((lp.shape[0], 2), dtype=_ACC, device=lp.device)
    diff, count = work.unbind(1)
    diff.copy_(lp)  # widened: float64 differences are exact for fp32/bf16/fp16 inputs
    count.copy_(rlp)  # the counts' column holds the widened rollout log-probs meanwhile
    diff.sub_(count)  # same dtypes: a mixed-dtype subtraction is ~10x slower on CPU
    diff.masked_fill_(~keep, 0.0)  # masked-out d_t -> 0, NaN included
    count.copy_(keep)
    # float64 counts: exact below 2^53 (segment_reduce has no integer kernel)
    total, count = torch.segment_reduce(
        work, "sum", lengths=_lengths_on(lengths, work.device), unsafe=True
    ).unbind(1)
    finite = _finite(total)
    return torch.stack([torch.where(finite, total, 0.0), count, (~finite).to(_ACC)], 1)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``torch.isfinite`` in two operations (it decomposes into four: two more launches)."""
    return x.abs() < math.inf  # NaN compares False


def _lengths_on(lengths: list[int], device: torch.device) -> torch.Tensor:
    """The lengths as an int64 tensor on ``device``, with no host synchronisation."""
    seg = torch.frombuffer(array.array("q", lengths), dtype=torch.int64)  # 5x torch.tensor's
    if device.type == "cpu":
        return seg
    if device.type == "cuda":
        # pinned + non_blocking: the upload does not wait for the device
        return seg.pin_memory().to(device, non_blocking=True)
    return seg.to(device)


def summarize(
    stats: torch.Tensor,
    config: EssLrConfig,
    *,
    rank: int = 0,
    flags: Flags | None = None,
) -> torch.Tensor:
    """Reduce this rank's (CP-complete) trajectory table to a summary vector.

    ``flags`` mark missing or invalid inputs; they travel with the summary so that every
    rank reaches the same outcome. A fixed number of torch operations on ``stats``' device,
    no host synchronisation.
    """
    flags = Flags() if flags is None else flags
    device = stats.device
    total, count, bad = stats.to(_ACC).unbind(1)  # a bf16 table is widened first
    is_bad = bad > 0
    m = total / count.clamp_min(1.0) if config.weight_mode == "geometric" else total
    is_bad = is_bad | ~_finite(m)
    if config.weight_clip is not None:
        # w_i = min(w_i, clip), in log space (before any shift: the clip is on the true weight)
        m = m.clamp_max(math.log(config.weight_clip))
    valid = (count > 0) & ~is_bad
    m = torch.where(valid, m, -math.inf)
    if len(m):
        shift = m.max()
        # all -inf (nothing valid) would make (m - shift) NaN: shift by 0 instead
        w = torch.exp(m - torch.where(_finite(shift), shift, 0.0))
        index = torch.arange(len(m), dtype=_ACC, device=device)
        first_bad = torch.where(is_bad, index, math.inf).min()
        first_bad = torch.where(_finite(first_bad), first_bad, -1.0)
        sums = torch.stack([w.sum(), (w * w).sum()])
    else:
        shift, first_bad = _scalar(-math.inf, device), _scalar(-1.0, device)
        sums = torch.zeros(2, dtype=_ACC, device=device)
    # one stack instead of a write per field: ~15 fewer operations (kernel launches)
    tallies = torch.stack([valid, (count == 0) & ~is_bad, is_bad]).sum(1, dtype=_ACC)
    values = torch.stack([_scalar(v, device) for v in (rank, flags.missing, flags.invalid)])
    return torch.cat([shift.reshape(1), sums, tallies, first_bad.reshape(1), values])


def _scalar(value: float | bool | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A 0-dim float64 tensor on ``device``: a fill, not an upload from the host."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=_ACC).reshape(())
    return torch.full((), float(value), dtype=_ACC, device=device)


def combine(summaries: torch.Tensor) -> torch.Tensor:
    """Merge per-rank summaries (shape ``[R, SUMMARY_SIZE]``) under one global shift."""
    if summaries.dim() == 1:
        return summaries
    if summaries.shape[0] == 1:
        return summaries[0].clone()  # what the merge below gives for one row, bit for bit
    maxes = summaries[:, _MAX]
    shift = maxes.max()
    safe_shift = torch.where(_finite(shift), shift, 0.0)
    # A rank with nothing valid has max -inf and S1 = S2 = 0: its factor is exp(-inf) = 0.
    factor = torch.exp(maxes - safe_shift)
    totals = summaries.sum(0)  # the tallies and the flags
    has_bad = summaries[:, _N_BAD] > 0
    first = torch.argmax(has_bad.to(torch.int8))  # first row with a bad trajectory
    # index_select with a tensor index: no .item() (a host sync on a GPU)
    row = summaries.index_select(0, first.reshape(1))[0]
    return torch.cat(
        [
            shift.reshape(1),
            torch.stack(
                [(summaries[:, _S1] * factor).sum(), (summaries[:, _S2] * factor * factor).sum()]
            ),
            totals[_N_VALID : _N_BAD + 1],
            row[_BAD_INDEX : _RANK + 1],
            totals[_MISSING : _INVALID + 1],
        ]
    )


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
    scale = scale_of(rho, config)
    return EssLrResult(scale=scale, rho=rho, ess=ess, num_trajectories=n_valid, num_empty=n_empty)


def scale_of(rho: float, config: EssLrConfig, base_ratio: float | None = None) -> float:
    """``clamp(rule(rho / base_ratio), floor, 1)``; ``base_ratio`` defaults to the config's
    (calibration passes the one it chose)."""
    ratio = rho / (config.base_ratio if base_ratio is None else base_ratio)
    raw = math.sqrt(ratio) if config.rule == "sqrt" else ratio
    return min(1.0, max(config.floor, raw))


def result(summaries: torch.Tensor, config: EssLrConfig) -> EssLrResult:
    """The result of every rank's summaries (``[R, SUMMARY_SIZE]``): :func:`combine`, then
    :func:`finalize`."""
    return finalize(combine(summaries), config)
