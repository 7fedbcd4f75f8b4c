"""Per-trajectory gradients of a megatron-core ``GPTModel`` in the training backward.

:class:`PerTrajectoryGrads` hooks every module of a model that owns parameters. While
capturing, each module keeps its input (forward hook); when the training backward reaches the
module's output (a tensor hook), it turns input and output gradient into this micro-batch's
per-trajectory pieces of every parameter's gradient. After the backward:

* ``sq_norms()`` gives ``||grad of trajectory i's loss term||^2`` for
  every trajectory of this rank, summed over this rank's parameters, then over the tensor-
  parallel group (sharded parameters from every TP rank, replicated ones from TP rank 0 only)
  and over the pipeline group;
* ``apply()`` rewrites every parameter's gradient as
  ``sum_i c_i * (trajectory i's contribution)``: the backward is linear in each trajectory's
  loss coefficient, so this is exactly the gradient of the loss with coefficients ``c_i``
  (VCPO's ``R_i - b*``), with no second backward. The rewrite happens before the DP
  all-reduce (call it from ``finalize_model_grads``).

Supported modules, one rule per kind registered by ``rule()`` (megatron's local spec, TP
without sequence parallelism): megatron's ``ColumnParallelLinear`` / ``RowParallelLinear``
(weight, optional bias; a gathered output is sliced back to the rank's shard; SwiGLU's fc1 and
GQA's qkv are plain column-parallel), ``torch.nn.LayerNorm`` / megatron's ``WrappedTorchNorm`` /
``FusedLayerNorm`` (weight, bias), ``torch.nn.RMSNorm`` (what ``WrappedTorchNorm`` builds for
``normalization="RMSNorm"``), ``VocabParallelEmbedding`` and ``torch.nn.Embedding``. Layouts as
megatron's: linear and norm activations ``[s, b, h]``, embedding ids ``[b, s]``, one trajectory
per batch row. A trainable parameter in any other module raises :class:`UnsupportedModuleError`
at construction (naming it and the fix) unless ``unsupported="exact"``: then those parameters
take the exact path (:meth:`PerTrajectoryGrads.add_exact`, one ``autograd.grad`` per
trajectory). Tied embeddings and sequence parallelism are refused by name.

How each parameter's per-trajectory gradient is held until ``apply()`` (per micro-batch of
``b`` trajectories of ``s`` tokens):

* *materialised*: ``[b, *param.shape]`` (every bias and norm weight, always; a linear weight
  ``[o, i]`` when ``o*i <= materialise_ratio * s*(o+i)``; an embedding shard of ``V`` rows
  when ``V <= materialise_ratio * s``). Computed in the backward by a batched matmul that
  does the work of the weight-gradient matmul; the norm is then a square-sum and the rewrite
  a weighted sum over ``b``: no extra matmul, ``b*o*i`` floats held.
* *factored*: the input and the output gradient held (``[s, b, i]`` and ``[s, b, o]``, megatron's
  layout, which the rewrite's matmul reads without a copy). The norm is the "ghost" norm
  ``sum_st <x_s, x_t><d_s, d_t>``, taken in the backward (``b*s^2*(i+o)`` extra
  multiply-adds); the rewrite is the weight-gradient matmul.

With ``defer_linear_weights=True`` (the default) ``start()`` freezes the linear weights for
the step (megatron's ``linear_with_frozen_weight`` path) so that autograd does not compute
their gradient only for ``apply()`` to overwrite it: the per-trajectory matmul *replaces*
the weight-gradient matmul. ``stop()`` unfreezes them. Biases, norms and embeddings are small
and keep their autograd gradient (overwritten by ``apply()``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import EssPatchError, EssPatchRuntimeError, EssPatchValueError

__all__ = ["PerTrajectoryGrads", "UnsupportedModuleError", "rule", "rule_kind"]

logger = logging.getLogger(__name__)

_ACC = torch.float32


class UnsupportedModuleError(EssPatchError, TypeError):
    """The model has a trainable parameter in a module kind with no per-trajectory rule."""


def _group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


#: The registry of rules (built at import by ``rule()``): matcher -> kind, first match wins.
_RULES: list[tuple[Callable[[torch.nn.Module], bool], str]] = []


def rule(kind: str) -> Callable[[Callable[[torch.nn.Module], bool]], Callable]:
    """Register ``matcher(module) -> bool`` for the per-trajectory rule ``kind``."""

    def register(matcher: Callable[[torch.nn.Module], bool]) -> Callable:
        _RULES.append((matcher, kind))
        return matcher

    return register


@rule("linear")
def _is_linear(module: torch.nn.Module) -> bool:
    # with or without bias (add_bias_linear=False: no bias parameter); SwiGLU's fc1 is one
    return type(module).__name__ in ("ColumnParallelLinear", "RowParallelLinear")


@rule("layernorm")
def _is_layernorm(module: torch.nn.Module) -> bool:
    if isinstance(module, torch.nn.LayerNorm):
        return True
    return type(module).__name__ in ("FusedLayerNorm", "WrappedTorchNorm") and (
        getattr(module, "normalization", "LayerNorm") == "LayerNorm"
    )


@rule("rmsnorm")
def _is_rmsnorm(module: torch.nn.Module) -> bool:
    # megatron's WrappedTorchNorm(normalization="RMSNorm") builds a torch.nn.RMSNorm
    return isinstance(module, torch.nn.RMSNorm) or type(module).__name__ == "RMSNorm"


@rule("embedding")
def _is_embedding(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "VocabParallelEmbedding" or isinstance(
        module, torch.nn.Embedding
    )


def _kind(module: torch.nn.Module) -> str | None:
    for matcher, kind in _RULES:
        if matcher(module):
            return kind
    return None


def rule_kind(module: torch.nn.Module) -> str | None:
    """The rule that covers ``module`` (``"linear"``, ``"rmsnorm"``...), or None: a module with
    no rule, whose parameters take the exact path (``unsupported="exact"``) or raise."""
    return _kind(module)


@dataclass
class _Piece:
    """One parameter's per-trajectory gradient for one micro-batch."""

    #: ``[b, *shape]`` when materialised, else None.
    full: torch.Tensor | None = None
    #: factored: linear ``(x [s, b, i], delta [s, b, o])`` (megatron's layout), embedding
    #: ``(local ids [b, s], delta [b, s, h])``.
    x: torch.Tensor | None = None
    delta: torch.Tensor | None = None
    #: ``[b]`` squared norms of a materialised piece, taken in the backward while it is hot.
    sq: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.full is not None and self.sq is None:
            self.sq = torch.linalg.vector_norm(self.full.flatten(1), dim=1).square()

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.full, self.x, self.delta) if t is not None
        )


@dataclass
class _Site:
    """One hooked module: its inputs (forward) and its pieces (backward), per micro-batch."""

    name: str
    module: torch.nn.Module
    kind: str
    params: dict[str, torch.nn.Parameter]
    inputs: list[torch.Tensor | None] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    pieces: list[dict[str, _Piece] | None] = field(default_factory=list)

    def clear(self) -> None:
        self.inputs.clear()
        self.rows.clear()
        self.pieces.clear()


class PerTrajectoryGrads:
    """Hooks on ``model`` that give per-trajectory gradient norms and a reweighted gradient.

    Args:
        model: the (unwrapped) megatron ``GPTModel`` stage of this rank, or any module whose
            trainable parameters all sit in supported modules.
        tp_group: the tensor-parallel group (``None`` or one rank: no collective).
        pp_group: the pipeline-parallel group (``None`` or one rank: no collective).
        defer_linear_weights: freeze the linear weights between ``start()`` and ``stop()``
            so that autograd skips the weight-gradient matmul that ``apply()`` replaces (and
            that the norm pass does not need). Not when the hooked modules hold nothing but
            linear weights: the backward would have no leaf to reach the modules through.
        materialise_ratio: hold a linear weight's or embedding's per-trajectory gradient
            materialised while that takes at most this many times the memory of the factored
            form (0: always factored; ``inf``: always materialised). See the module docstring.
        unsupported: ``"error"`` (default): a trainable parameter in a module with no rule
            raises; ``"exact"``: such parameters take the exact path, one ``autograd.grad``
            per trajectory, given the per-trajectory loss terms by :meth:`add_exact` (slow).

    Raises:
        UnsupportedModuleError: a trainable parameter sits in an unsupported module (named).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        tp_group: Any = None,
        pp_group: Any = None,
        defer_linear_weights: bool = True,
        materialise_ratio: float = 1.0,
        unsupported: str = "error",
    ):
        if not materialise_ratio >= 0:
            raise EssPatchValueError(
                f"PerTrajectoryGrads: materialise_ratio={materialise_ratio} must be >= 0"
            )
        self.materialise_ratio = materialise_ratio
        self.tp_group = tp_group if _group_size(tp_group) > 1 else None
        self.pp_group = pp_group if _group_size(pp_group) > 1 else None
        self.tp_rank = dist.get_rank(self.tp_group) if self.tp_group is not None else 0
        if unsupported not in ("error", "exact"):
            raise EssPatchValueError(
                f"PerTrajectoryGrads: unsupported={unsupported!r}; give 'error' or 'exact'"
            )
        self._refuse_layouts(model)
        self._sites: list[_Site] = []
        self._exact: list[_Site] = []
        refused = []
        for name, module in model.named_modules():
            own = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
            if not own:
                continue
            kind = _kind(module)
            if kind is None:
                if unsupported == "exact":
                    self._exact.append(_Site(name, module, "exact", own))
                    logger.info(
                        "PerTrajectoryGrads: %s (%s) takes the exact path",
                        name,
                        type(module).__name__,
                    )
                else:
                    refused.append(f"{name or '<root>'} ({type(module).__name__})")
                continue
            self._sites.append(_Site(name, module, kind, own))
        if refused:
            raise UnsupportedModuleError(
                "PerTrajectoryGrads: no per-trajectory gradient rule for the parameters of "
                + ", ".join(refused)
                + "; supported: megatron Column/RowParallelLinear (with or without bias), "
                "LayerNorm, RMSNorm, VocabParallelEmbedding, torch LayerNorm/RMSNorm/Embedding. "
                "Fix: PerTrajectoryGrads(..., unsupported='exact') and add_exact(loss_terms) "
                "(one backward per trajectory for those modules: exact, slow)"
            )
        self._tied = self._tied_output(model)
        self.num_params = sum(
            p.numel()
            for p in {
                id(p): p for s in self._sites + self._exact for p in s.params.values()
            }.values()
        )
        # a linear weight that is also a site's own non-linear parameter (the tied embedding)
        # is not frozen: the embedding's piece needs its gradient path
        owned = {id(p) for s in self._sites if s.kind != "linear" for p in s.params.values()}
        linear = [
            s.params["weight"]
            for s in self._sites
            if s.kind == "linear" and id(s.params["weight"]) not in owned
        ]
        ids = {id(w) for w in linear}
        # with nothing but linear weights, freezing them would leave the backward no leaf
        others = any(id(p) not in ids for s in self._sites for p in s.params.values())
        self._frozen = linear if defer_linear_weights and others else []
        self._capturing = False
        self._in_exact = False
        self._cu: list[int] | None = None
        self._handles = [s.module.register_forward_hook(self._forward_hook(s)) for s in self._sites]

    def _tied_output(self, model: torch.nn.Module) -> tuple[_Site, _Site] | None:
        """With tied embeddings, the output layer (which owns no weight: it is handed the
        embedding's at run time) becomes a linear site of the embedding's weight; returns the
        (embedding, output) site pair whose pieces are one parameter's, or None."""
        if not getattr(model, "share_embeddings_and_output_weights", False):
            return None
        shared = model.shared_embedding_or_output_weight()
        output = getattr(model, "output_layer", None)
        embedding = [
            s for s in self._sites if s.kind == "embedding" and shared in s.params.values()
        ]
        if output is None or len(embedding) != 1 or not shared.requires_grad:
            return None
        if output in {s.module for s in self._sites}:  # it owns a weight: not the tied layout
            return None
        site = _Site("output_layer (tied)", output, "linear", {"weight": shared})
        self._sites.append(site)
        return embedding[0], site

    @property
    def _all(self) -> list[_Site]:
        """The hooked sites, then the exact path's."""
        return self._sites + self._exact

    @staticmethod
    def _refuse_layouts(model: torch.nn.Module) -> None:
        """Layouts whose per-trajectory split the rules don't do yet, refused by name."""
        config = getattr(model, "config", None)
        if getattr(config, "sequence_parallel", False):
            raise UnsupportedModuleError(
                "PerTrajectoryGrads: sequence_parallel=True (activations split over TP along "
                "the sequence) has no per-trajectory rule yet; turn sequence parallelism off"
            )
        tied = getattr(model, "share_embeddings_and_output_weights", False)
        if tied and not (
            getattr(model, "pre_process", True) and getattr(model, "post_process", True)
        ):
            raise UnsupportedModuleError(
                "PerTrajectoryGrads: share_embeddings_and_output_weights=True over pipeline "
                "stages (the output layer's copy of the embedding on the last stage): the two "
                "pieces live on different ranks and are not summed yet; untie the embeddings or "
                "keep the embedding and the output layer on one stage"
            )

    def add_exact(
        self,
        loss_terms: torch.Tensor,
        grad_output: torch.Tensor | None = None,
        rows_dim: int = 1,
    ) -> None:
        """The exact path for modules with no rule: call once per micro-batch, before its
        backward, with ``[b]`` per-trajectory loss terms (their sum is the micro-batch loss).

        One ``autograd.grad`` per trajectory w.r.t. the unruled parameters (graph retained for
        the training backward): exact, ``b`` extra backward passes. No-op with no such module.

        A pipeline stage but the last has no loss terms: give its output as ``loss_terms`` and
        the gradient the next stage sent back as ``grad_output``; trajectory ``i``'s share is
        that gradient's slice ``i`` along ``rows_dim`` (megatron's ``[s, b, h]``: 1), exact
        for one trajectory per batch row.
        """
        if not self._exact or not self._capturing:
            return
        params = [p for s in self._exact for p in s.params.values()]
        if grad_output is None:
            roots = [(t, None) for t in loss_terms.flatten()]
        else:
            count = grad_output.shape[rows_dim]
            roots = []
            for i in range(count):
                mask = torch.zeros_like(grad_output)
                mask.select(rows_dim, i).copy_(grad_output.select(rows_dim, i))
                roots.append((loss_terms, mask))
        self._in_exact = True
        try:
            per = [
                torch.autograd.grad(
                    root, params, grad_outputs=grad, retain_graph=True, allow_unused=True
                )
                for root, grad in roots
            ]
        finally:
            self._in_exact = False
        k = 0
        for site in self._exact:
            pieces = {}
            for name, p in site.params.items():
                g = [torch.zeros_like(p) if gi[k] is None else gi[k] for gi in per]
                pieces[name] = _Piece(full=torch.stack(g).to(_ACC))
                k += 1
            site.inputs.append(None)
            site.rows.append(len(roots))
            site.pieces.append(pieces)

    # ---------------------------------------------------------------- packed rows
    def packed(self, cu_seqlens: torch.Tensor | Sequence[int] | None) -> None:
        """The next passes run packed (THD) rows: one row of ``cu_seqlens[-1]`` tokens holding
        trajectory ``i`` at ``cu_seqlens[i]:cu_seqlens[i+1]``; ``None``: one trajectory per
        row again. Every captured token is laid out back into its trajectory's row (zeros
        after its end), so the rules and the rewrite work as on padded rows. Valid where the
        trajectories do not see each other (THD attention, per-sequence positions); tokens
        past ``cu_seqlens[-1]`` (THD padding) belong to no trajectory and are left out."""
        if cu_seqlens is None:
            self._cu = None
            return
        cu = [int(v) for v in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
        if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)):
            raise EssPatchValueError(
                f"PerTrajectoryGrads.packed: cu_seqlens={cu[:8]}... must start at 0 and never "
                "decrease (the cumulative sequence lengths of the packed row, megatron's "
                "PackedSeqParams.cu_seqlens_q)"
            )
        self._cu = cu

    def _unpack(self, t: torch.Tensor, batch_dim: int) -> torch.Tensor:
        """A packed row's ``t`` (batch ``1`` at ``batch_dim``, tokens next to it) as padded
        rows, the layout of ``t`` kept: ``[T, 1, .] -> [S, N, .]``, ``[1, T, .] -> [N, S, .]``."""
        cu = self._cu
        assert cu is not None
        time_dim = 1 - batch_dim
        if t.shape[batch_dim] != 1 or t.shape[time_dim] < cu[-1]:
            raise EssPatchValueError(
                f"PerTrajectoryGrads: a packed pass needs rows of one packed sequence of at "
                f"least cu_seqlens[-1] = {cu[-1]} tokens; a module saw shape {tuple(t.shape)}"
            )
        flat = t.select(batch_dim, 0)  # [T, .]
        lengths = [b - a for a, b in itertools.pairwise(cu)]
        out = flat.new_zeros((len(lengths), max(lengths), *flat.shape[1:]))
        for k, (start, length) in enumerate(zip(cu, lengths, strict=False)):
            out[k, :length] = flat[start : start + length]
        return out if batch_dim == 0 else out.transpose(0, 1)

    # ---------------------------------------------------------------- capture
    def _forward_hook(self, site: _Site):
        def hook(module: torch.nn.Module, inputs: tuple, output: Any) -> None:
            if not self._capturing or not torch.is_grad_enabled():
                return
            out = output[0] if isinstance(output, tuple) else output
            if not out.requires_grad:
                return
            k = len(site.inputs)
            x = inputs[0].detach()
            batch_dim = 0 if site.kind == "embedding" else 1  # ids [b, s]; megatron's [s, b, .]
            packed = self._cu is not None
            if packed:
                x = self._unpack(x, batch_dim)
            site.inputs.append(x)
            site.rows.append(x.shape[batch_dim])
            site.pieces.append(None)

            def grad_hook(grad: torch.Tensor) -> None:
                if self._in_exact:  # add_exact's own backward passes, not the training one
                    return
                grad = grad.detach()
                if packed:
                    grad = self._unpack(grad, batch_dim)
                site.pieces[k] = self._pieces(site, site.inputs[k], grad)
                site.inputs[k] = None  # held by the pieces where still needed

            out.register_hook(grad_hook)

        return hook

    def start(self) -> None:
        """Drop earlier captures and capture the next forward/backward passes (with grad)."""
        for s in self._sites + self._exact:
            s.clear()
        for p in self._frozen:
            p.requires_grad_(False)
        self._capturing = True

    def stop(self) -> None:
        """Stop capturing, unfreeze the linear weights (captures stay until start/remove)."""
        self._capturing = False
        for p in self._frozen:
            p.requires_grad_(True)

    def clear(self) -> None:
        """Free the captures (after ``apply()``)."""
        for s in self._sites + self._exact:
            s.clear()

    def remove(self) -> None:
        """Remove the hooks, unfreeze the linear weights and free the captures."""
        self.stop()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.clear()

    def small_params(self) -> list[torch.nn.Parameter]:
        """The hooked parameters but the linear weights (norms, biases, embeddings): the
        inputs of a backward that reaches every module and asks for no weight gradient
        (``ess_patch.norm_pass``). The linear weights if there is nothing else."""
        owned = {id(p) for s in self._sites if s.kind != "linear" for p in s.params.values()}
        linear = {
            id(s.params["weight"])
            for s in self._sites
            if s.kind == "linear" and id(s.params["weight"]) not in owned
        }
        small = {id(p): p for s in self._sites for p in s.params.values() if id(p) not in linear}
        return list(small.values()) or list(
            {id(p): p for s in self._sites for p in s.params.values()}.values()
        )

    @property
    def captured_bytes(self) -> int:
        """Memory held by the captures now (inputs, pieces)."""
        total = 0
        for s in self._all:
            total += sum(x.numel() * x.element_size() for x in s.inputs if x is not None)
            for pieces in s.pieces:
                total += sum(p.nbytes() for p in (pieces or {}).values())
        return total

    def num_trajectories(self) -> int:
        """Trajectories captured since ``start()`` (rows of every micro-batch)."""
        return sum(self._all[0].rows) if self._all else 0

    # ---------------------------------------------------------------- per site, backward time
    def _pieces(self, site: _Site, x: torch.Tensor, d: torch.Tensor) -> dict[str, _Piece]:
        """This micro-batch's per-trajectory pieces of the site's parameters."""
        m = site.module
        out: dict[str, _Piece] = {}
        if site.kind == "embedding":
            return {"weight": self._embedding_piece(m, x, d.to(_ACC))}
        x, d = x.to(_ACC), d.to(_ACC)  # megatron's [s, b, .]
        if site.kind == "linear":
            w = site.params.get("weight")
            out_local = (w if w is not None else m.weight).shape[0]
            if d.shape[-1] != out_local:  # gathered output (gather_output / runtime gather)
                d = d.narrow(-1, self.tp_rank * out_local, out_local).contiguous()
            if w is not None:
                s, i, o = x.shape[0], x.shape[2], d.shape[2]
                xb, db = x.transpose(0, 1), d.transpose(0, 1)  # [b, s, .] views
                if o * i <= self.materialise_ratio * s * (o + i):
                    out["weight"] = _Piece(full=db.transpose(1, 2) @ xb)
                else:
                    # ghost norm now, while x and d are hot; they stay in megatron's layout,
                    # where the rewrite's matmul reads them without a copy
                    gram = (xb @ xb.transpose(1, 2)) * (db @ db.transpose(1, 2))
                    out["weight"] = _Piece(x=x, delta=d, sq=gram.sum((1, 2)))
            x, d = x.transpose(0, 1), d.transpose(0, 1)  # [b, s, .] for the bias
        else:  # layernorm, rmsnorm
            x, d = x.transpose(0, 1), d.transpose(0, 1)  # [b, s, .]
            if "weight" in site.params:
                xhat = self._rms(m, x) if site.kind == "rmsnorm" else self._normalised(m, x)
                out["weight"] = _Piece(full=(d * xhat).sum(1))
        if "bias" in site.params:
            out["bias"] = _Piece(full=d.sum(1))
        return out

    @staticmethod
    def _normalised(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        eps = getattr(m, "eps", 1e-5)
        return torch.nn.functional.layer_norm(x, tuple(m.weight.shape), None, None, eps)

    @staticmethod
    def _rms(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        eps = getattr(m, "eps", None)
        eps = torch.finfo(x.dtype).eps if eps is None else eps  # torch.nn.RMSNorm's default
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)

    @staticmethod
    def _local_ids(m: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the embedding table for ``ids`` and the mask of ids it holds."""
        lo = getattr(m, "vocab_start_index", 0)
        hi = getattr(m, "vocab_end_index", m.weight.shape[0])
        keep = (ids >= lo) & (ids < hi)
        return torch.where(keep, ids - lo, torch.zeros_like(ids)), keep

    def _embedding_piece(self, m: torch.nn.Module, ids: torch.Tensor, d: torch.Tensor) -> _Piece:
        local, keep = self._local_ids(m, ids)
        d = d * keep[..., None]
        b, s, h = d.shape
        rows = m.weight.shape[0]
        if rows > self.materialise_ratio * s:
            return _Piece(x=local, delta=d)
        index = (torch.arange(b, device=d.device)[:, None] * rows + local).flatten()
        g = torch.zeros(b * rows, h, dtype=_ACC, device=d.device)
        g.index_add_(0, index, d.reshape(b * s, h))
        return _Piece(full=g.view(b, rows, h))

    # ---------------------------------------------------------------- norms and rewrite
    def _counted(self, p: torch.nn.Parameter) -> bool:
        """Sharded parameters count on every TP rank, replicated ones on TP rank 0 only."""
        return self.tp_rank == 0 or bool(getattr(p, "tensor_model_parallel", False))

    @staticmethod
    def _piece_sq(kind: str, piece: _Piece) -> torch.Tensor:
        if piece.sq is not None:
            return piece.sq
        x, d = piece.x, piece.delta
        assert kind == "embedding" and x is not None and d is not None
        # x: local ids [b, s]; pairs of tokens with the same row
        return ((d @ d.transpose(1, 2)) * (x[:, :, None] == x[:, None, :])).sum((1, 2))

    @staticmethod
    def _piece_grad(kind: str, piece: _Piece, c: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if piece.full is not None:
            return (c @ piece.full.flatten(1)).view(shape)
        x, d = piece.x, piece.delta
        assert x is not None and d is not None
        if kind == "embedding":  # [b, s] ids, [b, s, h]
            dc = d * c[:, None, None]
            g = torch.zeros(shape, dtype=_ACC, device=d.device)
            return g.index_add_(0, x.flatten(), dc.reshape(-1, dc.shape[-1]))
        dc = d * c[None, :, None]  # linear: megatron's [s, b, .]
        return dc.reshape(-1, dc.shape[-1]).T @ x.reshape(-1, x.shape[-1])

    def _check(self) -> None:
        n = self._all[0].rows if self._all else []
        for site in self._all:
            if site.rows != n:
                raise EssPatchRuntimeError(
                    f"PerTrajectoryGrads: module {site.name!r} saw micro-batches of {site.rows} "
                    f"trajectories, {self._all[0].name!r} {n}; every module must run on every "
                    "micro-batch"
                )
            missing = [k for k, p in enumerate(site.pieces) if p is None]
            if missing:
                raise EssPatchRuntimeError(
                    f"PerTrajectoryGrads: module {site.name!r} ran forward for micro-batches "
                    f"{missing} with no backward since start(); call sq_norms()/apply() after "
                    "the step's last backward"
                )

    def local_sq_norms(self) -> torch.Tensor:
        """``[N]`` squared norms over this rank's counted parameters (no collective)."""
        self._check()
        parts = []
        for site in self._all:
            for name, p in site.params.items():
                if not self._counted(p):
                    continue
                parts.append(
                    torch.cat([self._piece_sq(site.kind, pieces[name]) for pieces in site.pieces])
                    if site.pieces
                    else torch.zeros(0, dtype=_ACC)
                )
        if self._tied is not None and self._counted(self._tied[1].params["weight"]):
            emb, out = self._tied
            parts.append(
                2
                * torch.cat(
                    [
                        self._cross(e["weight"], o["weight"])
                        for e, o in zip(emb.pieces, out.pieces, strict=True)
                    ]
                )
            )
        if not parts:
            return torch.zeros(self.num_trajectories(), dtype=_ACC)
        return torch.stack(parts).sum(0)

    @staticmethod
    def _cross(e: _Piece, o: _Piece) -> torch.Tensor:
        """``[b]`` inner products ``<E_i, O_i>`` of a tied weight's two per-trajectory pieces:
        the embedding's (``ids [b, S]``, ``g [b, S, h]`` or ``[b, V, h]``) and the output
        layer's (``x [T, b, h]``, ``d [T, b, V]`` or ``[b, V, h]``), this rank's vocabulary
        rows. ``|E + O|^2 = |E|^2 + |O|^2 + 2 <E, O>``."""
        if e.full is not None and o.full is not None:
            return (e.full.flatten(1) * o.full.flatten(1)).sum(1)
        if e.full is None and o.full is not None:  # O_i[id_s] . g_s
            ids, g = e.x, e.delta
            rows = o.full.gather(1, ids[..., None].expand(-1, -1, o.full.shape[-1]))
            return (rows * g).sum((1, 2))
        x, d = o.x.transpose(0, 1), o.delta.transpose(0, 1)  # [b, T, h], [b, T, V]
        if e.full is not None:  # sum_t sum_v d_tv (E_v . x_t)
            return ((e.full @ x.transpose(1, 2)) * d.transpose(1, 2)).sum((1, 2))
        ids, g = e.x, e.delta  # sum_{t,s} d_t[id_s] (x_t . g_s)
        picked = d.gather(2, ids[:, None, :].expand(-1, d.shape[1], -1))
        return (picked * (x @ g.transpose(1, 2))).sum((1, 2))

    def sq_norms(self) -> torch.Tensor:
        """``[N]`` squared per-trajectory gradient norms over the whole model (TP and PP summed).

        A collective on the TP and PP groups: call it on every rank of them.
        """
        sq = self.local_sq_norms()
        for group in (self.tp_group, self.pp_group):
            if group is not None:
                dist.all_reduce(sq, group=group)
        return sq

    def apply(self, coeffs: torch.Tensor) -> None:
        """Set every parameter's gradient to ``sum_i coeffs[i] * (trajectory i's part)``.

        Writes ``param.main_grad`` (megatron DDP) where it exists, else ``param.grad``.
        ``coeffs``: ``[N]``, one per captured trajectory in micro-batch order.
        """
        self._check()
        c = torch.as_tensor(coeffs).flatten().to(_ACC)
        sizes = self._all[0].rows if self._all else []
        if sum(sizes) != c.numel():
            raise EssPatchValueError(
                f"PerTrajectoryGrads: {c.numel()} coefficients for {sum(sizes)} captured "
                "trajectories; give one per trajectory, in micro-batch order"
            )
        parts = c.split(sizes)
        grads: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        for site in self._all:  # a tied weight's pieces (embedding, output layer) add up
            for name, p in site.params.items():
                g = grads.setdefault(id(p), (p, torch.zeros(p.shape, dtype=_ACC, device=p.device)))[
                    1
                ]
                for pieces, ck in zip(site.pieces, parts, strict=True):
                    assert pieces is not None
                    g += self._piece_grad(site.kind, pieces[name], ck.to(g.device), p.shape)
        for p, g in grads.values():
            target = getattr(p, "main_grad", None)
            if target is not None:
                target.copy_(g.view_as(target))
            elif p.grad is not None:
                p.grad.copy_(g.view_as(p.grad))
            else:
                p.grad = g.to(p.dtype)
