"""VCPO's minimum-variance baseline in verl's legacy Megatron actor (``MegatronPPOActor``).

verl computes GRPO's advantage in the driver (``compute_grpo_outcome_advantage``: per prompt
group ``uid``, ``A_i = (R_i - mean) / (std + eps)`` on every response token) and hands the
actor this DP rank's chunk. ``make_minibatch_iterator(data)`` (wrapped in ``verl.py``) is the
first place where the model and the chunk meet, before any mini-batch is drawn; there, on every
DP rank, :func:`rewrite` does what ``baseline_hook`` does for miles and slime, with the same
package code:

1. refuses, by name, what the pass cannot serve: context parallelism, several model chunks
   (virtual pipeline), a sampling temperature other than 1, no ``uid`` (pipeline stages run the
   pass together: ``ess_patch.pipeline_pass``);
2. checks that the advantages are GRPO-style (one value per trajectory on its response tokens,
   each prompt group's mean zero over DP: ``grpo``, Dr. GRPO, RLOO), else fails closed on
   every DP rank (``gae``, REINFORCE++ and other estimators have no group mean to replace);
3. turns the chunk into ``baseline_hook``'s rollout layout (each trajectory without its
   padding: verl left-pads prompts and right-pads responses; IS weights
   ``exp(old_log_probs - rollout_log_probs)`` when ``rollout_log_probs`` is there and
   ``use_is_weights``), lends ``actor_module`` and runs :func:`baseline_hook.rewrite_rewards`
   on ``A_i`` with the group ids of ``uid``: the norm pass (``rules`` / ``exact`` / ``proxy``),
   ``dp_min_variance_baseline`` over DP (groups split over DP ranks by verl's dispatch or
   ``balance_batch`` get one ``b*``). ``b*`` is a weighted mean, so
   ``A_i - b*(A) = (R_i - b*(R)) / (std + eps)``: the group mean replaced, verl's std kept;
4. on, the mini-batches get ``(A_i - b*) * response_mask`` (the caller's ``data`` keeps its
   own tensor); shadow, nothing changes.

``update_policy`` then reads every mini-batch back before verl trains on it
(:func:`read_back`): a mini-batch whose advantages are not ``A - b*`` stops the run on every DP
rank (:class:`~ess_patch.guard.EssLrNotAppliedError`). The norm pass runs before any step and
changes nothing the step uses, so verl's loss (PPO clipping, dual-clip, KL, entropy) is as it
was. verl's own forward packs the batch (remove-padding, THD); the pass runs its own forward on
each unpadded trajectory, on the same model, so both layouts get the same norms.

Metrics, under ``actor/`` in ``update_policy``'s dict (one value per update):
``ess_baseline_shift``, ``ess_baseline_abs_shift``, ``ess_baseline_fallback_groups``,
``ess_baseline_split_groups``, ``ess_baseline_norm_pass_s``, ``ess_baseline_applied`` (1 once
every mini-batch was read back with ``A - b*``, 0 in shadow mode).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import torch

from ...errors import FailClosedNotImplementedError
from ...group_baseline import dp_min_variance_baseline
from ...guard import EssLrNotAppliedError
from ...reduction import all_reduce_sum, group_size
from ...state import STATE
from ..baseline_hook import check_applied, rewrite_rewards
from .baseline_config import SUPPORTED_BASELINE, BaselineSettings

__all__ = ["ROW_KEY", "check_minibatch", "read_back", "rewrite"]

#: the batch key that carries each row's index in the chunk to the mini-batches (read back,
#: then removed before verl sees the mini-batch)
ROW_KEY = "_ess_patch_row"
_FRAMEWORK = "verl"
_FIX = (
    "Use algorithm.adv_estimator=grpo (the baseline replaces its group mean), or turn the "
    "baseline off (ESS_LR_BASELINE, actor.grad_baselining.enable)"
)


def _refuse(chosen: BaselineSettings, what: str, fix: str) -> None:
    raise FailClosedNotImplementedError(
        f"ess-patch (verl): VCPO's baseline was requested ({chosen.source}) but {what}, so the "
        f"advantages would keep the group mean. Supported: {SUPPORTED_BASELINE}. {fix}, or "
        "turn the baseline off"
    )


def _check_layout(chosen: BaselineSettings, actor: Any, data: Any) -> None:
    """Step 1: the settings every rank shares that the norm pass cannot serve."""
    from megatron.core import parallel_state as mpu

    cp = mpu.get_context_parallel_world_size()
    if cp > 1:
        _refuse(
            chosen,
            f"context_parallel_size is {cp} (the norm pass runs whole sequences)",
            "Set actor_rollout_ref.actor.megatron.context_parallel_size=1",
        )
    chunks = getattr(actor, "actor_module", None)
    if not isinstance(chunks, (list, tuple)) or len(chunks) != 1:
        count = len(chunks) if isinstance(chunks, (list, tuple)) else "no"
        _refuse(
            chosen,
            f"the actor holds {count} model chunks (virtual pipeline; the norm pass runs one)",
            "Unset actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size",
        )
    temperature = getattr(data, "meta_info", {}).get("temperature", 1.0)
    if isinstance(temperature, torch.Tensor):  # the engine path may carry one per sample
        values = temperature.unique().tolist()
        temperature = values[0] if len(values) == 1 else values
    if temperature not in (None, 1, 1.0):
        _refuse(
            chosen,
            f"the rollout temperature is {temperature} (the norm pass differentiates "
            "log p at temperature 1)",
            "Sample at actor_rollout_ref.rollout.temperature=1.0",
        )
    if "multi_modal_inputs" in data.non_tensor_batch:
        _refuse(
            chosen,
            "the batch has multi_modal_inputs (the norm pass runs the text model alone)",
            "Train a text-only model",
        )
    present = set(data.batch.keys())
    missing = [k for k in ("advantages", "response_mask", "attention_mask") if k not in present]
    if missing or "uid" not in data.non_tensor_batch:
        lacking = [*missing, *([] if "uid" in data.non_tensor_batch else ["uid"])]
        _refuse(
            chosen,
            f"the actor's batch has no {', '.join(lacking)} (the prompt groups or the "
            "advantages are unknown)",
            "Train through verl's PPO trainer (it sets uid per prompt)",
        )


def _group_id(uid: Any) -> int:
    """A prompt's ``uid`` (verl: a uuid4 string) as an integer id, the same on every rank
    (48 bits: exact in the float64 rows of ``dp_min_variance_baseline``)."""
    digest = hashlib.blake2b(str(uid).encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big")


def _rollout(data: Any, chosen: BaselineSettings) -> tuple[dict, list[str]]:
    """Step 3's layout, and the local problems of step 2 (one per bad row, at most one)."""
    batch = data.batch
    adv, mask = batch["advantages"], batch["response_mask"].bool()
    attention = batch["attention_mask"].bool()
    width = mask.shape[-1]
    ids = batch["input_ids"]
    # the engine path's driver unpads input_ids (nested, one row per trajectory) and keeps the
    # padded attention mask beside it; the legacy actor gets both padded
    packed = list(ids.unbind()) if getattr(ids, "is_nested", False) else None
    # a TensorDict refuses `key in td`
    weights = chosen.use_is_weights and "rollout_log_probs" in batch.keys()  # noqa: SIM118
    out: dict[str, list] = {
        k: []
        for k in ("tokens", "response_lengths", "loss_masks", "log_probs", "rollout_log_probs")
    }
    rewards, problems = [], []
    for i in range(attention.shape[0]):
        response = attention[i, -width:]
        length = int(response.sum())
        if not bool(response[:length].all()) or bool(mask[i, length:].any()):
            problems.append(
                f"row {i}'s response is not right-padded under its attention mask "
                "(the unpadded trajectory is unknown)"
            )
            break
        values = adv[i][mask[i]].double()
        a = float(values.mean()) if values.numel() else 0.0
        if values.numel() and not torch.allclose(
            values, torch.full_like(values, a), rtol=1e-5, atol=1e-6
        ):
            problems.append(
                f"row {i}'s advantage differs between its tokens (not one value per "
                "trajectory: a critic's GAE or REINFORCE++, not GRPO)"
            )
            break
        tokens = ids[i][attention[i]] if packed is None else packed[i]
        if tokens.numel() != int(attention[i].sum()):
            problems.append(
                f"row {i} has {tokens.numel()} input_ids but {int(attention[i].sum())} "
                "attended positions (the unpadded trajectory is unknown)"
            )
            break
        rewards.append(a)
        out["tokens"].append(tokens)
        out["response_lengths"].append(length)
        out["loss_masks"].append(mask[i, :length].float())
        if weights:
            out["log_probs"].append(batch["old_log_probs"][i, :length])
            out["rollout_log_probs"].append(batch["rollout_log_probs"][i, :length])
    out["rewards"] = rewards
    out["sample_indices"] = [_group_id(u) for u in data.non_tensor_batch["uid"]]
    return out, problems


def _host_args(chosen: BaselineSettings, actor: Any) -> SimpleNamespace:
    """``baseline_hook``'s view of verl's settings (one micro-batch per pass, as verl's own)."""
    config = getattr(actor, "config", None)
    micro = getattr(config, "ppo_micro_batch_size_per_gpu", None)
    if micro is None and hasattr(config, "get"):
        micro = config.get("ppo_micro_batch_size_per_gpu")
    return SimpleNamespace(
        use_ess_baseline=chosen.mode == "on",
        ess_baseline_shadow=chosen.mode == "shadow",
        ess_baseline_path=chosen.path,
        micro_batch_size=int(micro or 1),
        n_samples_per_prompt=1,  # sample_indices are already the group ids
        use_tis=False,
        normalize_advantages=False,
    )


def _stop_everywhere(problem: str | None, dp_group: Any) -> None:
    """Raise on every DP rank when any rank has a problem (a flag all-reduced first)."""
    flag = torch.tensor([float(problem is not None)], dtype=torch.float64)
    if group_size(dp_group, "DP") > 1:
        flag = all_reduce_sum(flag, dp_group)
    if float(flag) > 0:
        raise EssLrNotAppliedError(
            f"ess-patch (verl): VCPO's baseline was requested but "
            f"{problem or 'the advantages of another DP rank are not GRPO-style'}, so there "
            f"is no group mean to replace. {_FIX}"
        )


def rewrite(actor: Any, data: Any, chosen: BaselineSettings, dp_group: Any) -> dict:
    """Steps 1-4 of the module docstring on this DP rank's chunk ``data`` (its ``advantages``
    replaced in ``data.batch`` when on, and the row key added); returns the record
    :func:`read_back` checks against (``baseline_hook``'s, with the metrics).

    Raises:
        FailClosedNotImplementedError: a layout the pass cannot serve (every rank alike).
        EssLrNotAppliedError: advantages that are not GRPO-style (on every DP rank).
    """
    _check_layout(chosen, actor, data)
    rollout, problems = _rollout(data, chosen)
    local = problems[0] if problems else None
    _stop_everywhere(local, dp_group)
    # each prompt group's mean of A over DP (all norms zero: every group falls back to it)
    rewards = torch.tensor(rollout["rewards"], dtype=torch.float64)
    ids = torch.tensor(rollout["sample_indices"], dtype=torch.long)
    means = dp_min_variance_baseline(rewards, ids, torch.zeros_like(rewards), dp_group=dp_group)
    scale = 1.0 + float(rewards.abs().max()) if rewards.numel() else 1.0
    off = (means.baselines.abs() > 1e-4 * scale).nonzero()
    local = (
        f"row {int(off[0, 0])}'s prompt group (uid) has mean advantage "
        f"{float(means.baselines[off[0, 0]]):.4g}, not 0 (not a group-mean baseline: "
        "REINFORCE++-baseline, OPO, a group of one, ...)"
        if off.numel()
        else None
    )
    _stop_everywhere(local, dp_group)
    host_args = _host_args(chosen, actor)
    previous = STATE.baseline_model
    STATE.baseline_model = actor.actor_module
    try:
        record = rewrite_rewards(_FRAMEWORK, host_args, rollout, dp_group)
    finally:
        STATE.baseline_model = previous
    record["host_args"] = host_args
    if chosen.mode == "on":
        mask = data.batch["response_mask"]
        new = torch.tensor(rollout["rewards"], dtype=torch.float64)
        adv = (new[:, None] * mask.double()).to(data.batch["advantages"].dtype)
        data.batch["advantages"] = adv
    data.batch[ROW_KEY] = torch.arange(len(rollout["rewards"]))
    return record


def check_minibatch(batch: Any, record: dict, dp_group: Any, drawn_by: str) -> None:
    """One mini-batch (``batch``: its TensorDict) as verl is about to train on it: the row key
    taken out and, when on, its advantages checked against ``A - b*`` (every DP rank
    together); ``drawn_by`` names what verl drew it with (for the error)."""
    # the same on every rank: verl's own iterator (a TensorDict refuses `key in td`)
    if ROW_KEY not in batch.keys():  # noqa: SIM118
        raise EssLrNotAppliedError(
            f"ess-patch (verl): VCPO's baseline was requested but verl trained on a mini-batch "
            f"that {drawn_by} did not make (its rows are unknown, so its advantages cannot be "
            f"read back). Use verl's {drawn_by}, or turn the baseline off"
        )
    rows = batch[ROW_KEY].tolist()
    del batch[ROW_KEY]
    if record["mode"] != "on":
        return
    mask = batch["response_mask"].bool()
    adv = batch["advantages"]
    sub = {"advantages": [adv[k][mask[k]] for k in range(len(rows))]}
    mine = {"mode": "on", "expected": [record["expected"][r] for r in rows], "metrics": {}}
    check_applied(_FRAMEWORK, record["host_args"], sub, mine, dp_group, fix=_FIX)


def read_back(dataloader: Iterable[Any], record: dict, dp_group: Any) -> Iterator[Any]:
    """The mini-batches as verl draws them, each one checked (:func:`check_minibatch`) before
    verl trains on it."""
    for data in dataloader:
        check_minibatch(data.batch, record, dp_group, "make_minibatch_iterator")
        yield data
    if record["mode"] == "on":
        record["metrics"]["ess_baseline_applied"] = 1.0
