"""VCPO's minimum-variance baseline in miles and slime: ``--use-ess-baseline``.

What it does to a rollout, on every train rank, inside the advantage hook and before the
framework's own ``compute_advantages_and_returns`` runs:

1. The norm pass (``ess_patch.norm_pass``) over this rank's samples, with the model the train
   actor holds (``MegatronTrainRayActor.train_actor`` lends ``self.model`` for the call): the
   squared norm of ``grad sum_t w_t log p(y_t)`` per sample, ``w_t`` the token's IS weight
   ``exp(log_probs - rollout_log_probs)`` (clipped as ``--use-tis`` clips), 1 without rollout
   log-probs. No weight gradient is computed and nothing the step uses changes, so every loss
   the framework runs (PPO clipping, KL, entropy, TIS/ICEPOP) stays as it is. With
   ``--ess-baseline-path proxy`` the pass is one forward without grad and the forward-only
   proxy of ``ess_patch.proxy`` (``sum_t w_t^2 ||onehot(y_t) - p_t||^2``, verl's Optimal Token
   Baseline) stands in for the norms.
2. Groups: ``sample_indices // --n-samples-per-prompt`` (the data source numbers a prompt's
   ``n`` samples consecutively, which is also how the rollout manager's group mean groups them).
   Groups split over DP ranks are reduced over DP (``group_baseline``).
3. ``rollout_data["rewards"]`` (already group-normalised by the rollout manager) becomes
   ``r_i - b*_g(r)``. ``b*`` is a weighted mean, so ``b*(r - mean) = b*(R) - mean`` and
   ``b*((R - mean) / std) = (b*(R) - mean) / std``: the advantage GRPO computes from it is
   ``(R_i - b*(R)) / std``, the group mean replaced by ``b*`` and the std kept.
4. After the framework's routine: every sample's advantage is read back; one that is not
   ``r_i - b*`` (a custom advantage function, another estimator) stops the run on every DP
   rank with :class:`~ess_patch.guard.EssLrNotAppliedError`.

Pipeline parallelism: every stage runs the pass together
(``ess_patch.pipeline_pass``: activations down, gradients back, point to point) and ends with
the whole model's norms, so every stage's DP group computes the same ``b*``; the framework
builds the advantages on the last stage, whose read-back stops every stage. Tied embeddings
over stages are refused by name.

Shadow mode (``--ess-baseline-shadow`` / ``ESS_LR_BASELINE_SHADOW=1``) runs 1-2 and logs, but
leaves the rewards alone. Metrics (``train/``): ``ess_baseline_shift`` (mean over groups of
``b*`` minus the group mean, in the units of the normalised reward), ``ess_baseline_abs_shift``,
``ess_baseline_fallback_groups``, ``ess_baseline_split_groups``, ``ess_baseline_norm_pass_s``,
and ``ess_baseline_applied`` (1 applied and read back, 0 shadow).

Refused at parse time, by name: an estimator other than grpo / gspo / cispo (the group mean is
theirs), ``--disable-rewards-normalization`` (no group baseline to replace), context
parallelism (the norm pass runs on whole sequences) and virtual pipelines (one model chunk),
``--n-samples-per-prompt 1``, a training backend other than Megatron (miles' FSDP).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..group_baseline import dp_min_variance_baseline
from ..guard import EssLrNotAppliedError
from ..norm_pass import norm_pass
from ..proxy import proxy_sq_norms
from ..state import STATE
from .baseline_flags import baseline_mode, baseline_path

__all__ = ["check_applied", "rewrite_rewards"]


def _chunk(framework: str) -> torch.nn.Module:
    model = STATE.baseline_model
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise EssLrNotAppliedError(
                f"ess-patch ({framework}): the VCPO baseline was requested and the train "
                f"actor holds {len(model)} model chunks; the norm pass runs one. Drop "
                "--use-ess-baseline or the virtual pipeline"
            )
        model = model[0]
    if not isinstance(model, torch.nn.Module):
        raise EssLrNotAppliedError(
            f"ess-patch ({framework}): the VCPO baseline was requested but the advantage "
            "routine ran outside MegatronTrainRayActor.train_actor (no model to take the "
            "norms with), so the advantages would keep the group mean. Install ess-patch in "
            "the train actor (ESS_PATCH_AUTO_INSTALL=1) or drop --use-ess-baseline"
        )
    # the GPTModel inside megatron's wrappers (DDP, Float16Module: each holds it as .module):
    # its own attributes say the layout (tied embeddings, pre/post process) and it takes the
    # previous stage's activation (set_input_tensor); the wrappers add nothing the pass needs
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def _tp_group() -> Any:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    return group if parallel_state.get_tensor_model_parallel_world_size() > 1 else None


def _token_logp(logits: torch.Tensor, targets: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """``log p(target)`` from (vocabulary-parallel) logits, differentiable, no in-place op."""
    logits = logits.float()
    top = logits.detach().amax(-1, keepdim=True)
    if tp_group is None:
        shifted = logits - top
        lse = shifted.exp().sum(-1).log()
        picked = shifted.gather(-1, targets[..., None]).squeeze(-1)
        return picked - lse
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - top
    width = logits.shape[-1]
    start = dist.get_rank(tp_group) * width
    local = targets - start
    inside = (local >= 0) & (local < width)
    picked = shifted.gather(-1, local.clamp(0, width - 1)[..., None]).squeeze(-1)
    picked = reduce_from_tensor_model_parallel_region(torch.where(inside, picked, 0.0))
    total = reduce_from_tensor_model_parallel_region(shifted.exp().sum(-1))
    return picked - total.log()


def _weights(
    host_args: Any, rollout_data: dict, i: int, own: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Sample ``i``'s per-token IS weight, or None (no rollout log-probs). With
    ``rollout_data["log_probs_from_pass"]`` (Megatron-RL: its old log-probs are computed after
    the advantages), the train log-probs are the pass's own, ``own`` (detached), and a NaN
    rollout log-prob marks a token the engine did not score (weight 1, as upstream's)."""
    rollout = rollout_data.get("rollout_log_probs")
    train = rollout_data.get("log_probs")
    if rollout and rollout_data.get("log_probs_from_pass") and own is not None:
        r = torch.as_tensor(rollout[i]).double().to(own.device)
        w = torch.where(torch.isnan(r), torch.ones_like(r), torch.exp(own.double() - r))
    elif not rollout or not train:
        return None
    else:
        w = torch.exp(torch.as_tensor(train[i]).double() - torch.as_tensor(rollout[i]).double())
    if getattr(host_args, "use_tis", False):
        high = getattr(host_args, "tis_clip", None)
        low = getattr(host_args, "tis_clip_low", None)
        w = w.clamp(min=low or 0.0, max=high if high is not None else float("inf"))
    return w


def _padded(model: torch.nn.Module, rollout_data: dict, rows: list[int]):
    """``rows``' tokens as one padded ``[b, s]`` batch on the model's device, and the forward."""
    device = next(model.parameters()).device
    tokens = [torch.as_tensor(rollout_data["tokens"][i]).long() for i in rows]
    width = max(t.numel() for t in tokens)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for k, t in enumerate(tokens):
        ids[k, : t.numel()] = t
    ids = ids.to(device)

    def forward() -> torch.Tensor:
        pos = torch.arange(width, device=device)[None].expand(len(rows), -1)
        # by keyword, as the frameworks call it (megatron's GPTModel takes these names)
        return model(input_ids=ids, position_ids=pos, attention_mask=None)  # [b, s, V/tp]

    return ids, forward


def _response(rollout_data: dict, i: int) -> tuple[slice, slice]:
    """Sample ``i``'s response: the positions of its logits and of its targets in its row."""
    total = torch.as_tensor(rollout_data["tokens"][i]).numel()
    resp = int(rollout_data["response_lengths"][i])
    return slice(total - resp - 1, total - 1), slice(total - resp, total)


def _coefficients(
    host_args: Any, rollout_data: dict, i: int, device: Any, own: torch.Tensor | None = None
) -> tuple:
    """Sample ``i``'s per-token loss mask and IS weight (``None``: no rollout log-probs);
    ``own``: the pass's detached log-probs (see :func:`_weights`)."""
    mask = torch.as_tensor(rollout_data["loss_masks"][i], device=device).float()
    w = _weights(host_args, rollout_data, i, own)
    return mask, (None if w is None else w.to(device, torch.float32))


def _terms_from(logits: torch.Tensor, ids, host_args: Any, rollout_data: dict, rows: list[int]):
    """``sum_t w_t log p(y_t)`` per sample of ``rows`` from the model's ``[b, s, V/tp]``."""
    tp_group = _tp_group()
    out = []
    for k, i in enumerate(rows):
        at, target = _response(rollout_data, i)
        lp = _token_logp(logits[k, at], ids[k, target], tp_group)
        mask, w = _coefficients(host_args, rollout_data, i, lp.device, lp.detach())
        out.append(((mask if w is None else mask * w) * lp).sum())
    return torch.stack(out)


def _terms_fn(model: torch.nn.Module, host_args: Any, rollout_data: dict, rows: list[int]):
    """The norm pass's forward for ``rows``: ``sum_t w_t log p(y_t)`` per sample, padded rows."""
    ids, forward = _padded(model, rollout_data, rows)
    return lambda: _terms_from(forward(), ids, host_args, rollout_data, rows)


def _proxy_from(logits: torch.Tensor, ids, host_args: Any, rollout_data: dict, rows: list[int]):
    """The forward-only proxy of ``rows``' squared norms from the model's logits:
    ``sum_t w_t^2 ||onehot - p||^2`` (``ess_patch.proxy``); TP-reduced inside."""
    tp_group = _tp_group()
    start = 0 if tp_group is None else torch.distributed.get_rank(tp_group) * logits.shape[-1]
    out = []
    for k, i in enumerate(rows):
        at, target = _response(rollout_data, i)
        own = None
        if rollout_data.get("log_probs_from_pass"):
            with torch.no_grad():
                own = _token_logp(logits[k, at], ids[k, target], tp_group)
        mask, w = _coefficients(host_args, rollout_data, i, logits.device, own)
        sq = proxy_sq_norms(
            logits[k, at][None],
            ids[k, target][None],
            mask[None],
            token_weights=None if w is None else w[None],
            tp_group=tp_group,
            vocab_start=start,
        )
        out.append(sq.double())
    return torch.cat(out)


def _proxy_sq(model: torch.nn.Module, host_args: Any, rollout_data: dict, rows: list[int]):
    """The proxy from one forward without grad."""
    ids, forward = _padded(model, rollout_data, rows)
    with torch.no_grad():
        logits = forward()
    return _proxy_from(logits, ids, host_args, rollout_data, rows)


def _chunk_norms(
    model: torch.nn.Module, host_args: Any, rollout_data: dict, rows: list[int], path: str
) -> tuple[torch.Tensor, float]:
    """One micro-batch's squared norms and the pass's time, on one stage's whole model."""
    if path == "proxy":
        t0 = time.perf_counter()
        sq = _proxy_sq(model, host_args, rollout_data, rows).cpu()
        return sq, time.perf_counter() - t0
    res = norm_pass(
        model, _terms_fn(model, host_args, rollout_data, rows), tp_group=_tp_group(), path=path
    )
    return res.sq_norms.cpu(), res.seconds


def _norms(framework: str, host_args: Any, rollout_data: dict) -> tuple[torch.Tensor, float]:
    model = _chunk(framework)
    n = len(rollout_data["rewards"])
    size = max(1, int(getattr(host_args, "micro_batch_size", 1) or 1))
    sq, seconds = [], 0.0
    was_training = model.training
    model.eval()  # no dropout: the norms of the policy the step differentiates
    path = baseline_path(host_args)
    pipelined = _pp_size() > 1
    try:
        for start in range(0, n, size):
            rows = list(range(start, min(n, start + size)))
            if pipelined:
                part, took = _stage_norms(model, host_args, rollout_data, rows, path)
            else:
                part, took = _chunk_norms(model, host_args, rollout_data, rows, path)
            sq.append(part)
            seconds += took
    finally:
        model.train(was_training)
    return (torch.cat(sq) if sq else torch.zeros(0, dtype=torch.float64)), seconds


# --- pipeline parallelism: the pass crosses the stages ---------------------------------------


def _pp_size() -> int:
    """Pipeline stages (1 where megatron's parallel_state is not set up)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_pipeline_model_parallel_world_size()


def _pp_group() -> Any:
    """The pipeline group, or None (one stage)."""
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group() if _pp_size() > 1 else None


def _is_last_stage() -> bool:
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage()


def _stage(model: torch.nn.Module, width: int, rows: int) -> Any:
    """This rank's :class:`~ess_patch.pipeline_pass.Stage` (megatron's ``[s, b, h]``)."""
    from megatron.core import parallel_state as ps

    from ..pipeline_pass import Stage

    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    return Stage(
        group=ps.get_pipeline_model_parallel_group(),
        prev=None if first else ps.get_pipeline_model_parallel_prev_rank(),
        next=None if last else ps.get_pipeline_model_parallel_next_rank(),
        shape=(width, rows, int(model.config.hidden_size)),
        index=ps.get_pipeline_model_parallel_rank(),
    )


def _stage_norms(
    model: torch.nn.Module, host_args: Any, rollout_data: dict, rows: list[int], path: str
) -> tuple[torch.Tensor, float]:
    """:func:`_chunk_norms` over the pipeline: every stage runs it and ends with the whole
    model's norms (the proxy's, from the last stage's logits, sent to every stage)."""
    import torch.distributed as dist

    from ..pipeline_pass import pipelined_forward, pipelined_norm_pass

    ids, forward = _padded(model, rollout_data, rows)

    def stage_forward(x: torch.Tensor | None) -> torch.Tensor:
        if x is not None:
            model.set_input_tensor(x)
        return forward()

    stage = _stage(model, ids.shape[1], len(rows))
    if path != "proxy":
        res = pipelined_norm_pass(
            model,
            stage_forward,
            lambda logits: _terms_from(logits, ids, host_args, rollout_data, rows),
            stage,
            tp_group=_tp_group(),
            path=path,
        )
        return res.sq_norms.cpu(), res.seconds
    t0 = time.perf_counter()
    sq = torch.zeros(len(rows), dtype=torch.float64, device=ids.device)
    error = None
    try:
        dtype = next(model.parameters()).dtype
        logits = pipelined_forward(stage_forward, stage, device=ids.device, dtype=dtype)
        if logits is not None:
            sq = _proxy_from(logits, ids, host_args, rollout_data, rows).to(ids.device)
    except Exception as exc:  # every stage still joins the sum, which carries the failure
        error = exc
        sq = torch.full_like(sq, float("nan"))
    dist.all_reduce(sq, group=stage.group)  # the last stage's, on every stage
    if error is not None:
        raise error
    if not bool(torch.isfinite(sq).all()):
        raise EssLrNotAppliedError(
            f"ess-patch: the forward-only proxy is not finite on pipeline stage {stage.index}: "
            "another stage failed (its own error is in its log) or the logits are not finite"
        )
    return sq.cpu(), time.perf_counter() - t0


def _group_ids(framework: str, host_args: Any, rollout_data: dict) -> torch.Tensor:
    indices = rollout_data.get("sample_indices")
    if indices is None or len(indices) != len(rollout_data["rewards"]):
        raise EssLrNotAppliedError(
            f"ess-patch ({framework}): the VCPO baseline was requested but rollout_data has "
            "no 'sample_indices' for every sample (its prompt groups are unknown), so the "
            "advantages would keep the group mean. Drop --use-ess-baseline"
        )
    return torch.as_tensor(list(indices), dtype=torch.long) // int(host_args.n_samples_per_prompt)


def rewrite_rewards(framework: str, host_args: Any, rollout_data: dict, dp_group: Any) -> dict:
    """Steps 1-3 of the module docstring on this rank's ``rollout_data``; returns the record
    :func:`check_applied` reads (and the metrics)."""
    STATE.baseline = None  # nothing of the previous rollout is logged if this one fails
    mode = baseline_mode(host_args)
    rewards = torch.as_tensor(list(rollout_data["rewards"]), dtype=torch.float64)
    ids = _group_ids(framework, host_args, rollout_data)
    sq, seconds = _norms(framework, host_args, rollout_data)
    res = dp_min_variance_baseline(rewards, ids, sq, dp_group=dp_group)
    record = {
        "mode": mode,
        "expected": res.advantages.tolist(),
        "metrics": {
            "ess_baseline_shift": res.shift,
            "ess_baseline_abs_shift": res.abs_shift,
            "ess_baseline_fallback_groups": float(res.fallback_groups),
            "ess_baseline_split_groups": float(res.split_groups),
            "ess_baseline_norm_pass_s": seconds,
            "ess_baseline_applied": 0.0,
        },
    }
    if mode == "on":
        original = rollout_data["rewards"]
        new = res.advantages.tolist()
        rollout_data["rewards"] = (
            torch.tensor(new, dtype=original.dtype, device=original.device)
            if isinstance(original, torch.Tensor)
            else new
        )
    STATE.baseline = record
    return record


def _mismatch(host_args: Any, rollout_data: dict, expected: list[float]) -> int:
    """The first local sample whose advantage is not ``r_i - b*`` (or, with
    ``--normalize-advantages``, not one positive affine image of them all: the whitening over
    DP), or -1."""
    values = []
    for i in range(len(expected)):
        adv = torch.as_tensor(rollout_data["advantages"][i]).double().flatten()
        if adv.numel() == 0:
            values.append(None)
            continue
        v = adv.mean()
        if not torch.allclose(adv, v.expand_as(adv), rtol=1e-5, atol=1e-6):
            return i  # not one value per sample: not a baseline-shifted reward
        values.append(float(v))
    rows = [i for i, v in enumerate(values) if v is not None]
    if not rows:
        return -1
    x = torch.tensor([expected[i] for i in rows], dtype=torch.float64)
    y = torch.tensor([values[i] for i in rows], dtype=torch.float64)
    if getattr(host_args, "normalize_advantages", False) and x.numel() > 1 and x.std() > 0:
        a = float(((x - x.mean()) * (y - y.mean())).sum() / (x - x.mean()).square().sum())
        if a <= 0:
            return rows[0]
        x = a * x + float(y.mean() - a * x.mean())
    elif getattr(host_args, "normalize_advantages", False):
        x = x - x.mean() + y.mean()  # one value (or none) to whiten: only the offset is known
    off = ~torch.isclose(y, x, rtol=1e-4, atol=1e-5)
    return rows[int(off.nonzero()[0, 0])] if bool(off.any()) else -1


def check_applied(
    framework: str,
    host_args: Any,
    rollout_data: dict,
    record: dict,
    dp_group: Any,
    *,
    fix: str = "Drop --use-ess-baseline or use grpo / gspo / cispo",
) -> None:
    """Step 4: every sample's advantage is ``r_i - b*`` (float32 tolerance), on every DP rank;
    ``fix`` ends the error (the framework's own setting names)."""
    if record["mode"] != "on":
        return
    import torch.distributed as dist

    from ..reduction import all_reduce_sum

    pp_group = _pp_group()
    # the framework's routine builds advantages on the last pipeline stage (the earlier ones
    # have no log-probs and return early): every stage that has them is checked
    here = pp_group is None or _is_last_stage() or "advantages" in rollout_data
    bad = _mismatch(host_args, rollout_data, record["expected"]) if here else -1
    flag = torch.tensor([float(bad >= 0)], dtype=torch.float64)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        flag = all_reduce_sum(flag, dp_group)
    if pp_group is not None:  # the earlier stages stop with the last
        flag = all_reduce_sum(flag, pp_group)
    if float(flag) > 0:
        where = f"sample {bad} of this rank" if bad >= 0 else "another DP rank or stage"
        raise EssLrNotAppliedError(
            f"ess-patch ({framework}): the VCPO baseline was requested but the advantages of "
            f"{where} are not the rewritten rewards (r - b*): the advantage routine did not "
            f"take them (a custom advantage function, another estimator). {fix}"
        )
    record["metrics"]["ess_baseline_applied"] = 1.0
