"""VCPO's minimum-variance baseline in Megatron-RL (``--use-ess-baseline``): what it does to a
rollout collection. Imported only when the baseline is on (torch); the hooks and the parse-time
refusals are in ``megatron_rl``.

Megatron-RL (core_v0.16.1 to core_v0.18.2) builds GRPO's advantages once per collection, on
every rank and for the whole collection, in ``prepare_data_for_update`` ->
``compute_group_stats`` -> ``calculate_grpo_advantages(rewards, num_turns)``:
``(R_i - mean_g) / (1e-4 + std_g)`` over each group of ``grpo_group_size`` rollouts (the outer
list of ``rollouts``). Then it splits the flat rollouts over DP in equal consecutive shares and
computes the old log-probs of its share. So, on every rank:

1. :func:`begin` (before upstream's body): this DP rank's share of the rollouts (upstream's
   split), made into rows by upstream's own ``prepare_trajectories`` (on a copy: it pads the
   rollouts' masks in place); the norm pass of ``baseline_hook`` (``rewrite_rewards``: rules,
   exact or proxy, the model ``prepare_data_for_update`` was given) on one padded row per
   trajectory, whatever the training layout (sequence packing included: a trajectory's
   gradient does not depend on the bin it is packed in). The coefficients are the loss mask
   (generated, non-pad tokens) times, with ``--rl-inference-logprobs-is-correction``, the IS
   weight ``min(exp(old - inference), --rl-importance-sampling-truncation-coef)``, ``old`` the
   pass's own log-probs (the current policy's, which upstream's old log-probs are; the token
   the engine did not score, the appended eod, has weight 1 as upstream's). ``b*`` per group
   comes from ``group_baseline`` over DP (groups split over ranks are reduced), and every
   group's ``b*`` is gathered to every rank.
2. :func:`substitute` (inside ``calculate_grpo_advantages``): upstream's advantages ``A`` are
   read as ``k_g (R_i - mean_g)`` (``k_g`` is upstream's own normalisation, read from ``A``; a
   routine whose output is not of that form is refused) and become ``k_g (R_i - b*_g)``: the
   group mean replaced by ``b*``, upstream's std and its ``1e-4`` kept. Shadow mode returns
   ``A`` untouched.
3. :func:`check_applied` (in ``maybe_log_training_metrics``, before it logs): the advantages
   upstream holds (``group_stats.advantages``; packed, each bin's ``bin_advantages`` too) are
   the substituted ones, bit for bit, on every DP rank; else every rank stops with
   :class:`~ess_patch.guard.EssLrNotAppliedError`. :func:`finish` stops every rank where the
   routine never ran.

Refused at run time on every rank, by name: multi-turn rollouts (a rollout's gradient is the
sum over its turn rows; the norm pass takes one trajectory per row), groups of unequal size, a
collection that does not split evenly over DP (upstream drops the remainder from training).
"""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace
from typing import Any

import torch

from ..guard import EssLrNotAppliedError
from ..reduction import all_gather_rows, all_reduce_sum, group_size
from ..state import STATE
from .baseline_flags import baseline_mode, baseline_path
from .baseline_hook import rewrite_rewards

__all__ = ["begin", "check_applied", "finish", "substitute"]

logger = logging.getLogger(__name__)

NAME = "megatron_rl"


def _stop(problem: str | None, dp_group: Any, fix: str) -> None:
    """Every DP rank stops if any rank has a ``problem`` (one flag, summed over DP)."""
    flag = torch.tensor([float(problem is not None)], dtype=torch.float64)
    if group_size(dp_group, "DP") > 1:
        flag = all_reduce_sum(flag, dp_group)
    if float(flag) > 0:
        where = problem if problem is not None else "another DP rank could not take it"
        raise EssLrNotAppliedError(
            f"ess-patch ({NAME}): the VCPO baseline was requested but {where}, so the GRPO "
            f"advantages would keep the group mean. {fix}"
        )


def _rows(host: Any, share: list, tokenizer: Any) -> tuple[dict | None, str | None]:
    """This rank's rollouts as ``baseline_hook``'s rows (one per trajectory), or a problem."""
    from megatron.rl.rl_utils import prepare_trajectories  # upstream's rows, by name

    trajs, masks, inference = prepare_trajectories(
        copy.deepcopy(share), tokenizer, host.seq_length, False, host.rl_skip_bos_token
    )
    if trajs.shape[0] != len(share):
        return None, (
            f"{trajs.shape[0]} training rows come from {len(share)} rollouts (multi-turn "
            "rollouts: the norm pass takes one trajectory per row)"
        )
    pad = tokenizer.pad
    weighted = bool(getattr(host, "rl_inference_logprobs_is_correction", False)) and (
        inference is not None
    )
    data: dict = {k: [] for k in ("tokens", "response_lengths", "loss_masks")}
    data["rollout_log_probs"] = [] if weighted else None
    for i in range(trajs.shape[0]):
        mask = masks[i].bool()
        generated = mask.nonzero(as_tuple=True)[0]
        generated = generated[generated > 0]  # position 0 has no logit before it
        total = int(generated[-1]) + 1 if generated.numel() else 2
        first = int(generated[0]) if generated.numel() else total - 1
        tokens = trajs[i, :total].long()
        loss = (mask[first:total] & (tokens[first:] != pad)).float()
        data["tokens"].append(tokens)
        data["response_lengths"].append(total - first)
        data["loss_masks"].append(loss)
        if weighted:
            rlp = torch.full((total - first,), float("nan"), dtype=torch.float64)
            scored = inference[i]
            count = 0 if scored is None else min(len(scored), generated.numel())
            if count:
                rlp[generated[:count] - first] = torch.as_tensor(scored[:count]).double()
            data["rollout_log_probs"].append(rlp)
    data["log_probs_from_pass"] = True
    return data, None


def begin(host: Any, model: Any, rollouts: Any, tokenizer: Any, dp_group: Any) -> dict:
    """Step 1 of the module docstring; returns (and keeps in ``STATE.baseline``) the record
    :func:`substitute` and :func:`check_applied` read.

    Raises:
        EssLrNotAppliedError: on every rank, when any rank cannot serve this collection.
    """
    STATE.baseline = None  # nothing of the previous collection is logged if this one fails
    mode = baseline_mode(host)
    sizes = sorted({len(g) for g in rollouts})
    flat = [r for g in rollouts for r in g]
    dp = group_size(dp_group, "DP")
    problem = None
    if len(sizes) != 1 or sizes[0] < 2:
        problem = f"the collection's groups have sizes {sizes} (one size of at least 2 needed)"
    elif len(flat) % dp:
        problem = f"{len(flat)} rollouts do not split evenly over {dp} DP ranks"
    fix = "Drop --use-ess-baseline (or ESS_LR_BASELINE) for this run"
    rank = torch.distributed.get_rank(dp_group) if dp > 1 else 0
    share_size = len(flat) // dp
    data = None
    if problem is None:
        share = flat[rank * share_size : (rank + 1) * share_size]  # upstream's split
        data, problem = _rows(host, share, tokenizer)
    _stop(problem, dp_group, fix)
    n = sizes[0]
    data["rewards"] = [float(r.reward) for r in share]
    data["sample_indices"] = [(rank * share_size + j) // n for j in range(len(share))]
    coef = getattr(host, "rl_importance_sampling_truncation_coef", None)
    settings = SimpleNamespace(
        micro_batch_size=getattr(host, "micro_batch_size", 1),
        n_samples_per_prompt=1,  # sample_indices are the group ids already
        use_tis=coef is not None,
        tis_clip=coef,
        tis_clip_low=None,
        normalize_advantages=False,
        use_ess_baseline=mode == "on",
        ess_baseline_shadow=mode == "shadow",
        ess_baseline_path=baseline_path(host),
    )
    raw = torch.tensor(data["rewards"], dtype=torch.float64)
    lent = STATE.baseline_model
    STATE.baseline_model = model
    try:
        record = rewrite_rewards(NAME, settings, data, dp_group)
    finally:
        STATE.baseline_model = lent
    mine = raw - torch.tensor(record["expected"], dtype=torch.float64)  # b* of each rollout
    every = all_gather_rows(mine, dp_group, "DP").flatten() if dp > 1 else mine
    per_group = every.reshape(-1, n)
    record.update(
        b_star=per_group[:, 0].tolist(),
        group_size=n,
        pending=True,
        applied=None,
        checked=False,
    )
    if mode == "shadow":
        logger.info("ess-patch (%s): shadow b* per group %s", NAME, record["b_star"])
    STATE.baseline = record
    return record


def substitute(advantages: Any, rewards: Any, num_turns: Any, record: dict) -> Any:
    """Step 2: upstream's ``calculate_grpo_advantages`` output with ``b*`` for the group mean
    (shadow mode: unchanged). Marks the record applied.

    Raises:
        EssLrNotAppliedError: the output is not ``k_g (R - mean_g)`` per group, or its groups are
            not the collection the norms were taken on.
    """
    r = torch.tensor(rewards, dtype=torch.float64)
    turns = torch.tensor(num_turns)
    a = torch.tensor(list(advantages), dtype=torch.float64)
    b = torch.tensor(record["b_star"], dtype=torch.float64)
    fix = "Drop --use-ess-baseline, or report the Megatron-RL version this is"
    if r.dim() != 2 or r.shape[0] != b.numel() or r.shape[1] != record["group_size"]:
        raise EssLrNotAppliedError(
            f"ess-patch ({NAME}): calculate_grpo_advantages got rewards of shape "
            f"{tuple(r.shape)}; the baseline was taken on {b.numel()} groups of "
            f"{record['group_size']}. {fix}"
        )
    if bool((turns != 1).any()) or a.numel() != r.numel():
        raise EssLrNotAppliedError(
            f"ess-patch ({NAME}): calculate_grpo_advantages returned {a.numel()} advantages "
            f"for {r.numel()} rollouts (multi-turn rows). {fix}"
        )
    d = r - r.mean(1, keepdim=True)
    got = a.reshape(r.shape)
    j = d.abs().argmax(1, keepdim=True)
    top = d.gather(1, j)
    degenerate = top.abs().squeeze(1) <= 1e-12 * (1 + r.abs().amax(1))
    k = torch.where(degenerate[:, None], torch.zeros_like(top), got.gather(1, j) / top)
    affine = torch.isclose(got, k * d, rtol=1e-6, atol=1e-9) | degenerate[:, None]
    if not bool(affine.all()):
        g = int((~affine).any(1).nonzero()[0, 0])
        raise EssLrNotAppliedError(
            f"ess-patch ({NAME}): calculate_grpo_advantages' advantages of group {g} are not "
            f"(R - group mean) times one scale, so b* cannot replace the mean. {fix}"
        )
    new = torch.where(degenerate[:, None], got, k * (r - b[:, None])).flatten()
    applied = new.tolist() if record["mode"] == "on" else advantages
    record["applied"] = list(applied)
    record["pending"] = False
    return applied


def check_applied(group_stats: Any, record: dict, dp_group: Any) -> None:
    """Step 3, on every DP rank: ``group_stats.advantages`` and, packed, every bin's advantages
    are the substituted ones (shadow mode: nothing to check).

    Raises:
        EssLrNotAppliedError: on every rank, where any rank's are not.
    """
    if record["mode"] != "on":
        return
    problem = None
    held = getattr(group_stats, "advantages", None)
    if record["pending"]:
        problem = "calculate_grpo_advantages did not run in this collection"
    elif held is None or [float(x) for x in held] != [float(x) for x in record["applied"]]:
        problem = "group_stats.advantages are not the advantages with b* (r - b*)"
    else:
        from megatron.rl.rl_utils import get_rl_runtime_state

        context = getattr(get_rl_runtime_state(), "packing_context", None)
        bins = getattr(context, "bin_advantages", None)
        info = getattr(context, "packing_info", None)
        if bins is not None and info is not None:
            for b, seqs in enumerate(info.bin_seq_indices):
                if not seqs:
                    continue
                want = torch.tensor(record["applied"], dtype=bins[b].dtype)[list(seqs)]
                if not torch.equal(bins[b].detach().cpu(), want):
                    problem = f"packed bin {b}'s advantages are not r - b*"
                    break
    _stop(
        problem,
        dp_group,
        "The release did not build its training advantages from calculate_grpo_advantages; "
        "drop --use-ess-baseline",
    )
    record["checked"] = True
    record["metrics"]["ess_baseline_applied"] = 1.0


def finish(record: dict, dp_group: Any) -> None:
    """After ``prepare_data_for_update``: the baseline was applied and read back (shadow mode:
    computed), else every rank stops."""
    if record["mode"] == "on" and not record["checked"]:
        _stop(
            "its advantages were not read back (maybe_log_training_metrics did not run)",
            dp_group,
            "Drop --use-ess-baseline, or report the Megatron-RL version this is",
        )
    if record["pending"]:
        logger.warning(
            "ess-patch (%s): calculate_grpo_advantages did not run in this collection; shadow "
            "mode logs no b* for it",
            NAME,
        )
