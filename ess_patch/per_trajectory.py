"""Per-trajectory gradients of a megatron-core ``GPTModel`` in the training backward.

:class:`PerTrajectoryGrads` hooks every module of a model that owns parameters. While
capturing, each module keeps its input (forward hook) and the gradient of its output (a
tensor hook, fired by the training backward itself), per micro-batch. Every parameter's
gradient is a sum over tokens of a product of those two, so after the backward:

* :meth:`~PerTrajectoryGrads.sq_norms` gives ``||grad of trajectory i's loss term||^2`` for
  every trajectory of this rank, summed over this rank's parameters, then over the tensor-
  parallel group (sharded parameters from every TP rank, replicated ones from TP rank 0 only)
  and over the pipeline group;
* :meth:`~PerTrajectoryGrads.apply` rewrites every parameter's gradient as
  ``sum_i c_i * (trajectory i's contribution)``: the backward is linear in each trajectory's
  loss coefficient, so this is exactly the gradient of the loss with coefficients ``c_i``
  (VCPO's ``R_i - b*``), with no second backward. The rewrite happens before the DP
  all-reduce (call it from ``finalize_model_grads``).

Supported modules (all of the demo's GPTModel, local spec, TP without sequence parallelism):
megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` (weight, bias; a gathered
output is sliced back to the rank's shard), ``torch.nn.LayerNorm`` / megatron's
``WrappedTorchNorm`` / ``FusedLayerNorm`` (weight, bias), ``VocabParallelEmbedding`` and
``torch.nn.Embedding`` (the learned positions). Layouts as megatron's: linear and norm
activations ``[s, b, h]``, embedding ids ``[b, s]``. A model with any other trainable
parameter is refused at construction (:class:`UnsupportedModuleError` names it).

Cost: per linear weight, the norms take ``min(T(d_in + d_out), d_in d_out)`` multiply-adds per
token (ghost norm or per-trajectory outer product, whichever is cheaper), and the rewrite one
weight-gradient matmul; autograd's own weight gradient is still computed and then
overwritten. Memory: every hooked module's input and output gradient for every micro-batch
of the step is held until :meth:`apply` (about one more copy of the step's activations).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PerTrajectoryGrads", "UnsupportedModuleError"]

logger = logging.getLogger(__name__)

_ACC = torch.float32
#: Largest per-trajectory materialised embedding gradient (elements) before the ghost norm.
_EMBED_MATERIALISE_MAX = 1 << 24


class UnsupportedModuleError(TypeError):
    """The model has a trainable parameter in a module kind with no per-trajectory rule."""


def _group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _kind(module: torch.nn.Module) -> str | None:
    name = type(module).__name__
    if name in ("ColumnParallelLinear", "RowParallelLinear"):
        return "linear"
    if isinstance(module, torch.nn.LayerNorm) or name in ("FusedLayerNorm", "WrappedTorchNorm"):
        if getattr(module, "normalization", "LayerNorm") != "LayerNorm":
            return None  # RMSNorm: no rule yet
        return "layernorm"
    if name == "VocabParallelEmbedding" or isinstance(module, torch.nn.Embedding):
        return "embedding"
    return None


@dataclass
class _Site:
    """One hooked module: its captures per micro-batch (forward order)."""

    name: str
    module: torch.nn.Module
    kind: str
    xs: list[torch.Tensor] = field(default_factory=list)
    deltas: list[torch.Tensor | None] = field(default_factory=list)

    def params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters(recurse=False) if p.requires_grad]


class PerTrajectoryGrads:
    """Hooks on ``model`` that give per-trajectory gradient norms and a reweighted gradient.

    Args:
        model: the (unwrapped) megatron ``GPTModel`` stage of this rank, or any module whose
            trainable parameters all sit in supported modules.
        tp_group / pp_group: the tensor- / pipeline-parallel groups (``None`` or one rank: no
            collective).

    Raises:
        UnsupportedModuleError: a trainable parameter sits in an unsupported module (named).
    """

    def __init__(self, model: torch.nn.Module, *, tp_group: Any = None, pp_group: Any = None):
        self.tp_group = tp_group if _group_size(tp_group) > 1 else None
        self.pp_group = pp_group if _group_size(pp_group) > 1 else None
        self.tp_rank = dist.get_rank(self.tp_group) if self.tp_group is not None else 0
        self.tp_size = _group_size(self.tp_group)
        self._sites: list[_Site] = []
        unsupported = []
        for name, module in model.named_modules():
            own = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            kind = _kind(module)
            if kind is None:
                unsupported.append(f"{name or '<root>'} ({type(module).__name__})")
                continue
            self._sites.append(_Site(name, module, kind))
        if unsupported:
            raise UnsupportedModuleError(
                "PerTrajectoryGrads: no per-trajectory gradient rule for the parameters of "
                + ", ".join(unsupported)
                + "; supported: megatron Column/RowParallelLinear, LayerNorm, "
                "VocabParallelEmbedding, torch LayerNorm/Embedding"
            )
        self.num_params = sum(p.numel() for s in self._sites for _, p in s.params())
        self._capturing = False
        self._handles = [s.module.register_forward_hook(self._forward_hook(s)) for s in self._sites]

    # ---------------------------------------------------------------- capture
    def _forward_hook(self, site: _Site):
        def hook(module: torch.nn.Module, inputs: tuple, output: Any) -> None:
            if not self._capturing or not torch.is_grad_enabled():
                return
            out = output[0] if isinstance(output, tuple) else output
            if not out.requires_grad:
                return
            k = len(site.xs)
            site.xs.append(inputs[0].detach())
            site.deltas.append(None)

            def grad_hook(grad: torch.Tensor) -> None:
                site.deltas[k] = grad.detach()

            out.register_hook(grad_hook)

        return hook

    def start(self) -> None:
        """Drop earlier captures and capture the next forward/backward passes (with grad)."""
        for s in self._sites:
            s.xs.clear()
            s.deltas.clear()
        self._capturing = True

    def stop(self) -> None:
        """Stop capturing (the captures stay until :meth:`start` or :meth:`remove`)."""
        self._capturing = False

    def remove(self) -> None:
        """Remove the hooks and free the captures."""
        self.stop()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for s in self._sites:
            s.xs.clear()
            s.deltas.clear()

    @property
    def captured_bytes(self) -> int:
        """Memory held by the captures now (inputs and output gradients)."""
        return sum(
            t.numel() * t.element_size()
            for s in self._sites
            for t in (*s.xs, *s.deltas)
            if t is not None
        )

    def num_trajectories(self) -> int:
        """Trajectories captured since :meth:`start` (rows of every micro-batch)."""
        if not self._sites:
            return 0
        s = self._sites[0]
        return sum(self._rows(s, x) for x in s.xs)

    # ---------------------------------------------------------------- per site
    @staticmethod
    def _rows(site: _Site, x: torch.Tensor) -> int:
        return x.shape[0] if site.kind == "embedding" else x.shape[1]

    def _pairs(self, site: _Site):
        """``(x, delta)`` per micro-batch as ``[b, s, ...]``, float32, delta sliced to the shard."""
        if any(d is None for d in site.deltas):
            missing = [k for k, d in enumerate(site.deltas) if d is None]
            raise RuntimeError(
                f"PerTrajectoryGrads: module {site.name!r} ran forward for micro-batches "
                f"{missing} with no backward since start(); call sq_norms()/apply() after the "
                "step's last backward"
            )
        for x, d in zip(site.xs, site.deltas, strict=True):
            if site.kind == "embedding":
                yield x, d.to(_ACC)
                continue
            x, d = x.transpose(0, 1).to(_ACC), d.transpose(0, 1).to(_ACC)
            if site.kind == "linear":
                out_local = site.module.weight.shape[0]
                if d.shape[-1] != out_local:  # gathered output (gather_output / runtime gather)
                    d = d.narrow(-1, self.tp_rank * out_local, out_local)
            yield x, d

    def _counted(self, p: torch.nn.Parameter) -> bool:
        """Sharded parameters count on every TP rank, replicated ones on TP rank 0 only."""
        return self.tp_rank == 0 or bool(getattr(p, "tensor_model_parallel", False))

    def _site_sq(self, site: _Site) -> list[torch.Tensor]:
        """Per micro-batch ``[b]`` squared norms of this site's counted parameters."""
        m = site.module
        out = []
        for x, d in self._pairs(site):
            sq = torch.zeros(x.shape[0], dtype=_ACC, device=x.device)
            if site.kind == "linear":
                if self._counted(m.weight):
                    t, din, dout = x.shape[1], x.shape[2], d.shape[2]
                    if t * (din + dout) < din * dout:  # ghost norm: <x_s,x_t><d_s,d_t>
                        sq = sq + ((x @ x.transpose(1, 2)) * (d @ d.transpose(1, 2))).sum((1, 2))
                    else:
                        sq = sq + (d.transpose(1, 2) @ x).square().sum((1, 2))
                bias = getattr(m, "bias", None)
                if (
                    isinstance(bias, torch.nn.Parameter)
                    and bias.requires_grad
                    and self._counted(bias)
                ):
                    sq = sq + d.sum(1).square().sum(1)
            elif site.kind == "layernorm":
                xhat = self._normalised(m, x)
                if self._counted(m.weight):
                    sq = sq + (d * xhat).sum(1).square().sum(1)
                bias = getattr(m, "bias", None)
                if (
                    isinstance(bias, torch.nn.Parameter)
                    and bias.requires_grad
                    and self._counted(bias)
                ):
                    sq = sq + d.sum(1).square().sum(1)
            else:
                if self._counted(m.weight):
                    sq = sq + self._embedding_sq(m, x, d)
            out.append(sq)
        return out

    @staticmethod
    def _normalised(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        eps = getattr(m, "eps", 1e-5)
        shape = tuple(m.weight.shape)
        return torch.nn.functional.layer_norm(x, shape, None, None, eps)

    @staticmethod
    def _local_ids(m: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the embedding table for ``ids`` and the mask of ids it holds."""
        lo = getattr(m, "vocab_start_index", 0)
        hi = getattr(m, "vocab_end_index", m.weight.shape[0])
        keep = (ids >= lo) & (ids < hi)
        return torch.where(keep, ids - lo, torch.zeros_like(ids)), keep

    def _embedding_sq(self, m: torch.nn.Module, ids: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        local, keep = self._local_ids(m, ids)
        d = d * keep[..., None]
        b, s, h = d.shape
        rows = m.weight.shape[0]
        if b * rows * h <= _EMBED_MATERIALISE_MAX:
            index = (torch.arange(b, device=d.device)[:, None] * rows + local).flatten()
            g = torch.zeros(b * rows, h, dtype=_ACC, device=d.device)
            g.index_add_(0, index, d.reshape(b * s, h))
            return g.view(b, rows * h).square().sum(1)
        same = (local[:, :, None] == local[:, None, :]) & keep[:, :, None] & keep[:, None, :]
        return ((d @ d.transpose(1, 2)) * same).sum((1, 2))

    def _site_grads(self, site: _Site, coeffs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The site's parameter gradients with trajectory coefficients (per micro-batch)."""
        m = site.module
        grads: dict[str, torch.Tensor] = {}

        def add(name: str, g: torch.Tensor) -> None:
            grads[name] = grads[name] + g if name in grads else g

        for (x, d), c in zip(self._pairs(site), coeffs, strict=True):
            dc = d * c.to(_ACC)[:, None, None]
            if site.kind == "linear":
                add("weight", dc.reshape(-1, dc.shape[-1]).T @ x.reshape(-1, x.shape[-1]))
                add("bias", dc.sum((0, 1)))
            elif site.kind == "layernorm":
                add("weight", (dc * self._normalised(m, x)).sum((0, 1)))
                add("bias", dc.sum((0, 1)))
            else:
                local, keep = self._local_ids(m, x)
                g = torch.zeros(m.weight.shape, dtype=_ACC, device=d.device)
                g.index_add_(0, local.flatten(), (dc * keep[..., None]).reshape(-1, dc.shape[-1]))
                add("weight", g)
        return grads

    # ---------------------------------------------------------------- results
    def _split(self, values: torch.Tensor) -> list[torch.Tensor]:
        sizes = [self._rows(self._sites[0], x) for x in self._sites[0].xs] if self._sites else []
        if sum(sizes) != values.numel():
            raise ValueError(
                f"PerTrajectoryGrads: {values.numel()} coefficients for {sum(sizes)} captured "
                "trajectories; give one per trajectory, in micro-batch order"
            )
        return list(values.split(sizes))

    def local_sq_norms(self) -> torch.Tensor:
        """``[N]`` squared norms over this rank's counted parameters (no collective)."""
        n = self.num_trajectories()
        if not self._sites:
            return torch.zeros(0, dtype=_ACC)
        total = None
        for site in self._sites:
            mine = self._site_sq(site)
            if [t.numel() for t in mine] != [self._rows(site, x) for x in site.xs] or (
                sum(t.numel() for t in mine) != n
            ):
                raise RuntimeError(
                    f"PerTrajectoryGrads: module {site.name!r} saw another set of micro-batches "
                    "than the first module; every module must run on every micro-batch"
                )
            flat = torch.cat(mine) if mine else torch.zeros(0, dtype=_ACC)
            total = flat if total is None else total + flat
        assert total is not None
        return total

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
        parts = self._split(torch.as_tensor(coeffs).flatten())
        for site in self._sites:
            grads = self._site_grads(site, parts)
            for name, p in site.params():
                g = grads.get(name)
                if g is None:
                    g = torch.zeros_like(p, dtype=_ACC)
                target = getattr(p, "main_grad", None)
                if target is not None:
                    target.copy_(g.view_as(target))
                elif p.grad is not None:
                    p.grad.copy_(g.view_as(p.grad))
                else:
                    p.grad = g.to(p.dtype).view_as(p).clone()
