"""The demo's "baseline" arms: VCPO's minimum-variance baseline inside megatron's schedule.

:class:`BaselineGlue` joins ``ess_patch.per_trajectory`` (per-trajectory gradients from the
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
loss with advantage ``R_i - b*``. The groups must lie within one DP rank (the demo's do). The
loss must be linear in each trajectory's coefficient: a KL or entropy term with a gradient would
be scaled by ``R_i - b*`` as well.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from ..baseline import NonFiniteBaselineInputError, min_variance_baseline
from ..errors import EssPatchRuntimeError, EssPatchValueError
from ..per_trajectory import PerTrajectoryGrads

__all__ = ["BaselineGlue", "proxy_advantages"]

logger = logging.getLogger(__name__)


class BaselineGlue:
    """VCPO's minimum-variance baseline for one arm of the demo (see the module docstring).

    Args:
        model: this rank's unwrapped ``GPTModel`` stage (its ``config`` is the one megatron's
            schedule reads ``finalize_model_grads_func`` from).
        ddp: megatron's ``DistributedDataParallel`` around it (the gradients written are its
            ``main_grad`` buffers); ``None`` for a model without DDP (``param.grad``).
        tp_group: the TP group (the norms are summed over it).
        pp_group: the PP group (the norms are summed over it).
        dp_group: only for ``metrics()`` (averaged over DP); groups never span DP ranks.

    Raises:
        ValueError: ``model.config.finalize_model_grads_func`` is not set yet (set it first).
        ess_patch.per_trajectory.UnsupportedModuleError: a parameter no rule covers.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        ddp: Any = None,
        *,
        tp_group: dist.ProcessGroup | None = None,
        pp_group: dist.ProcessGroup | None = None,
        dp_group: dist.ProcessGroup | None = None,
    ) -> None:
        config = model.config
        original = getattr(config, "finalize_model_grads_func", None)
        if original is None:
            raise EssPatchValueError(
                "BaselineGlue: model.config.finalize_model_grads_func is None; set it (megatron's "
                "finalize_model_grads) before building the glue, which wraps it"
            )
        if ddp is not None and getattr(ddp, "module", model) is not model:
            raise EssPatchValueError("BaselineGlue: ddp.module is not the model given")
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
        shapes that disagree or non-integer ids (nothing is started then). From here to the
        step's finalize the linear weights are frozen (see ``ess_patch.per_trajectory``);
        finalize or ``remove()`` unfreezes them.

        At the step's finalize, a wrong row count or a non-finite reward or norm on any rank
        raises on every rank (``RuntimeError`` / ``NonFiniteBaselineInputError``, with
        ``dp_group`` given) before any gradient is written.
        """
        r = torch.as_tensor(rewards).detach().flatten()
        ids = torch.as_tensor(group_ids).detach().flatten()
        if r.numel() != ids.numel():
            raise EssPatchValueError(
                f"BaselineGlue.begin: {r.numel()} rewards but {ids.numel()} group ids; give one "
                "of each per trajectory of this DP rank"
            )
        if ids.is_floating_point() or ids.is_complex():
            raise EssPatchValueError(
                "BaselineGlue.begin: group_ids must be integers (prompt-group ids)"
            )
        self._rewards, self._group_ids = r, ids
        self.grads.start()

    def _finalize(self, *args: Any, **kwargs: Any) -> Any:
        if self._rewards is None or self._group_ids is None:
            raise EssPatchRuntimeError(
                "BaselineGlue: a training step finished without begin(rewards, group_ids); the "
                "loss carries no advantage, so this gradient would be wrong. Call glue.begin() "
                "before forward_backward (or glue.remove() for an arm without the baseline)"
            )
        t0, c0 = time.perf_counter(), time.thread_time()
        self.grads.stop()
        n = self.grads.num_trajectories()
        sq = self._reduced_norms(n)
        res = min_variance_baseline(None, self._rewards.to(sq.device), sq, self._group_ids)
        self.grads.apply(res.advantages.to(torch.float32))
        held = self.grads.captured_bytes
        self.grads.clear()
        elapsed, cpu = time.perf_counter() - t0, time.thread_time() - c0
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
            "cpu_baseline_s": cpu,
            "captured_bytes": held,
        }
        self._rewards = self._group_ids = None
        return self._original(*args, **kwargs)

    def _reduced_norms(self, n: int) -> torch.Tensor:
        """The step's norms (TP and PP summed), or the same error on every rank.

        A fault only one rank can see (its row count, a non-finite reward or norm) travels as a
        flag inside the norms' own TP/PP all-reduce and one more all-reduce over DP, so that every
        rank raises the same error before any gradient is written, instead of leaving its peers
        waiting in megatron's DP all-reduce.
        """
        assert self._rewards is not None
        local = self.grads.local_sq_norms()
        rows_bad = n != self._rewards.numel()
        rewards_bad = not bool(torch.isfinite(self._rewards).all())
        flags = torch.tensor([float(rows_bad), float(rewards_bad)], device=local.device)
        packed = torch.cat([local.to(flags.dtype), flags])
        for group in (self.grads.tp_group, self.grads.pp_group):
            if group is not None:
                dist.all_reduce(packed, group=group)
        sq = packed[:-2]
        flags = torch.stack([packed[-2], packed[-1], (~torch.isfinite(sq)).any().to(flags.dtype)])
        if self.dp_group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.dp_group)
        rows_any, rewards_any, norms_any = (bool(f > 0) for f in flags)
        if rows_any:
            raise EssPatchRuntimeError(
                f"BaselineGlue: the step trained {n} trajectories on this rank but begin() got "
                f"{self._rewards.numel()} rewards"
                + ("" if rows_bad else " (on another rank: this rank's count was right)")
                + "; pass each DP rank's rewards in micro-batch order"
            )
        if rewards_any or norms_any:
            what = "a reward" if rewards_any else "a per-trajectory gradient norm"
            where = "this rank" if (rewards_bad if rewards_any else norms_any) else "another rank"
            raise NonFiniteBaselineInputError(
                f"BaselineGlue: {what} is not finite ({where}; every rank raises this); check the "
                "rewards and the loss (IS weights, log-probs) of this step"
            )
        return sq

    def metrics(self) -> dict[str, float]:
        """The last step's baseline metrics (DP-averaged): ``baseline_mean`` (mean b* over
        groups), ``adv_abs_mean`` (mean ``|R - b*|``), ``sq_norm_mean``, ``fallback_groups``
        (groups with all-zero norms), ``params_covered`` (fraction), ``num_params`` (this rank),
        ``time_baseline_s`` / ``cpu_baseline_s`` (this rank's norms + baseline + rewrite, wall /
        this thread's CPU time; the parts taken in the backward are not in it),
        ``captured_bytes`` (the deferral's memory on this rank)."""
        return dict(self._metrics)

    def remove(self) -> None:
        """Unhook the model and give back the original ``finalize_model_grads_func``."""
        if self._config.finalize_model_grads_func == self._finalize:
            self._config.finalize_model_grads_func = self._original
        self.grads.remove()
        self._rewards = self._group_ids = None


def proxy_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, float]:
    """The proxy arms' advantages ``R - b*`` of one micro-batch, ``[N, 1]``, and ``mean |b* -
    mean|`` over its groups.

    ``b*`` is :func:`ess_patch.proxy.proxy_baseline` on the response positions' ``logits``
    (``[N, T, V]``, the whole vocabulary), each token's proxy times its squared IS ``weight``
    (``[N, 1]`` or ``[N, T]``, as the loss weighs it). Forward-only: no hook, no backward.
    """
    from ..proxy import proxy_baseline

    with torch.no_grad():
        res = proxy_baseline(
            rewards.double(),
            group_ids,
            logits.detach(),
            tokens,
            token_weights=weight.detach().expand(tokens.shape),
        )
        adv = res.advantages.to(logits.dtype)[:, None]
        _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
        sums = torch.zeros(counts.numel(), dtype=torch.float64, device=rewards.device)
        mean = sums.index_add_(0, inverse, rewards.double()) / counts
        shift = float((res.baselines - mean).abs().mean())
    return adv, shift
