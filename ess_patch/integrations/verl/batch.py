"""verl: the ESS of one batch (a mini-batch, or a DP rank's whole rollout chunk), what both
actor paths measure: the rows of a DataProto or TensorDict, the bypass refusal, one
reduction over DP without CP computed on the last stage and broadcast over PP."""

from __future__ import annotations

from typing import Any

from ... import collapse_warning
from ...config import EssLrConfig
from ...errors import EssPatchValueError
from ...result import EssLrResult
from ..framework import Groups, megatron_groups


def actor_groups() -> Groups:
    """DP without CP (CP peers hold the same sequences whole), the PP group, the last stage."""
    return megatron_groups()._replace(cp_group=None)


def _rows(tensor: Any) -> list[Any]:
    """One 1-D tensor per trajectory: the rows of a padded ``[batch, response]`` tensor or
    of a nested (jagged) one."""
    return list(tensor.unbind()) if getattr(tensor, "is_nested", False) else list(tensor)


def _tensors(data: Any) -> tuple[list[Any], list[Any], list[Any]]:
    """``(old_log_probs, rollout_log_probs, response_mask)`` rows of a DataProto or TensorDict.

    Raises:
        ValueError: a key is missing (the same on every rank: every DP chunk has the keys of
            the whole batch), naming the verl setting that provides it.
    """
    batch = data.batch if hasattr(data, "non_tensor_batch") else data  # DataProto or TensorDict
    keys = set(batch.keys())
    if "rollout_log_probs" not in keys:
        raise EssPatchValueError(
            "ESS-LR (verl): the actor's batch has no rollout_log_probs, so there is nothing to "
            "measure the policy against. Set actor_rollout_ref.rollout.calculate_log_probs=True "
            "(the rollout engine then returns them), or turn ESS-LR off"
        )
    if "old_log_probs" not in keys:
        raise EssPatchValueError("ESS-LR (verl): the actor's batch has no old_log_probs")
    if "response_mask" in keys:
        mask = _rows(batch["response_mask"])
    elif {"attention_mask", "responses"} <= keys:  # older verl: the actor derived it so
        mask = list(batch["attention_mask"][:, -batch["responses"].shape[-1] :])
    else:
        raise EssPatchValueError(
            "ESS-LR (verl): the actor's batch has neither response_mask nor attention_mask "
            "and responses to tell which tokens count"
        )
    return _rows(batch["old_log_probs"]), _rows(batch["rollout_log_probs"]), mask


def _check_not_bypassed(old: list[Any], rollout: list[Any], mask: list[Any]) -> None:
    """A refusal when the old log-probs ARE the rollout log-probs on every counted token."""
    import torch

    counted = [m.bool() for m in mask]
    if not any(bool(m.any()) for m in counted):
        return
    if all(torch.equal(o[m], r[m]) for o, r, m in zip(old, rollout, counted, strict=True)):
        raise EssPatchValueError(
            "ESS-LR (verl): old_log_probs equal rollout_log_probs on every token "
            "(algorithm.rollout_correction.bypass_mode=True copies them): the ratio is "
            "1 and the ESS would measure nothing. Turn bypass_mode off (verl then "
            "recomputes old_log_probs with the current weights) or ESS-LR off"
        )


def compute_batch(data: Any, config: EssLrConfig, groups: Groups | None = None) -> EssLrResult:
    """The ESS of one batch (a mini-batch, or the whole rollout chunk) over every DP rank,
    identical on every rank of the actor; a fault on any rank raises on all of them."""
    from ...compute import compute_ess_lr
    from ...reduction import broadcast_from_last_stage

    groups = actor_groups() if groups is None else groups
    out: EssLrResult | None = None
    error: BaseException | None = None
    try:
        if groups.is_pp_last:
            fault: Exception | None = None
            rows: tuple[list[Any], ...] = ([], [], [])
            try:
                rows = _tensors(data)
                _check_not_bypassed(*rows)
            except Exception as exc:  # still enter the DP collectives, flagged
                fault, rows = exc, ([], [], [])
            out = compute_ess_lr(*rows, config=config, dp_group=groups.dp_group, error=fault)
    except Exception as exc:
        error = exc  # the other pipeline stages learn of it through the broadcast
    result = broadcast_from_last_stage(out, groups.pp_group, config=config, error=error)
    # verl's shadow mode is the config's (settings(): enable and shadow never both on); the
    # result is armed per mini-batch, before the step that uses it (arm_now=False)
    return collapse_warning.publish(
        result, config, framework="verl", shadow=config.shadow, arm_now=False
    )
