"""VCPO's minimum-variance off-policy baseline: pure tensor math, no torch.distributed.

Per prompt group ``g`` (arXiv 2602.17616; VCPO's ``compute_opob_baseline``)::

    b*_g = sum_{i in g} w_i^2 ||g_i||^2 R_i  /  sum_{i in g} w_i^2 ||g_i||^2
    A_i  = R_i - b*_{g(i)}

``w_i`` is trajectory i's importance weight, ``g_i`` the gradient of its log-probability and
``R_i`` its reward. Only the products ``w_i^2 ||g_i||^2`` matter, and only up to a common
factor per group, so the scores ``s_i = 2 log w_i + log ||g_i||^2 (- 2 log L_i)`` are shifted
by their group's maximum before ``exp``: product-mode weights (``exp`` of a sum over thousands
of tokens) never overflow. Accumulated in float64.

Choices (docs/baseline.md gives the reasons at length):

* ``log_weights=None``: the norms already carry the weight, i.e. they are the norms of the
  *weighted* loss term's gradient (what ``ess_patch.per_trajectory`` measures in the
  training backward). VCPO's code records the norm of the TIS-weighted loss and multiplies
  by ``w^2`` again (``w^4`` in all); passing both here would repeat that, so don't.
* Clipped or not: pass the weight the loss actually uses (clipped if it clips). b* minimises
  the variance of the estimator that is run, and that estimator's terms carry that weight.
* ``lengths``: the ``1/L_i^2`` factor of a per-sequence-mean loss, for norms of the *un*
  normalised log-prob gradient. Leave it ``None`` when the norms come from the loss itself.
* Groups are the ids present in ``group_ids`` (no empty group can exist). A group of one gets
  ``b* = R`` and advantage 0 (as GRPO's group mean does). A trajectory with a zero norm gets
  no say in b*; a group whose norms are all zero falls back to its mean reward (the GRPO
  baseline) and is counted in ``fallback_groups``.
* Non-finite input raises :class:`NonFiniteBaselineInputError` (ess-patch's default
  ``nonfinite="raise"``), naming the input and the first bad index; ``log_weights`` may be
  ``-inf`` (weight 0). A negative squared norm raises ``ValueError``.
* The function sees one rank's trajectories: keep each group on one data-parallel rank (as
  VCPO does). A group split over ranks would get one b* per part, each minimising only its
  part's variance (and a part of one gets advantage 0): the sums per group would have to be
  reduced over DP first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import EssPatchError, EssPatchValueError

__all__ = ["BaselineResult", "NonFiniteBaselineInputError", "min_variance_baseline"]

_ACC = torch.float64


class NonFiniteBaselineInputError(EssPatchError, FloatingPointError):
    """A reward, squared norm or log-weight given to the baseline was NaN or infinite."""


@dataclass(frozen=True)
class BaselineResult:
    """What :func:`min_variance_baseline` returns (float64 tensors on the inputs' device)."""

    #: ``[N]``: ``R_i - b*_{g(i)}``, in the order of the inputs.
    advantages: torch.Tensor
    #: ``[G]``: each group's baseline, in the order of :attr:`group_ids`.
    baselines: torch.Tensor
    #: ``[G]``: the distinct group ids, ascending.
    group_ids: torch.Tensor
    #: ``[N]``: each trajectory's baseline ``b*_{g(i)}``.
    per_trajectory: torch.Tensor
    #: Groups whose norms were all zero (baseline = their mean reward).
    fallback_groups: int


def _as_vector(name: str, value: torch.Tensor, n: int | None) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dim() != 1:
        raise EssPatchValueError(
            f"min_variance_baseline: {name} must be 1-D, got shape {tuple(t.shape)}"
        )
    if n is not None and t.numel() != n:
        raise EssPatchValueError(
            f"min_variance_baseline: {name} has {t.numel()} entries, rewards has {n}; "
            "give one value per trajectory"
        )
    return t


def _check_finite(name: str, t: torch.Tensor, *, allow_neg_inf: bool = False) -> None:
    bad = torch.isnan(t) | (t == float("inf"))
    if not allow_neg_inf:
        bad |= t == float("-inf")
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        raise NonFiniteBaselineInputError(
            f"min_variance_baseline: {name}[{index}] = {t[index].item()} is not finite; "
            "check the rollout's rewards / log-probs and the gradient norms before the baseline"
        )


def min_variance_baseline(
    log_weights: torch.Tensor | None,
    rewards: torch.Tensor,
    sq_grad_norms: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    lengths: torch.Tensor | None = None,
) -> BaselineResult:
    """Each group's minimum-variance baseline and every trajectory's advantage.

    Args:
        log_weights: ``[N]`` ``log w_i`` (``-inf`` allowed: weight 0), or ``None`` when
            ``sq_grad_norms`` already include ``w_i^2``.
        rewards: ``[N]`` ``R_i``.
        sq_grad_norms: ``[N]`` ``||g_i||^2`` (>= 0).
        group_ids: ``[N]`` integer prompt-group id of each trajectory.
        lengths: ``[N]`` response lengths ``L_i`` (> 0) for the ``1/L_i^2`` factor, or ``None``.

    Raises:
        NonFiniteBaselineInputError: a NaN/inf reward, norm, length or log-weight (``+inf``).
        ValueError: shapes disagree, a negative norm, a length <= 0, non-integer group ids.
    """
    r = _as_vector("rewards", rewards, None)
    n = r.numel()
    sq = _as_vector("sq_grad_norms", sq_grad_norms, n)
    ids = _as_vector("group_ids", group_ids, n)
    if ids.is_floating_point() or ids.is_complex():
        raise EssPatchValueError("min_variance_baseline: group_ids must be an integer tensor")
    device = r.device
    r, sq = r.to(device, _ACC), sq.to(device, _ACC)
    _check_finite("rewards", r)
    _check_finite("sq_grad_norms", sq)
    if bool((sq < 0).any()):
        index = int((sq < 0).nonzero()[0, 0])
        raise EssPatchValueError(
            f"min_variance_baseline: sq_grad_norms[{index}] = {sq[index].item()} is negative; "
            "a squared norm is >= 0"
        )
    score = torch.log(sq)  # zero norm -> -inf: no say in b*
    if log_weights is not None:
        lw = _as_vector("log_weights", log_weights, n).to(device, _ACC)
        _check_finite("log_weights", lw, allow_neg_inf=True)
        score = score + 2 * lw
    if lengths is not None:
        length = _as_vector("lengths", lengths, n).to(device, _ACC)
        _check_finite("lengths", length)
        if bool((length <= 0).any()):
            raise EssPatchValueError(
                "min_variance_baseline: lengths must be > 0 (the 1/L^2 factor)"
            )
        score = score - 2 * torch.log(length)
    uniq, inverse = torch.unique(ids.to(device), return_inverse=True)
    g = uniq.numel()
    top = torch.full((g,), float("-inf"), dtype=_ACC, device=device)
    top = top.scatter_reduce(0, inverse, score, "amax")
    # a group whose scores are all -inf: shift by 0, its weights are then all exactly 0
    shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(score - shift[inverse])
    zeros = torch.zeros(g, dtype=_ACC, device=device)
    num = zeros.index_add(0, inverse, e * r)
    den = zeros.index_add(0, inverse, e)
    count = zeros.index_add(0, inverse, torch.ones_like(r))
    mean = zeros.index_add(0, inverse, r) / count.clamp(min=1)
    fallback = den == 0
    base = torch.where(fallback, mean, num / torch.where(fallback, torch.ones_like(den), den))
    per = base[inverse]
    return BaselineResult(
        advantages=r - per,
        baselines=base,
        group_ids=uniq,
        per_trajectory=per,
        fallback_groups=int(fallback.sum()),
    )
