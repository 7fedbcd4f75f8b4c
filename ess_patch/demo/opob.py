"""The demo's "baseline" arms: VCPO's minimum-variance baseline inside megatron's schedule.

:class:`BaselineGlue` joins :mod:`ess_patch.per_trajectory` (per-trajectory gradients from the
training backward) and :func:`ess_patch.baseline.min_variance_baseline` to a megatron trainer
with two calls per step and no change to the schedule::

    glue = BaselineGlue(model, ddp, tp_group=tp, pp_group=pp, dp_group=dp)  # once per arm
    for step in ...:
        glue.begin(rewards, group_ids)       # this DP rank's N trajectories, micro-batch order
        forward_backward(...)                # loss with advantage 1 (see below)
        optimizer.step()
        log(glue.metrics())
    glue.remove()

The trainer's loss carries *no* advantage: per micro-batch the same IS-weighted loss as the
other arms with advantage 1, ``-(1/(N*T)) sum_i sum_t w_it * logp_it`` (``w`` detached). The
glue wraps ``model.config.finalize_model_grads_func``, which megatron's schedule calls once per
step on every rank after the last backward and before the optimizer; there, before the DP
all-reduce, it takes each trajectory's squared gradient norm (TP and PP summed), the baseline
``b*`` of each prompt group, and rewrites every parameter's gradient to the gradient of the
loss with advantage ``R_i - b*``. The groups must lie within one DP rank (the demo's do).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from ..baseline import min_variance_baseline
from ..per_trajectory import PerTrajectoryGrads

__all__ = ["BaselineGlue"]

logger = logging.getLogger(__name__)


class BaselineGlue:
    """VCPO's minimum-variance baseline for one arm of the demo (see the module docstring).

    Args:
        model: this rank's unwrapped ``GPTModel`` stage (its ``config`` is the one megatron's
            schedule reads ``finalize_model_grads_func`` from).
        ddp: megatron's ``DistributedDataParallel`` around it (the gradients written are its
            ``main_grad`` buffers); ``None`` for a model without DDP (``param.grad``).
        tp_group / pp_group: TP and PP groups (the norms are summed over them).
        dp_group: only for :meth:`metrics` (averaged over DP); groups never span DP ranks.

    Raises:
        ValueError: ``model.config.finalize_model_grads_func`` is not set yet (set it first).
        ess_patch.per_trajectory.UnsupportedModuleError: a parameter no rule covers.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        ddp: Any = None,
        *,
        tp_group: Any = None,
        pp_group: Any = None,
        dp_group: Any = None,
    ) -> None:
        config = model.config
        original = getattr(config, "finalize_model_grads_func", None)
        if original is None:
            raise ValueError(
                "BaselineGlue: model.config.finalize_model_grads_func is None; set it (megatron's "
                "finalize_model_grads) before building the glue, which wraps it"
            )
        if ddp is not None and getattr(ddp, "module", model) is not model:
            raise ValueError("BaselineGlue: ddp.module is not the model given")
        self.grads = PerTrajectoryGrads(model, tp_group=tp_group, pp_group=pp_group)
        several = dp_group is not None and dist.get_world_size(dp_group) > 1
        self.dp_group = dp_group if several else None
        self._config = config
        self._original = original
        self._rewards: torch.Tensor | None = None
        self._group_ids: torch.Tensor | None = None
        self._metrics: dict[str, float] = {}
        config.finalize_model_grads_func = self._finalize

    def begin(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
        """Start a step: this DP rank's rewards and prompt-group ids, in micro-batch order.

        Every TP and PP rank of the DP rank passes the same values. Raises ``ValueError`` on
        shapes that disagree (nothing is started then).
        """
        r = torch.as_tensor(rewards).detach().flatten()
        ids = torch.as_tensor(group_ids).detach().flatten()
        if r.numel() != ids.numel():
            raise ValueError(
                f"BaselineGlue.begin: {r.numel()} rewards but {ids.numel()} group ids; give one "
                "of each per trajectory of this DP rank"
            )
        self._rewards, self._group_ids = r, ids
        self.grads.start()

    def _finalize(self, *args: Any, **kwargs: Any) -> Any:
        if self._rewards is None or self._group_ids is None:
            raise RuntimeError(
                "BaselineGlue: a training step finished without begin(rewards, group_ids); the "
                "loss carries no advantage, so this gradient would be wrong. Call glue.begin() "
                "before forward_backward (or glue.remove() for an arm without the baseline)"
            )
        t0 = time.perf_counter()
        self.grads.stop()
        n = self.grads.num_trajectories()
        if n != self._rewards.numel():
            raise RuntimeError(
                f"BaselineGlue: the step trained {n} trajectories on this rank but begin() got "
                f"{self._rewards.numel()} rewards; pass this DP rank's rewards in micro-batch order"
            )
        sq = self.grads.sq_norms()
        res = min_variance_baseline(None, self._rewards.to(sq.device), sq, self._group_ids)
        self.grads.apply(res.advantages.to(torch.float32))
        held = self.grads.captured_bytes
        self.grads.start()  # frees the captures
        self.grads.stop()
        elapsed = time.perf_counter() - t0
        stats = torch.tensor(
            [
                float(res.baselines.sum()),
                float(res.baselines.numel()),
                float(res.advantages.abs().sum()),
                float(n),
                float(res.fallback_groups),
                float(sq.double().sum()),
            ],
            dtype=torch.float64,
            device=sq.device,
        )
        if self.dp_group is not None:
            dist.all_reduce(stats, group=self.dp_group)
        b_sum, groups, adv_sum, rows, fallback, sq_sum = stats.tolist()
        self._metrics = {
            "baseline_mean": b_sum / groups if groups else float("nan"),
            "adv_abs_mean": adv_sum / rows if rows else float("nan"),
            "sq_norm_mean": sq_sum / rows if rows else float("nan"),
            "fallback_groups": int(fallback),
            "params_covered": 1.0,  # every trainable parameter has a rule, or the build raised
            "num_params": self.grads.num_params,
            "time_baseline_s": elapsed,
            "captured_bytes": held,
        }
        self._rewards = self._group_ids = None
        return self._original(*args, **kwargs)

    def metrics(self) -> dict[str, float]:
        """The last step's baseline metrics (DP-averaged): ``baseline_mean`` (mean b* over
        groups), ``adv_abs_mean`` (mean ``|R - b*|``), ``sq_norm_mean``, ``fallback_groups``
        (groups with all-zero norms), ``params_covered`` (fraction), ``num_params`` (this rank),
        ``time_baseline_s`` (this rank's norms + baseline + rewrite), ``captured_bytes`` (the
        deferral's memory on this rank)."""
        return dict(self._metrics)

    def remove(self) -> None:
        """Unhook the model and give back the original ``finalize_model_grads_func``."""
        if self._config.finalize_model_grads_func == self._finalize:
            self._config.finalize_model_grads_func = self._original
        self.grads.remove()
        self._rewards = self._group_ids = None
