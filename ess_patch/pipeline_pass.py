"""The norm pass across pipeline stages: one micro-batch forward down the stages, backward up.

``norm_pass`` differentiates one rank's whole model. With pipeline parallelism each rank holds
one stage: the forward's activations cross to the next stage and the backward's gradient comes
back. :func:`pipelined_norm_pass` runs that exchange itself, point to point in the pipeline
group, one micro-batch at a time (no interleaving: the pass is short and runs before the
step). Every stage takes the per-trajectory norms of its own parameters (the same rules, or
the exact path: the gradient sent back, sliced to trajectory ``i``, is trajectory ``i``'s, one
trajectory per batch row) and the squares are summed over the pipeline group, then over TP,
so every stage ends with the whole model's ``[N]`` norms.

:func:`pipelined_forward` is the forward alone, without grad (the forward-only proxy needs the
last stage's logits).

Fail closed: every message carries a status. A stage that fails still sends (a failed
status, zeros) and receives every message it owes, then raises; its peers raise
:class:`~ess_patch.guard.EssLrNotAppliedError` naming the stage. No rank waits forever on a
peer that stopped.

Refused by name: embeddings tied to the output layer over stages (the two pieces of one weight
live on two ranks and the cross term is not exchanged).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import EssPatchValueError
from .guard import EssLrNotAppliedError
from .norm_pass import PATHS, NormPassResult, check_finite, check_terms, counted_sq, exact_params
from .per_trajectory import PerTrajectoryGrads

__all__ = ["Stage", "pipelined_forward", "pipelined_norm_pass"]


@dataclass(frozen=True)
class Stage:
    """This rank's place in the pipeline, for a pass that crosses stages.

    ``prev`` / ``next`` are the global ranks of the neighbouring stages (None: first / last);
    ``shape`` is what crosses a boundary (megatron: ``[s, b, h]``), ``rows_dim`` its
    trajectory dimension; ``index`` this stage's number (for the errors)."""

    group: Any
    prev: int | None
    next: int | None
    shape: tuple[int, ...]
    index: int = 0
    rows_dim: int = 1

    @property
    def first(self) -> bool:
        return self.prev is None

    @property
    def last(self) -> bool:
        return self.next is None


def _send(tensor: torch.Tensor | None, shape: tuple, dst: int, group: Any, device: Any) -> None:
    """A status (1 ok, 0 failed) then the payload (zeros when failed): always both."""
    ok = tensor is not None
    dist.send(torch.tensor([1.0 if ok else 0.0], device=device), dst, group=group)
    payload = tensor.detach().float().contiguous() if ok else torch.zeros(shape, device=device)
    dist.send(payload, dst, group=group)


def _recv(shape: tuple, src: int, group: Any, device: Any) -> torch.Tensor | None:
    status = torch.zeros(1, device=device)
    dist.recv(status, src, group=group)
    payload = torch.zeros(shape, device=device)
    dist.recv(payload, src, group=group)
    return payload if float(status) == 1.0 else None


def _peer_failed(stage: Stage, direction: str) -> EssLrNotAppliedError:
    where = f"stage {stage.index - 1}" if direction == "forward" else f"stage {stage.index + 1}"
    return EssLrNotAppliedError(
        f"ess-patch: the norm pass failed on pipeline {where} (its own error is in that "
        f"rank's log); stage {stage.index} stops too, so the baseline is not applied anywhere"
    )


def _refuse_tied(model: torch.nn.Module) -> None:
    if getattr(model, "share_embeddings_and_output_weights", False):
        raise EssPatchValueError(
            "norm pass over pipeline stages: share_embeddings_and_output_weights=True (the "
            "embedding on the first stage and its copy in the last stage's output layer are one "
            "weight whose two pieces are not summed across ranks); untie the embeddings "
            "(--untie-embeddings-and-output-weights) or run the baseline without PP"
        )


def _down(
    forward: Callable[[torch.Tensor | None], torch.Tensor],
    stage: Stage,
    device: Any,
    dtype: torch.dtype,
    grad: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, BaseException | None]:
    """The forward through this stage: (its input, its output, the error), sent on."""
    error: BaseException | None = None
    x = out = None
    if not stage.first:
        x = _recv(stage.shape, stage.prev, stage.group, device)
        if x is None:
            error = _peer_failed(stage, "forward")
        else:
            x = x.to(dtype).requires_grad_(grad)
    if error is None:
        try:
            out = forward(x)
        except Exception as exc:  # sent on as a failed status, then raised here
            error = exc
    if not stage.last:
        _send(None if error is not None else out, stage.shape, stage.next, stage.group, device)
    return x, out, error


def pipelined_forward(
    forward: Callable[[torch.Tensor | None], torch.Tensor],
    stage: Stage,
    *,
    device: Any = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor | None:
    """``forward(input)`` on every stage, without grad; the last stage's output, else None.

    ``forward`` takes the previous stage's activation (None on the first stage, else in
    ``dtype``: the model's) and returns this stage's output (megatron:
    ``model.set_input_tensor(x)`` then ``model(...)``). A stage that fails raises, and so do
    the stages after it; the caller's next collective must carry the failure to the stages
    before it (``baseline_hook`` sums the proxy over the stages, NaN from a failed one)."""
    device = device if device is not None else torch.device("cpu")
    with torch.no_grad():
        _, out, error = _down(forward, stage, device, dtype, grad=False)
    if error is not None:
        raise error
    return out if stage.last else None


def pipelined_norm_pass(
    model: torch.nn.Module,
    forward: Callable[[torch.Tensor | None], torch.Tensor],
    loss_terms: Callable[[torch.Tensor], torch.Tensor],
    stage: Stage,
    *,
    tp_group: Any = None,
    path: str = "rules",
) -> NormPassResult:
    """Per-trajectory squared gradient norms of the whole pipelined model, on every stage.

    Args:
        model: this rank's stage (unwrapped).
        forward: the stage's forward, given the previous stage's activation (None first).
        loss_terms: on the last stage, the ``[N]`` per-trajectory terms from its output.
        stage: this rank's :class:`Stage`.
        tp_group: tensor-parallel group (norms summed over it; replicated parameters once).
        path: ``"rules"`` (modules with no rule take the exact path) or ``"exact"``.

    Raises:
        ValueError: an unknown ``path``, tied embeddings over stages, bad ``loss_terms``.
        EssLrNotAppliedError: another stage failed (that stage raises its own error).
    """
    if path not in PATHS:
        raise EssPatchValueError(f"norm_pass: path={path!r}; give one of {PATHS}")
    _refuse_tied(model)
    t0 = time.perf_counter()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    # the exact path differentiates every parameter itself: no hooks, no frozen weights
    grads = None
    if path == "rules":
        grads = PerTrajectoryGrads(
            model, tp_group=tp_group, defer_linear_weights=True, unsupported="exact"
        )
    try:
        with torch.enable_grad():
            if grads is not None:
                grads.start()
            sq, held, error = _stage_backward(
                grads, model, forward, loss_terms, stage, (path, tp_group)
            )
    finally:
        if grads is not None:
            grads.remove()
    # one sum over the stages: the squares (every stage has every trajectory's row, so the
    # sum is the whole model's) and, last, how many stages failed
    count = stage.shape[stage.rows_dim]
    total = torch.zeros(count + 1, dtype=torch.float64, device=device)
    if error is None and sq is not None and sq.numel() == count:
        total[:count] = sq.double()
    elif error is None:
        error = EssPatchValueError(
            f"norm_pass: stage {stage.index} measured "
            f"{None if sq is None else sq.numel()} trajectories; the stage's shape "
            f"{tuple(stage.shape)} says {count} (dimension {stage.rows_dim})"
        )
    total[count] = float(error is not None)
    dist.all_reduce(total, group=stage.group)
    if error is not None:
        raise error
    if float(total[count]) > 0:
        raise EssLrNotAppliedError(
            f"ess-patch: the norm pass failed on another pipeline stage (its own error is in "
            f"that rank's log); stage {stage.index} stops too"
        )
    sq = total[:count]
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sq, group=tp_group)
    check_finite(sq)
    return NormPassResult(sq_norms=sq, seconds=time.perf_counter() - t0, path=path, held_bytes=held)


def _stage_backward(
    grads: PerTrajectoryGrads | None,
    model: torch.nn.Module,
    forward: Callable[[torch.Tensor | None], torch.Tensor],
    loss_terms: Callable[[torch.Tensor], torch.Tensor],
    stage: Stage,
    how: tuple[str, Any],
) -> tuple[torch.Tensor | None, int, BaseException | None]:
    """Forward down, backward up; this stage's local squares (None on error), held bytes."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    x, out, error = _down(forward, stage, device, dtype, grad=True)
    grad_out = None
    if not stage.last:
        grad_out = _recv(stage.shape, stage.next, stage.group, device)
        if grad_out is None and error is None:
            error = _peer_failed(stage, "backward")
    sq, held, gx = None, 0, None
    if error is None:
        try:
            sq, held, gx = _local(grads, model, (x, out, grad_out), loss_terms, stage, how)
        except Exception as exc:  # sent on as a failed status, then raised here
            error = exc
    if not stage.first:
        _send(gx if error is None else None, stage.shape, stage.prev, stage.group, device)
    return sq, held, error


def _local(
    grads: PerTrajectoryGrads | None,
    model: torch.nn.Module,
    tensors: tuple,
    loss_terms: Callable[[torch.Tensor], torch.Tensor],
    stage: Stage,
    how: tuple[str, Any],
) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """This stage's backward: (local squares, held bytes, the gradient for the previous)."""
    x, out, grad_out = tensors
    path, tp_group = how
    if stage.last:
        root, seed = check_terms(loss_terms(out)), None
        count, total = root.numel(), root.sum()
    else:
        root, seed = out, grad_out.to(out.dtype)
        count, total = out.shape[stage.rows_dim], out
    extra = [x] if x is not None else []
    if path == "exact":
        sq, held = _exact(*exact_params(model, tp_group), root, seed, count, stage)
        gx = torch.autograd.grad(total, extra, grad_outputs=seed)[0] if extra else None
        return sq, held, gx
    assert grads is not None
    if stage.last:
        grads.add_exact(root)
    else:
        grads.add_exact(root, grad_output=seed, rows_dim=stage.rows_dim)
    res = torch.autograd.grad(
        total, grads.small_params() + extra, grad_outputs=seed, allow_unused=True
    )
    sq = grads.local_sq_norms()
    if sq.numel() != count:
        raise EssPatchValueError(
            f"norm_pass: {count} trajectories in {sq.numel()} batch rows on pipeline stage "
            f"{stage.index}; the rules need one trajectory per row"
        )
    return sq, grads.captured_bytes, (res[-1] if extra else None)


def _exact(
    params: list[torch.nn.Parameter],
    counts: list[bool],
    root: torch.Tensor,
    seed: torch.Tensor | None,
    count: int,
    stage: Stage,
) -> tuple[torch.Tensor, int]:
    """One ``autograd.grad`` per trajectory over this stage's parameters: the last stage's
    term ``i``, or the output with the gradient sent back sliced to trajectory ``i``."""
    sq = torch.zeros(count, dtype=torch.float64, device=root.device)
    held = 0
    for i in range(count):
        if seed is None:
            t, g = root[i], None
        else:
            t, g = root, torch.zeros_like(seed)
            g.select(stage.rows_dim, i).copy_(seed.select(stage.rows_dim, i))
        gi = torch.autograd.grad(t, params, grad_outputs=g, retain_graph=True, allow_unused=True)
        held = max(held, sum(v.numel() * v.element_size() for v in gi if v is not None))
        sq[i] = counted_sq(gi, counts, sq)
    return sq, held
