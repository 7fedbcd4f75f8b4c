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
mode over thousands of tokens never overflows. Off CPU the number of tensor operations
does not depend on the number of trajectories (one kernel launch each on a GPU); on CPU
:func:`trajectory_stats` works through groups of :data:`CPU_CHUNK_TOKENS` tokens with
numpy's passes over buffers that stay in cache, and :func:`summarize` runs the same code
on numpy (~1 us per call where a torch op costs ~4 us on CPU).
"""

from __future__ import annotations

import array
import bisect
import contextlib
import functools
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

try:  # optional, for the CPU segment sums (see trajectory_stats); torch alone works too
    import numpy as _np
except ImportError:  # pragma: no cover - exercised where numpy is not installed
    _np = None

from .config import EssLrConfig
from .result import EssLrResult

__all__ = [
    "CPU_CHUNK_TOKENS",
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

# On CPU, trajectories are processed in groups of about this many tokens (see
# trajectory_stats): ~30 bytes of buffers per token, ~4 MB that stay in cache. 64K-256K
# measured alike; 16K pays more in per-operation overhead, 1M in cache misses.
CPU_CHUNK_TOKENS = 1 << 17

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


class _Layout(NamedTuple):
    """What the metadata checks learned: token counts and the log-prob dtypes present."""

    lengths: list[int]
    lp_types: set[torch.dtype]
    rlp_types: set[torch.dtype]


def _checked_layout(
    log_probs: Sequence[torch.Tensor],
    rollout_log_probs: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
) -> _Layout:
    """:func:`validate_inputs`' checks, as a few C-level passes over the metadata.

    ``map``/``set`` over the tensors' sizes and dtypes cost ~0.3 us per trajectory, where
    :func:`validate_inputs`' per-sample Python loop costs ~1.7 us (as much as the rest of
    the estimator at 50 tokens per trajectory). Only when a check fails does that loop run,
    to raise its error naming the sample. Devices are compared for the first sample only;
    the concatenations raise on a later tensor on another device, and the caller then runs
    the loop.
    """
    seqs = (log_probs, rollout_log_probs, loss_masks)
    if any(isinstance(s, torch.Tensor) or not isinstance(s, Sequence) for s in seqs) or not (
        len(log_probs) == len(rollout_log_probs) == len(loss_masks)
    ):
        validate_inputs(*seqs)
    try:
        lengths = list(map(_numel, log_probs))  # TypeError on a non-tensor
        types = [set(map(_dtype, s)) for s in seqs[:2]]  # the masks': see _group_masks
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
            and all(d.is_floating_point for d in types[0] | types[1])
        )
    except (TypeError, AttributeError):  # not a tensor
        ok = False
    if not ok:
        validate_inputs(*seqs)  # raises, naming the sample
        raise ValueError("ESS-LR inputs do not line up (see validate_inputs)")  # not reached
    return _Layout(lengths, *types)


_numel = torch.Tensor.numel
_dtype = operator.attrgetter("dtype")
_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)
_NUMPY_DTYPES = (
    {}
    if _np is None
    else {
        torch.float16: _np.float16,
        torch.float32: _np.float32,
        torch.float64: _np.float64,
        torch.bool: _np.bool_,
        torch.int8: _np.int8,
        torch.uint8: _np.uint8,
        torch.int16: _np.int16,
        torch.int32: _np.int32,
        torch.int64: _np.int64,
    }
)


def _promoted(dtypes: set[torch.dtype], default: torch.dtype) -> torch.dtype:
    return functools.reduce(torch.promote_types, dtypes) if dtypes else default


def _workspace(
    size: int, dtypes: Sequence[torch.dtype], device: torch.device
) -> list[torch.Tensor]:
    """1-D buffers of ``size`` elements, one per dtype, carved from one allocation."""
    # each buffer starts a multiple of 64 bytes into the allocation; never empty (an empty
    # numpy slice has stride 0, which torch cannot view as a dtype of another size)
    size = -(-max(size, 1) // 64) * 64
    nbytes = [size * d.itemsize for d in dtypes]
    starts = list(itertools.accumulate(nbytes, initial=0))
    if device.type == "cpu" and _np is not None:
        # numpy slices and views cost ~0.3 us where torch's cost ~3 us (two per buffer)
        space = _np.empty(starts[-1], dtype=_np.uint8)
        return [
            torch.from_numpy(space[a : a + n]).view(d)
            if d not in _NUMPY_DTYPES
            else torch.from_numpy(space[a : a + n].view(_NUMPY_DTYPES[d]))
            for a, n, d in zip(starts, nbytes, dtypes, strict=False)
        ]
    space = torch.empty(starts[-1], dtype=torch.uint8, device=device)
    return [space[a : a + n].view(d) for a, n, d in zip(starts, nbytes, dtypes, strict=False)]


def trajectory_stats(
    log_probs: Sequence[torch.Tensor],
    rollout_log_probs: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    *,
    chunk_tokens: int | str | None = "auto",
    backend: str = "auto",
) -> torch.Tensor:
    """Per-trajectory ``[sum of masked d_t, masked tokens, non-finite flag]``.

    Returns a float64 tensor of shape ``[B, 3]``. A trajectory whose masked log-ratios
    include a NaN/inf (or whose sum is not finite) gets sum 0 and flag 1, so that a sum
    over ranks stays meaningful and still marks it. A mask entry counts when it is non-zero.

    ``d_t = lp_t - rlp_t`` is computed in float64 (exact for fp32/bf16 inputs) and summed
    per trajectory in float64. No per-token finiteness test is built: a non-finite masked
    ``d_t`` makes its trajectory's float64 sum non-finite (finite fp32/bf16 inputs cannot
    overflow it). Masked-out tokens are ignored even when NaN.

    Args:
        chunk_tokens: the trajectories are processed in groups of about this many tokens (a
            longer trajectory alone) through buffers allocated once per call and reused, so
            that they stay in cache and are page-faulted once. ``"auto"``:
            :data:`CPU_CHUNK_TOKENS` on CPU, ``None`` (one group: a fixed number of tensor
            operations whatever B, one kernel launch each on a GPU) on other devices.
        backend: ``"numpy"`` (CPU tensors: the passes over each group's tokens run as
            numpy calls on the buffers, the segment sums as ``numpy.add.reduceat``: pairwise
            summation, ~6x faster than ``torch.segment_reduce`` on CPU), ``"torch"`` (torch
            ops only, ``torch.segment_reduce``: what other devices run) or ``"auto"``
            (numpy on CPU when it is installed, else torch).
    """
    if (
        chunk_tokens != "auto"
        and chunk_tokens is not None
        and not (isinstance(chunk_tokens, int) and chunk_tokens > 0)
    ):
        raise ValueError(
            f"chunk_tokens must be a positive int, None or 'auto'; got {chunk_tokens!r}"
        )
    _check_backend(backend)
    layout = _checked_layout(log_probs, rollout_log_probs, loss_masks)
    if not layout.lengths:
        return torch.zeros((0, 3), dtype=_ACC)
    device = log_probs[0].device
    if chunk_tokens == "auto":
        chunk_tokens = CPU_CHUNK_TOKENS if device.type == "cpu" else None
    use_numpy = _uses_numpy(backend, device)
    # out= concatenations refuse inputs that require grad
    no_grad = torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext()
    try:
        with no_grad:
            return _stats(log_probs, rollout_log_probs, loss_masks, layout, chunk_tokens, use_numpy)
    except (RuntimeError, TypeError):
        # e.g. a tensor on another device: the per-sample checks name it; if they pass,
        # the error was not about the inputs' layout and is raised as it is
        validate_inputs(log_probs, rollout_log_probs, loss_masks)
        raise


def _check_backend(backend: str) -> None:
    if backend not in ("auto", "numpy", "torch"):
        raise ValueError(f"backend must be 'auto', 'numpy' or 'torch'; got {backend!r}")


def _uses_numpy(backend: str, device: torch.device) -> bool:
    if backend == "numpy" and (_np is None or device.type != "cpu"):
        raise ValueError(
            f"backend='numpy' needs numpy installed and CPU tensors (these are on {device}); "
            "use 'auto' or 'torch'"
        )
    return backend == "numpy" or (backend == "auto" and device.type == "cpu" and _np is not None)


def _groups(offsets: list[int], chunk_tokens: int | None) -> list[tuple[int, int]]:
    """Trajectory index ranges ``[start, stop)`` of about ``chunk_tokens`` tokens each (a
    longer trajectory alone); one range when ``chunk_tokens`` is None."""
    num = len(offsets) - 1
    if chunk_tokens is None or offsets[-1] <= chunk_tokens:
        return [(0, num)]
    groups, start = [], 0
    while start < num:
        stop = max(start + 1, bisect.bisect_right(offsets, offsets[start] + chunk_tokens) - 1)
        groups.append((start, stop))
        start = stop
    return groups


def _concatenate_group(
    inputs: tuple, buffers: tuple, start: int, stop: int, n: int, use_numpy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Trajectories ``[start, stop)`` (``n`` tokens): ``lp - rlp`` in float64 into the
    difference buffer; returns that difference and their masks concatenated, in their
    promoted dtype.

    No per-sample dtype pass for the masks: a complex mask makes the concatenation complex,
    and a NaN shows in a float one. A tensor alone in its group keeps its shape through
    ``torch.cat`` (which compares dims only across tensors), hence the 1-D checks. A
    TypeError here makes the caller run validate_inputs, which names the sample.
    """
    log_probs, rollout_log_probs, loss_masks = inputs
    diff_buf, lp_buf, rlp_buf = buffers[:3]
    lp = torch.cat(log_probs[start:stop], out=lp_buf[:n])
    rlp = torch.cat(rollout_log_probs[start:stop], out=rlp_buf[:n])
    masks = torch.cat(loss_masks[start:stop])
    if masks.is_complex() or any(t.dim() != 1 for t in (lp, rlp, masks)):
        raise TypeError("a complex or non-1-D input tensor")
    if masks.is_floating_point() and bool(torch.isnan(masks).any()):
        # NaN != 0 would count as masked-in: say which sample instead of guessing
        bad = next(i for i, m in enumerate(loss_masks) if bool(torch.isnan(m).any()))
        raise ValueError(
            f"loss_masks[{bad}] holds NaN; a mask entry must be 0 (ignored) or non-zero "
            "(counted). Fix the mask (e.g. torch.nan_to_num) before ESS-LR"
        )
    diff = diff_buf[:n]
    _widened_difference(diff, lp, rlp, use_numpy)
    return diff, masks


def _stats(
    log_probs: Sequence[torch.Tensor],
    rollout_log_probs: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    layout: _Layout,
    chunk_tokens: int | None,
    use_numpy: bool,
) -> torch.Tensor:
    lengths = layout.lengths
    device = log_probs[0].device
    offsets = list(itertools.accumulate(lengths, initial=0))
    groups = _groups(offsets, chunk_tokens)
    cap = max(offsets[stop] - offsets[start] for start, stop in groups)
    lp_type = _promoted(layout.lp_types, _ACC)
    rlp_type = _promoted(layout.rlp_types, _ACC)
    # one allocation for all buffers: separate ones of this size are returned to the OS at
    # every free (glibc trims the heap top) and page-faulted again at the next call
    diff_buf, lp_buf, rlp_buf, keep_buf, bits_buf = _workspace(
        cap, [_ACC, lp_type, rlp_type, torch.bool, torch.int64], device
    )
    if lp_type == _ACC:
        lp_buf = diff_buf  # float64 inputs are concatenated straight into the difference
    inputs = (log_probs, rollout_log_probs, loss_masks)
    buffers = (diff_buf, lp_buf, rlp_buf, keep_buf, bits_buf)
    if use_numpy:
        return torch.from_numpy(_groups_numpy(inputs, lengths, offsets, groups, buffers))
    total, count = _groups_torch(inputs, lengths, offsets, groups, buffers)
    finite = torch.isfinite(total)
    return torch.stack([torch.where(finite, total, 0.0), count, (~finite).to(_ACC)], 1)


def _widened_difference(
    diff: torch.Tensor, lp: torch.Tensor, rlp: torch.Tensor, use_numpy: bool
) -> None:
    """``diff = lp - rlp`` in float64 (exact for fp32/bf16/fp16 inputs)."""
    if use_numpy and lp.dtype in _NUMPY_FLOATS and rlp.dtype in _NUMPY_FLOATS:
        # one pass with the conversions in numpy's inner loop (torch: a widening copy, then a
        # mixed-dtype subtraction: ~25% slower); numpy has no bfloat16
        _np.subtract(lp.numpy(), rlp.numpy(), out=diff.numpy(), dtype=_np.float64)
        return
    if lp.data_ptr() != diff.data_ptr():
        diff.copy_(lp)
    diff.sub_(rlp)


def _groups_numpy(inputs, lengths, offsets, groups, buffers):
    """The CPU path: per group, three concatenations (torch) then numpy passes over the
    workspace (~1 us per call against ~4 us for a torch op on CPU, which matters at
    ~10 calls per group). Returns the ``[B, 3]`` table as a numpy array."""
    diff_buf, _, _, keep_buf, bits_buf = buffers
    diff_np, bits_np = diff_buf.numpy(), bits_buf.numpy()
    lens = _np.frombuffer(array.array("q", lengths), dtype=_np.int64)  # 5x asarray's speed
    starts = _np.add.accumulate(lens) - lens
    any_empty = _np.minimum.reduce(lens) == 0
    table = _np.zeros((len(lengths), 3))
    sums = table[:, 0]
    counts = _np.zeros(len(lengths), dtype=_np.int64)
    for start, stop in groups:
        n = offsets[stop] - offsets[start]
        _, masks = _concatenate_group(inputs, buffers, start, stop, n, use_numpy=True)
        keep = _nonzero(masks, keep_buf[:n])
        d, bits = diff_np[:n], bits_np[:n]
        # -1 (all bits set) where masked in, 0 where out: int8 negation, sign-extended
        _np.negative(keep.view(_np.int8), out=bits)
        # masked-out d_t -> +0.0, NaN included (~4x faster than a masked fill or a where)
        _np.bitwise_and(d.view(_np.int64), bits, out=d.view(_np.int64))
        # reduceat sums [s_i, s_i+1); an empty segment would get values[s_i] instead of 0,
        # so only the non-empty trajectories' starts are passed
        seg = starts[start:stop] - offsets[start]
        if not any_empty:
            _np.add.reduceat(d, seg, out=sums[start:stop])
            _np.add.reduceat(bits, seg, out=counts[start:stop])  # minus the counts
        else:
            nonempty = _np.flatnonzero(lens[start:stop])
            if len(nonempty):
                sums[start + nonempty] = _np.add.reduceat(d, seg[nonempty])
                counts[start + nonempty] = _np.add.reduceat(bits, seg[nonempty])
    # numpy's float64 reductions sum pairwise: more accurate than a sequential sum
    _np.subtract(0.0, counts, out=table[:, 1])  # 0 - 0 = +0.0
    finite = _np.isfinite(sums)
    _np.copyto(sums, 0.0, where=~finite)
    _np.subtract(1.0, finite, out=table[:, 2])
    return table


def _nonzero(masks: torch.Tensor, out: torch.Tensor):
    """``masks != 0`` as a numpy bool array (in ``out`` unless the masks are bool already)."""
    if masks.dtype == torch.bool:
        return masks.numpy()
    if masks.dtype in _NUMPY_DTYPES:
        return _np.not_equal(masks.numpy(), 0, out=out.numpy())
    return out.copy_(masks).numpy()  # e.g. bfloat16: torch's cast to bool is "non-zero"


def _groups_torch(inputs, lengths, offsets, groups, buffers) -> tuple[torch.Tensor, torch.Tensor]:
    """Any device: torch ops only. With one group (the default off CPU) the number of
    operations does not depend on B: one kernel launch each on a GPU."""
    diff_buf, _, _, keep_buf, bits_buf = buffers
    device = diff_buf.device
    seg = torch.frombuffer(array.array("q", lengths), dtype=torch.int64)  # 5x torch.tensor's
    if device.type != "cpu":
        # pinned + non_blocking: the upload does not wait for the device (no host sync)
        seg = seg.pin_memory().to(device, non_blocking=True)
    sums, counts = [], []
    for start, stop in groups:
        n = offsets[stop] - offsets[start]
        diff, masks = _concatenate_group(inputs, buffers, start, stop, n, use_numpy=False)
        keep = masks if masks.dtype == torch.bool else keep_buf[:n].copy_(masks)
        bits = bits_buf[:n].copy_(keep.view(torch.int8).neg_())
        diff.view(torch.int64).bitwise_and_(bits)
        lens = seg[start:stop]
        # segment_reduce has no integer kernel: the counts go through float64 (exact)
        sums.append(torch.segment_reduce(diff, "sum", lengths=lens, unsafe=True))
        counts.append(torch.segment_reduce(bits.to(_ACC), "sum", lengths=lens, unsafe=True))
    total = sums[0] if len(sums) == 1 else torch.cat(sums)
    count = counts[0] if len(counts) == 1 else torch.cat(counts)
    return total, 0.0 - count  # 0 - 0 = +0.0


def summarize(
    stats: torch.Tensor,
    config: EssLrConfig,
    *,
    rank: int = 0,
    flags: Flags | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Reduce this rank's (CP-complete) trajectory table to a summary vector.

    ``flags`` mark missing or invalid inputs; they travel with the summary so that every
    rank reaches the same outcome. ``backend``: as in :func:`trajectory_stats`.
    """
    _check_backend(backend)
    flags = Flags() if flags is None else flags
    values = (rank, flags.missing, flags.invalid)
    if _uses_numpy(backend, stats.device):
        # numpy's calls cost ~1 us where torch's cost ~4 us on CPU: ~25 of them here
        table = stats.detach().to(_ACC).numpy()  # (numpy has no bfloat16)
        return torch.from_numpy(_summary(table, config, values, _NUMPY_OPS))
    return _summary(stats, config, values, _torch_ops(stats.device))


class _Ops(NamedTuple):
    """The array functions :func:`_summary` needs, from numpy (CPU) or torch (any device).

    numpy's entries are its C-level ufuncs and constructors (``np.stack``, ``np.clip`` and
    the array methods go through Python wrappers: ~3-5 us per call against ~1 us)."""

    where: Callable
    exp: Callable
    isfinite: Callable
    clamp_min: Callable
    clamp_max: Callable
    total: Callable  # sum of a 1-D array, as a 0-dim array
    largest: Callable
    smallest: Callable
    row_tallies: Callable  # [k, n] bool -> [k] float64 counts
    stack: Callable  # list of same-shape arrays or 0-dim arrays -> a new leading axis
    concat: Callable
    arange: Callable  # n -> float64 [0, n)
    scalar: Callable  # float, bool or 0-dim tensor -> 0-dim float64
    scalars: Callable  # several of those -> 1-D float64


def _torch_ops(device: torch.device) -> _Ops:
    def scalar(value: float | bool | torch.Tensor) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value.to(device=device, dtype=_ACC).reshape(())
        return torch.full((), float(value), dtype=_ACC, device=device)  # a fill, not an upload

    return _Ops(
        where=torch.where,
        exp=torch.exp,
        isfinite=torch.isfinite,
        clamp_min=torch.clamp_min,
        clamp_max=torch.clamp_max,
        total=torch.sum,
        largest=torch.max,
        smallest=torch.min,
        row_tallies=lambda x: x.sum(1, dtype=_ACC),
        stack=torch.stack,
        concat=torch.cat,
        arange=lambda n: torch.arange(n, dtype=_ACC, device=device),
        scalar=scalar,
        scalars=lambda values: torch.stack([scalar(v) for v in values]),
    )


_NUMPY_OPS = (
    None
    if _np is None
    else _Ops(
        where=_np.where,
        exp=_np.exp,
        isfinite=_np.isfinite,
        clamp_min=_np.maximum,
        clamp_max=_np.minimum,
        total=_np.add.reduce,
        largest=_np.maximum.reduce,
        smallest=_np.minimum.reduce,
        row_tallies=lambda x: _np.add.reduce(x, axis=1, dtype=_np.float64),
        stack=_np.array,
        concat=_np.concatenate,
        arange=lambda n: _np.arange(n, dtype=_np.float64),
        scalar=lambda value: _np.array(float(value), dtype=_np.float64),
        scalars=lambda values: _np.array([float(v) for v in values], dtype=_np.float64),
    )
)


def _summary(stats, config: EssLrConfig, values: tuple, xp: _Ops):
    """:func:`summarize` on a numpy array or a tensor (the same code for both)."""
    total, count, bad = stats[:, 0], stats[:, 1], stats[:, 2]
    is_bad = bad > 0
    m = total / xp.clamp_min(count, 1.0) if config.weight_mode == "geometric" else total
    is_bad = is_bad | ~xp.isfinite(m)
    if config.weight_clip is not None:
        # w_i = min(w_i, clip), in log space (before any shift: the clip is on the true weight)
        m = xp.clamp_max(m, math.log(config.weight_clip))
    valid = (count > 0) & ~is_bad
    m = xp.where(valid, m, -math.inf)
    if len(m):
        shift = xp.largest(m)
        # all -inf (nothing valid) would make (m - shift) NaN: shift by 0 instead
        w = xp.exp(m - xp.where(xp.isfinite(shift), shift, 0.0))
        first_bad = xp.smallest(xp.where(is_bad, xp.arange(len(m)), math.inf))
        first_bad = xp.where(xp.isfinite(first_bad), first_bad, -1.0)
        sums = xp.stack([xp.total(w), xp.total(w * w)])
    else:
        shift, first_bad = xp.scalar(-math.inf), xp.scalar(-1.0)
        sums = xp.stack([xp.scalar(0.0), xp.scalar(0.0)])
    # one stack instead of a write per field: ~15 fewer operations (kernel launches)
    tallies = xp.row_tallies(xp.stack([valid, (count == 0) & ~is_bad, is_bad]))
    return xp.concat(
        [
            shift.reshape(1),
            sums,
            tallies,
            first_bad.reshape(1),
            xp.scalars(values),
        ]
    )


def combine(summaries: torch.Tensor) -> torch.Tensor:
    """Merge per-rank summaries (shape ``[R, SUMMARY_SIZE]``) under one global shift."""
    if summaries.dim() == 1:
        return summaries
    if summaries.shape[0] == 1:
        return summaries[0].clone()  # what the merge below gives for one row, bit for bit
    maxes = summaries[:, _MAX]
    shift = maxes.max()
    safe_shift = torch.where(torch.isfinite(shift), shift, 0.0)
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
