"""``compute_ess_lr``: the estimator and the reductions, in the order every rank runs them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import calibration, estimator, policy_version
from .config import EssLrConfig
from .errors import EssPatchTypeError, EssPatchValueError
from .reduction import (
    ENVELOPE_SIZE,
    NO_CALIBRATION,
    agreed_calibration,
    all_gather_rows,
    all_reduce_trajectory_stats,
    any_missing,
    check_envelopes,
    envelope,
    exchange_envelopes,
    group_size,
    origin_rank,
)
from .removed import removed_keyword
from .result import ENCODED_SIZE, EssLrResult

__all__ = ["compute_ess_lr", "compute_ess_lr_from_stats"]


@torch.no_grad()  # log-probs that require grad must not grow an autograd graph here
def compute_ess_lr(
    log_probs: Sequence[torch.Tensor] | None,
    rollout_log_probs: Sequence[torch.Tensor] | None,
    loss_masks: Sequence[torch.Tensor] | None,
    *,
    config: EssLrConfig | None = None,
    cp_group: object | None = None,
    dp_group: object | None = None,
    pp_group: object | None = None,
    error: BaseException | None = None,
    policy_versions: Sequence[int | str | Sequence[int | str] | None] | None = None,
    current_version: int | str | None = None,
    **removed: object,
) -> EssLrResult:
    """ESS, rho and LR scale of one rollout, identical on every rank.

    With ``pp_group`` this is the one call per rollout on *every* rank (all pipeline
    stages): the last stage computes, every stage returns its result, and a fault on any
    rank of the DP x CP x PP world (a non-last stage included) is raised on every rank::

        result = ess_patch.compute_ess_lr(
            log_probs if is_last_stage else None,  # non-last stages pass None
            rollout_log_probs if is_last_stage else None,
            loss_masks,
            cp_group=cp_group, dp_group=dp_group, pp_group=pp_group,
        )
        ess_patch.arm(result)

    Args:
        log_probs: per trajectory, this rank's train-side log-probs of the response
            tokens (1-D float tensors).
        rollout_log_probs: the same tokens' log-probs from the rollout (inference) engine.
        loss_masks: per trajectory, aligned with the tensors above; non-zero = counted.
        config: the rule (defaults to ``EssLrConfig()``).
        cp_group: context-parallel group whose ranks hold other chunks of the *same*
            trajectories (when its size > 1: an all-gather of the envelopes, then one
            all-reduce of the trajectory table).
        dp_group: data-parallel group (without CP) whose ranks hold *other* trajectories
            (one all-gather when its size > 1).
        pp_group: pipeline-parallel group (when its size > 1: two small all-gathers, one
            before the last stage reduces over CP and DP, one that carries its result). Only
            the last stage's inputs are used; a non-last stage passes None, or inputs that
            are then checked as on the last stage (a bad one is a fault like any other) and
            otherwise ignored.
        error: this rank already failed to prepare its inputs (e.g. slicing full-length
            masks to its CP chunk): it still enters every collective, flagged, then raises
            ``error``, and every peer raises
            :class:`~ess_patch.estimator.InvalidInputsElsewhereError` (in a single process it
            is raised at once).
        policy_versions: per trajectory (aligned with the inputs), the policy version that
            generated it, or one per generation call (miles' ``weight_versions``); with
            ``current_version``, the version of the weights being trained now. Only for
            ``calibrate_rollouts``: it then counts only the on-policy trajectories
            (``ess_patch.policy_version``, ``ess_patch.calibration``). The scale itself
            is over every trajectory, as without them. Give both or neither.
        current_version: see ``policy_versions``.
        **removed: nothing is accepted here; a keyword removed since 0.1.0
            (``prepare_masks=``) raises :class:`~ess_patch.removed.RemovedKeywordError` (a
            ``TypeError``) saying what to do instead, any other the usual ``TypeError``.

    A rank whose ``log_probs`` or ``rollout_log_probs`` is None has missing inputs: it
    still enters every collective and every rank returns the no-op (``status="missing"``).
    Under CP such a rank must still pass ``loss_masks`` (or the other log-probs) so that
    it knows how many trajectories its CP peers reduce.

    Faults (any exception while this rank prepares its contribution, e.g. inputs that do
    not line up, a tensor on another device, a mask slicing error) never leave a peer
    waiting: the rank still enters every collective with a "failed" flag in its envelope,
    then re-raises its own error, and every other rank raises
    :class:`~ess_patch.estimator.InvalidInputsElsewhereError` naming it. CP peers also
    exchange their trajectory counts before the payload, and every rank its settings.

    Raises:
        ValueError / TypeError (or whatever the preparation raised): on the rank whose inputs
            are bad; in a single process before anything else.
        InvalidInputsElsewhereError: on every other rank of the rollout.
        ConfigMismatchError: on every rank, when the ranks' ``config`` differ.
        estimator.NonFiniteLogProbError: a NaN/inf log-ratio with ``nonfinite="raise"``,
            raised on every rank alike, naming the data-parallel rank and the sample index.
        TypeError: ``config`` is not an EssLrConfig (on that rank; its peers raise
            InvalidInputsElsewhereError).

    A rollout is one step that holds every trajectory. For one scale per optimizer step
    (granularity ``"step"``, VCPO's), call this once per step over the samples that step
    trains on, on every rank, and ``arm`` its result before that step; ``install()``'s
    integrations do so inside the policy loss.

    Without ``pp_group``, only the ranks of one pipeline stage meet here: the lower-level
    pattern (the last stage calls this, every stage then calls
    :func:`~ess_patch.reduction.broadcast_from_last_stage` with ``error=`` what this raised)
    covers faults of the last stage only; prefer ``pp_group``.
    """
    if removed:  # as Python would, at once, but naming the replacement of a removed keyword
        raise removed_keyword("compute_ess_lr", removed)
    config, config_error = _checked_config(config)
    error = error if error is not None else config_error
    on_policy, versions_error = _on_policy(policy_versions, current_version)
    error = error if error is not None else versions_error
    options = {"config": config, "error": error, "cp_group": cp_group, "dp_group": dp_group}
    if pp_group is not None:
        return _across_stages(
            (log_probs, rollout_log_probs, loss_masks),
            on_policy=on_policy,
            pp_group=pp_group,
            **options,
        )
    return _rollout_result((log_probs, rollout_log_probs, loss_masks), on_policy, **options)


def _on_policy(
    versions: Sequence[int | str | Sequence[int | str] | None] | None, current: int | str | None
) -> tuple[list[bool] | None, BaseException | None]:
    """Per trajectory, whether it is on-policy (None: no versions given), or the error to
    raise once this rank has joined its peers."""
    if versions is None and current is None:
        return None, None
    if versions is None or current is None:
        given, missing = (
            ("policy_versions", "current_version")
            if current is None
            else ("current_version", "policy_versions")
        )
        return None, EssPatchTypeError(
            f"compute_ess_lr: {given} was given without {missing}; pass both (each "
            "trajectory's policy version and the version of the weights being trained) or "
            "neither"
        )
    try:
        return policy_version.on_policy(versions, current), None
    except TypeError as exc:
        return None, exc


_Inputs = tuple[
    Sequence[torch.Tensor] | None, Sequence[torch.Tensor] | None, Sequence[torch.Tensor] | None
]


def _rollout_result(
    inputs: _Inputs,
    on_policy: list[bool] | None = None,
    *,
    config: EssLrConfig | None,
    error: BaseException | None,
    cp_group: object | None,
    dp_group: object | None,
) -> EssLrResult:
    """One stage's rollout result over its CP and DP groups (``error``: a fault this rank
    already has; it still joins every collective, flagged; ``on_policy``: per trajectory,
    whether calibration may count it)."""
    summaries, agreed = _reduce(
        *inputs,
        config=config,  # type: ignore[arg-type]  # None only with an error: never read
        cp_group=cp_group,
        dp_group=dp_group,
        error=error,
        on_policy=on_policy,
    )
    assert config is not None
    return _decide(summaries, config, agreed)


def _decide(
    summaries: torch.Tensor, config: EssLrConfig, agreed: tuple[float, float], count: bool = True
) -> EssLrResult:
    """The result of every rank's summaries, calibrated when the config asks for it (then
    each row also holds the summary of the rank's on-policy trajectories, after the first
    ``SUMMARY_SIZE`` columns)."""
    size = estimator.SUMMARY_SIZE
    result = estimator.result(summaries[:, :size], config)
    if config.calibrate_rollouts:
        on_policy = None
        if result.status == "ok" and summaries.shape[1] > size:
            on_policy = estimator.result(summaries[:, size : 2 * size], config)
        result = calibration.apply(result, config, agreed, on_policy, count=count)
    return result


def _across_stages(
    inputs: _Inputs,
    *,
    on_policy: list[bool] | None,
    config: EssLrConfig | None,
    error: BaseException | None,
    cp_group: object | None,
    dp_group: object | None,
    pp_group: object,
) -> EssLrResult:
    """:func:`compute_ess_lr` on every pipeline stage.

    Why two PP exchanges: a fault on a non-last stage must reach its last stage *before*
    that stage reduces over CP and DP, so that it travels on, flagged, to every other rank
    of the last stage; the second exchange then brings the outcome back to every stage.
    """
    options = {"cp_group": cp_group, "dp_group": dp_group}
    pp_size = group_size(pp_group, "PP")
    if pp_size <= 1:
        return _rollout_result(inputs, config=config, error=error, **options)
    is_last = dist.get_rank(pp_group) == pp_size - 1
    if not is_last and error is None:
        try:
            _check_unused_inputs(inputs, config, dp_group)  # type: ignore[arg-type]
        except Exception as exc:
            error = exc
    rows = all_gather_rows(envelope(failed=error is not None, config=config), pp_group, "PP")
    stage_fault = None if error is not None else check_envelopes(rows, "PP")
    result: EssLrResult | None = None
    if is_last:
        try:
            result = _rollout_result(
                inputs, on_policy, config=config, error=error or stage_fault, **options
            )
        except Exception as exc:
            error = exc
    failed = error is not None or stage_fault is not None
    # the result, then the calibration the last stage now holds: every stage holds it too
    # (a checkpoint of any stage keeps it)
    payload = torch.zeros(ENCODED_SIZE + 2, dtype=torch.float64)
    if result is not None:
        payload = torch.tensor([*result.encode(), *calibration.held_any()], dtype=torch.float64)
    own = error if error is not None else stage_fault
    row = envelope(failed=failed, config=config, origin=None if own is None else origin_rank(own))
    rows = all_gather_rows(torch.cat([row, payload]), pp_group, "PP")
    if error is not None:
        raise error
    if stage_fault is not None:
        raise stage_fault
    fault = check_envelopes(rows[:, :ENVELOPE_SIZE], "PP")
    if fault is not None:
        raise fault
    if result is not None:
        return result
    last = rows[-1, ENVELOPE_SIZE:].tolist()
    if config is not None and config.calibrate_rollouts:
        calibration.hold(config, (last[ENCODED_SIZE], last[ENCODED_SIZE + 1]))
    return EssLrResult.decode(last[:ENCODED_SIZE])


def _check_unused_inputs(
    inputs: _Inputs,
    config: EssLrConfig,
    dp_group: object | None,
) -> None:
    """A non-last stage's inputs, when it passes both log-probs: checked as the last stage
    checks its own (types, shapes, non-finite values), then dropped."""
    log_probs, rollout_log_probs, loss_masks = inputs
    if log_probs is None or rollout_log_probs is None:
        return  # the usual case: only the last stage has log-probs
    if loss_masks is None:
        raise EssPatchValueError("loss_masks is None but log-probs were given; pass the masks too")
    stats = estimator.trajectory_stats(log_probs, rollout_log_probs, loss_masks)
    dp_rank = dist.get_rank(dp_group) if group_size(dp_group, "DP") > 1 else 0
    estimator.finalize(estimator.summarize(stats, config, rank=dp_rank), config)


@torch.no_grad()
def compute_ess_lr_from_stats(
    trajectory_stats: torch.Tensor | None,
    *,
    config: EssLrConfig | None = None,
    cp_group: object | None = None,
    dp_group: object | None = None,
    error: BaseException | None = None,
    count: bool = True,
) -> EssLrResult:
    """:func:`compute_ess_lr` from a precomputed per-trajectory table, identical on every rank.

    ``trajectory_stats`` is this rank's ``[B, 3]`` float64 table of
    ``[sum of masked log-ratios, masked tokens, non-finite flag]`` (as
    :func:`~ess_patch.estimator.trajectory_stats` returns; rows may be partial sums, e.g.
    accumulated loss call by loss call). Its rows are summed over ``cp_group`` (the CP peers
    hold other chunks of the same trajectories, in the same row order), then the summaries
    are gathered over ``dp_group``: the same collectives, checks and faults as
    :func:`compute_ess_lr`.

    ``error``: this rank failed to build its table (``trajectory_stats`` may then be None);
    it still enters every collective, then raises ``error``, and every peer raises
    :class:`~ess_patch.estimator.InvalidInputsElsewhereError`.

    ``count``: whether this result may count towards ``calibrate_rollouts`` (False: a later
    optimizer step of a rollout already counted, e.g. shadow mode's steps of one rollout:
    calibration counts rollouts, not steps).

    Raises:
        ValueError: a table that is not ``[B, 3]`` (on that rank; every peer fails with it).
        everything :func:`compute_ess_lr` raises, on the same ranks.
    """
    config = _check_config(config)
    groups = _Groups.of(cp_group, dp_group)
    distributed = groups.distributed
    if error is None:
        try:
            if trajectory_stats is None:
                raise EssPatchValueError(
                    "trajectory_stats is None; pass a [B, 3] table (B may be 0)"
                )
            if trajectory_stats.dim() != 2 or trajectory_stats.shape[1] != 3:
                raise EssPatchValueError(
                    "trajectory_stats must be a [B, 3] table of [sum of masked log-ratios, "
                    f"masked tokens, non-finite flag]; got shape {tuple(trajectory_stats.shape)}"
                )
            trajectory_stats = trajectory_stats.to(torch.float64)
        except Exception as exc:
            if not distributed:
                raise
            error = exc
    elif not distributed:
        raise error
    summaries, agreed = _reduce_table(
        None if error is not None else trajectory_stats,
        missing=False,
        error=error,
        config=config,
        groups=groups,
    )
    return _decide(summaries, config, agreed, count=count)


class _Groups(NamedTuple):
    """The CP and DP groups a rollout's table is reduced over, and their sizes."""

    cp: object | None
    dp: object | None
    sizes: tuple[int, int]

    @classmethod
    def of(cls, cp_group: object | None, dp_group: object | None) -> _Groups:
        return cls(cp_group, dp_group, (group_size(cp_group, "CP"), group_size(dp_group, "DP")))

    @property
    def distributed(self) -> bool:
        return max(self.sizes) > 1


def _reduce(
    log_probs: Sequence[torch.Tensor] | None,
    rollout_log_probs: Sequence[torch.Tensor] | None,
    loss_masks: Sequence[torch.Tensor] | None,
    *,
    config: EssLrConfig,
    cp_group: object | None,
    dp_group: object | None,
    error: BaseException | None = None,
    on_policy: list[bool] | None = None,
) -> tuple[torch.Tensor, tuple[float, float]]:
    """Every DP rank's summary row, ``[DP, SUMMARY_SIZE]``, and the calibration the ranks
    agreed on, or the error every rank must raise. ``error``: a fault this rank already has
    (raised at once in a single process; else it joins every collective flagged, naming the
    rank it came from, then re-raises it)."""
    groups = _Groups.of(cp_group, dp_group)
    distributed = groups.distributed
    missing = log_probs is None or rollout_log_probs is None
    if error is not None and not distributed:
        raise error
    stats: torch.Tensor | None = None
    try:
        if error is not None:
            raise error
        if missing:
            stats = _missing_table(log_probs, rollout_log_probs, loss_masks, groups.sizes[0])
        else:
            if loss_masks is None:
                raise EssPatchValueError(
                    "loss_masks is None but log-probs were given; pass the masks too"
                )
            stats = estimator.trajectory_stats(log_probs, rollout_log_probs, loss_masks)
        if on_policy is not None and len(on_policy) != stats.shape[0]:
            raise EssPatchValueError(
                f"policy_versions has {len(on_policy)} entries for {stats.shape[0]} "
                "trajectories; pass one per trajectory, aligned with the log-probs"
            )
    except Exception as exc:
        if not distributed:
            raise
        error = exc  # still enter every collective, so that the peers fail with us
    return _reduce_table(
        stats, missing=missing, error=error, config=config, groups=groups, on_policy=on_policy
    )


def _reduce_table(
    stats: torch.Tensor | None,
    *,
    missing: bool,
    error: BaseException | None,
    config: EssLrConfig | None,
    groups: _Groups,
    on_policy: list[bool] | None = None,
) -> tuple[torch.Tensor, tuple[float, float]]:
    """The collectives of :func:`_reduce` on a prepared ``[B, 3]`` trajectory table (None
    with ``error`` set: this rank failed to prepare it, and still enters every collective;
    ``config`` None: this rank's config was not an EssLrConfig, it fails in the envelope;
    ``groups``: the CP and DP groups and their sizes). Also returns the calibration every
    rank continues from (calibration.py: it travels in the envelopes; this rank's own with no
    peers). While
    calibrating, each row also holds the summary of the rank's on-policy trajectories
    (``on_policy``; None: all of them)."""
    cp_group, dp_group = groups.cp, groups.dp
    cp_size, dp_size = groups.sizes
    calibrating = config is not None and config.calibrate_rollouts > 0
    agreed = calibration.held(config) if calibrating else NO_CALIBRATION
    origin = None if error is None else origin_rank(error)
    fault: Exception | None = None
    if cp_size > 1:
        envelopes = exchange_envelopes(
            envelope(
                failed=error is not None,
                origin=origin,
                missing=missing,
                rows=-1 if stats is None else stats.shape[0],
                config=config,
                calibration=agreed,
            ),
            cp_group,
            "CP",
        )
        fault = check_envelopes(envelopes, "CP", same_rows=True)
        if calibrating:
            agreed = agreed_calibration(envelopes)
        if error is None and fault is None:
            assert stats is not None
            stats = all_reduce_trajectory_stats(stats, cp_group)
            missing = any_missing(envelopes)
    failed = error is not None or fault is not None
    if fault is not None and error is None:
        origin = origin_rank(fault)  # a CP peer's fault: DP peers learn whose it was
    # The data-parallel rank names the culprit identically on every CP peer of the batch.
    dp_rank = dist.get_rank(dp_group) if dp_size > 1 else 0
    summary = torch.zeros(estimator.SUMMARY_SIZE, dtype=torch.float64)
    if not failed and stats is not None:
        assert config is not None
        flags = estimator.Flags(missing=missing)
        summary = estimator.summarize(stats, config, rank=dp_rank, flags=flags)
    if calibrating:
        own = None if failed else stats
        summary = torch.cat([summary, _on_policy_summary(summary, own, on_policy, config, dp_rank)])
    if dp_size <= 1:
        if error is not None:
            raise error
        if fault is not None:
            raise fault
        return summary.unsqueeze(0), agreed
    # one all-gather: the summary with this rank's envelope (zeros from a failed rank)
    rows = all_gather_rows(
        torch.cat(
            [
                summary,
                envelope(failed=failed, config=config, origin=origin, calibration=agreed).to(
                    summary.device
                ),
            ]
        ),
        dp_group,
        "DP",
    )
    if error is not None:
        raise error
    width = summary.shape[0]
    if fault is None:
        fault = check_envelopes(rows[:, width:], "DP")
    if fault is not None:
        raise fault
    if calibrating:
        agreed = agreed_calibration(rows[:, width:])
    return rows[:, :width], agreed


def _on_policy_summary(
    summary: torch.Tensor,
    stats: torch.Tensor | None,
    on_policy: list[bool] | None,
    config: EssLrConfig,
    dp_rank: int,
) -> torch.Tensor:
    """The summary of this rank's on-policy trajectories (the whole summary when every one
    is; zeros on a rank that failed, as its summary)."""
    if on_policy is None or stats is None or all(on_policy):
        return summary
    keep = torch.tensor(on_policy, dtype=torch.bool, device=stats.device)
    return estimator.summarize(stats[keep], config, rank=dp_rank)


_DEFAULT_CONFIG = EssLrConfig()  # frozen: built once, not at every call (~10 us of checks)


def _checked_config(config: object) -> tuple[EssLrConfig | None, BaseException | None]:
    """The config, or the TypeError to raise once this rank has joined its peers."""
    try:
        return _check_config(config), None
    except TypeError as exc:
        return None, exc


def _check_config(config: object) -> EssLrConfig:
    if config is None:
        return _DEFAULT_CONFIG
    if not isinstance(config, EssLrConfig):
        raise EssPatchTypeError(
            f"config must be an ess_patch.EssLrConfig (e.g. EssLrConfig(floor=0.2)), got "
            f"{type(config).__name__}"
        )
    return config


def _is_sequence(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, torch.Tensor)


def _missing_table(
    log_probs: Sequence[torch.Tensor] | None,
    rollout_log_probs: Sequence[torch.Tensor] | None,
    loss_masks: Sequence[torch.Tensor] | None,
    cp_size: int,
) -> torch.Tensor:
    """A zero table of the right height, so a rank with missing inputs can join the CP sum."""
    known = next((s for s in (loss_masks, log_probs, rollout_log_probs) if s is not None), None)
    if known is None:
        if cp_size > 1:
            raise EssPatchValueError(
                "compute_ess_lr: all inputs are None on a rank of a CP group of size > 1; pass "
                "loss_masks so that this rank joins its CP peers' reduction with the right size"
            )
        return torch.zeros((0, 3), dtype=torch.float64)
    device = known[0].device if len(known) else torch.device("cpu")
    return torch.zeros((len(known), 3), dtype=torch.float64, device=device)
