"""The norm pass: per-trajectory squared gradient norms before the training step, for any loss.

VCPO's baseline needs ``||grad_theta (w_i * log p_i)||^2`` per trajectory. The in-step rewrite
(``PerTrajectoryGrads.apply``) is exact only for a loss linear in each trajectory's
coefficient; PPO clipping, a KL or entropy term in the same backward, dual-clip and sequence
ratios (GSPO/GMPO) are not. For those the norms come from this pass, run before the step, and
the step then runs unchanged with the advantage ``R_i - b*``::

    res = norm_pass(model, lambda: weighted_logp_terms(model, batch), tp_group=tp)
    res.sq_norms    # [N] float64, TP and PP summed; res.seconds, res.path

``loss_terms()`` runs the forward and returns the ``[N]`` per-trajectory terms (their sum is
what is differentiated). The pass is one backward that asks for no linear-weight gradient:
``torch.autograd.grad`` with the small parameters (norms, biases, embeddings) as its inputs, so
the per-module hooks of ``ess_patch.per_trajectory`` fire on every module and nothing is written
to ``.grad`` / ``main_grad`` (megatron DDP's accumulation hooks and grad-sync buckets never
run). The linear weights are frozen for the pass (``requires_grad`` restored after), so that
megatron-core's layers take ``linear_with_frozen_weight``: their default Function
(``LinearWithGradAccumulationAndAsyncCommunication``) computes the weight gradient even when
nobody asks for it, a third of the pass's matmul time (BENCHMARKS.md, section 6). Torch's own
layers skip it either way. Parameters, gradients and optimizer state are untouched; a test
checks it.

Paths (``path=``):

* ``"rules"`` (default): the registered per-module rules; modules with no rule take the exact
  path for their own parameters (``unsupported="exact"``). One trajectory per row, or one
  packed (THD) row given ``cu_seqlens`` (each captured token laid back into its trajectory's
  row; the trajectories must not see each other, as under THD attention).
* ``"exact"``: one ``autograd.grad`` per trajectory over every trainable parameter; any
  module, any layout, packed rows included. ``N`` backward passes: the check.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import EssPatchRuntimeError, EssPatchValueError
from .per_trajectory import PerTrajectoryGrads

__all__ = [
    "NormPassResult",
    "check_finite",
    "check_terms",
    "counted_sq",
    "exact_params",
    "norm_pass",
]

PATHS = ("rules", "exact")


@dataclass(frozen=True)
class NormPassResult:
    """What :func:`norm_pass` measured."""

    #: ``[N]`` float64 squared per-trajectory gradient norms (whole model: TP and PP summed).
    sq_norms: torch.Tensor
    #: Wall time of the pass (forward, backward, reductions).
    seconds: float
    #: ``"rules"`` or ``"exact"``.
    path: str
    #: Memory the pass held beyond the forward's own graph: the rules' captures (inputs and
    #: per-trajectory pieces), or the exact path's one set of parameter gradients.
    held_bytes: int = 0


def _size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def check_terms(terms: Any) -> torch.Tensor:
    """``terms`` as the pass needs them: a 1-D tensor with grad, one term per trajectory."""
    if not isinstance(terms, torch.Tensor) or terms.dim() != 1:
        raise EssPatchValueError(
            "norm_pass: loss_terms() must return a 1-D tensor, one term per trajectory; got "
            f"{type(terms).__name__} of shape {tuple(getattr(terms, 'shape', ()))}"
        )
    if not terms.requires_grad:
        raise EssPatchValueError(
            "norm_pass: loss_terms() returned a tensor with no grad; run the forward with "
            "grad enabled (not under torch.no_grad / inference_mode)"
        )
    return terms


def _terms(loss_terms: Callable[[], torch.Tensor]) -> torch.Tensor:
    return check_terms(loss_terms())


def check_finite(sq: torch.Tensor) -> None:
    """Refuse a non-finite squared norm, naming the trajectory."""
    if not bool(torch.isfinite(sq).all()):
        index = int((~torch.isfinite(sq)).nonzero()[0, 0])
        raise EssPatchRuntimeError(
            f"norm_pass: trajectory {index}'s squared gradient norm is {sq[index].item()}; "
            "check its log-probs and IS weight (a non-finite loss term)"
        )


def exact_params(
    model: torch.nn.Module, tp_group: Any
) -> tuple[list[torch.nn.Parameter], list[bool]]:
    """The parameters the exact path differentiates on this rank, and which of them count.

    Every TP rank differentiates every trainable parameter, so that each backward takes the
    same route on every rank and meets the same TP collectives (a replicated embedding below a
    vocabulary-parallel head: its input gradient is all-reduced over TP on the way down). Of
    those, sharded parameters count on every rank and replicated ones on TP rank 0 only, so the
    sum over TP counts each once."""
    tp_rank = dist.get_rank(tp_group) if _size(tp_group) > 1 else 0
    params = [p for p in model.parameters() if p.requires_grad]
    counts = [tp_rank == 0 or bool(getattr(p, "tensor_model_parallel", False)) for p in params]
    return params, counts


def counted_sq(grads: Any, counts: list[bool], like: torch.Tensor) -> torch.Tensor:
    """The float64 sum of squares of the gradients that count on this rank."""
    return sum(
        (
            g.double().square().sum()
            for g, c in zip(grads, counts, strict=True)
            if c and g is not None
        ),
        like.new_zeros((), dtype=torch.float64),
    )


def _exact(model: torch.nn.Module, terms: torch.Tensor, tp_group: Any) -> tuple[torch.Tensor, int]:
    params, counts = exact_params(model, tp_group)
    sq = torch.zeros(terms.numel(), dtype=torch.float64, device=terms.device)
    held = 0
    for i in range(terms.numel()):
        grads = torch.autograd.grad(terms[i], params, retain_graph=True, allow_unused=True)
        held = max(held, sum(g.numel() * g.element_size() for g in grads if g is not None))
        sq[i] = counted_sq(grads, counts, sq)
    return sq, held


def _rules(
    model: torch.nn.Module,
    loss_terms: Callable[[], torch.Tensor],
    tp_group: Any,
    cu_seqlens: Any = None,
) -> tuple[torch.Tensor, int]:
    # frozen linear weights: megatron's layers take linear_with_frozen_weight, whose backward
    # computes no weight gradient (its default Function computes one even when not asked)
    grads = PerTrajectoryGrads(
        model, tp_group=tp_group, defer_linear_weights=True, unsupported="exact"
    )
    try:
        grads.start()
        grads.packed(cu_seqlens)
        terms = _terms(loss_terms)
        grads.add_exact(terms)
        # asking for the small parameters' gradients makes the backward reach every module
        inputs = grads.small_params()
        if inputs:
            torch.autograd.grad(terms.sum(), inputs, allow_unused=True)
        grads.stop()
        held = grads.captured_bytes
        sq = grads.local_sq_norms().double()
        if sq.numel() != terms.numel():
            raise EssPatchValueError(
                f"norm_pass: loss_terms() gave {terms.numel()} trajectories in "
                f"{sq.numel()} batch rows; the rules need one trajectory per row. Packed (THD) "
                "rows: norm_pass(..., cu_seqlens=...) (one packed row, trajectories that do not "
                "see each other) or norm_pass(..., path='exact')"
            )
        return sq, held
    finally:
        grads.remove()


def norm_pass(
    model: torch.nn.Module,
    loss_terms: Callable[[], torch.Tensor],
    *,
    tp_group: Any = None,
    pp_group: Any = None,
    path: str = "rules",
    cu_seqlens: Any = None,
) -> NormPassResult:
    """Per-trajectory squared gradient norms of ``loss_terms()``, changing nothing in the model.

    Args:
        model: this rank's (unwrapped) model stage.
        loss_terms: runs the forward and returns ``[N]`` per-trajectory terms.
        tp_group: tensor-parallel group (norms summed over it; replicated parameters once).
        pp_group: pipeline group. Only one stage (``None`` or a group of one): over stages,
            :func:`ess_patch.pipeline_pass.pipelined_norm_pass` carries the activations down
            and the gradients back itself.
        path: ``"rules"`` or ``"exact"`` (see the module docstring).
        cu_seqlens: the forward runs one packed (THD) row, trajectory ``i`` at tokens
            ``cu_seqlens[i]:cu_seqlens[i+1]`` (megatron's ``PackedSeqParams.cu_seqlens_q``),
            which do not see each other: the rules lay each token back into its
            trajectory's row. The exact path needs nothing (``loss_terms`` says the split).

    Raises:
        ValueError: an unknown ``path``, a pipeline of more than one stage, bad ``loss_terms``.
        RuntimeError: the pass saw a module run without its backward (from the rules).
    """
    if path not in PATHS:
        raise EssPatchValueError(f"norm_pass: path={path!r}; give one of {PATHS}")
    if _size(pp_group) > 1:
        raise EssPatchValueError(
            f"norm_pass: a pipeline of {_size(pp_group)} stages; norm_pass runs one stage's "
            "whole model. Over stages use ess_patch.pipeline_pass.pipelined_norm_pass (it "
            "exchanges the activations and gradients itself)"
        )
    t0 = time.perf_counter()
    with torch.enable_grad():
        if path == "exact":
            sq, held = _exact(model, _terms(loss_terms), tp_group)
        else:
            sq, held = _rules(model, loss_terms, tp_group, cu_seqlens)
    if _size(tp_group) > 1:
        dist.all_reduce(sq, group=tp_group)
    check_finite(sq)
    return NormPassResult(sq_norms=sq, seconds=time.perf_counter() - t0, path=path, held_bytes=held)
