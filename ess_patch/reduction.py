"""The collectives that make a rollout's ESS global: CP all-reduce, DP and PP all-gathers.

Each runs only on an explicit group with more than one rank (``group=None`` would mean
WORLD in torch.distributed, so it is never passed). Every rank enters the same collectives
in the same order whatever its own inputs hold. What decides the outcome travels with them:
an *envelope* per rank (did it fail, are its log-probs missing, how many rows it will send,
its config) goes before the CP payload and with the DP and PP rows, so that a fault on one
rank (any exception), a count disagreement or different settings end in the same error on
every rank, never in a hang or a gloo size-mismatch abort.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .config import FINGERPRINT_SIZE, EssLrConfig, describe_fingerprint
from .errors import EssPatchError, EssPatchRuntimeError, EssPatchValueError
from .estimator import InvalidInputsElsewhereError
from .result import ENCODED_SIZE, EssLrResult

__all__ = [
    "ENVELOPE_SIZE",
    "NO_CALIBRATION",
    "ConfigMismatchError",
    "agree",
    "agreed_calibration",
    "all_gather_rows",
    "all_reduce_sum",
    "all_reduce_trajectory_stats",
    "any_missing",
    "broadcast_from_last_stage",
    "check_envelopes",
    "comm_device",
    "envelope",
    "exchange_envelopes",
    "gather_rows",
    "group_size",
    "origin_rank",
]


class ConfigMismatchError(EssPatchError, ValueError):
    """Ranks of one group run different ESS-LR settings (every one of them raises)."""


def group_size(group: object | None, name: str = "process") -> int:
    """World size of ``group``; 1 for None (no group given: single-process semantics).

    Raises:
        RuntimeError: a group was given but torch.distributed is not initialized.
        ValueError: this rank is not a member of ``group`` (its peers would reduce without it).
    """
    if group is None:
        return 1
    if not dist.is_available() or not dist.is_initialized():
        raise EssPatchRuntimeError(
            "a process group was passed to ess_patch but torch.distributed is not initialized; "
            "call torch.distributed.init_process_group first or pass no group"
        )
    if dist.get_rank(group) < 0:
        raise EssPatchValueError(
            f"rank {dist.get_rank()} is not a member of the {name} group passed to ess_patch; "
            "pass the group this rank belongs to (e.g. parallel_state's getters), or None"
        )
    return dist.get_world_size(group)


def comm_device(group: object) -> torch.device:
    """The device collectives on ``group`` need: the current CUDA device for NCCL, else CPU."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_trajectory_stats(stats: torch.Tensor, cp_group: object | None) -> torch.Tensor:
    """Sum the per-trajectory ``[sum, count, non-finite]`` table over the CP ranks.

    After this every CP rank holds the table of the full sequences. No-op for CP size 1.
    Call it only after :func:`exchange_envelopes` showed that every peer has a table of the
    same height (gloo aborts the process on mismatched sizes).
    """
    if group_size(cp_group, "CP") <= 1:
        return stats
    return all_reduce_sum(stats, cp_group)


def all_reduce_sum(table: torch.Tensor, group: object) -> torch.Tensor:
    """The all-reduce itself, on a group of any size (a benchmark times it on one rank)."""
    on_comm = table.to(comm_device(group))
    dist.all_reduce(on_comm, op=dist.ReduceOp.SUM, group=group)
    return on_comm.to(table.device)


def all_gather_rows(row: torch.Tensor, group: object | None, name: str) -> torch.Tensor:
    """Gather every rank's fixed-size float64 row into ``[size, len(row)]`` (one collective)."""
    size = group_size(group, name)
    if size <= 1:
        return row.reshape(1, -1)
    return gather_rows(row, group, size)


def gather_rows(row: torch.Tensor, group: object, size: int) -> torch.Tensor:
    """The all-gather itself, on a group of any size (a benchmark times it on one rank)."""
    local = row.to(device=comm_device(group), dtype=torch.float64).contiguous()
    gathered = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(gathered, local, group=group)
    return torch.stack(gathered).to(row.device)


# --- envelopes: what every rank must know before (or with) the payload ------------------------

# Layout of an envelope row (float64): whether this rank failed, whether its log-probs are
# missing, the height of its payload, its global rank, whether a config travels, the config,
# then the calibration this rank holds (results counted, sum of their rho: see calibration.py).
_ERROR, _MISSING, _ROWS, _RANK, _HAS_CONFIG = range(5)
_CONFIG = _HAS_CONFIG + 1
_CALIBRATION = _CONFIG + FINGERPRINT_SIZE
ENVELOPE_SIZE = _CALIBRATION + 2
#: The calibration of a rank that holds none (off, or nothing counted yet).
NO_CALIBRATION = (0.0, 0.0)


def envelope(
    *,
    failed: bool,
    missing: bool = False,
    rows: int = 0,
    config: EssLrConfig | None,
    origin: int | None = None,
    calibration: tuple[float, float] = NO_CALIBRATION,
) -> torch.Tensor:
    """This rank's envelope row (see :func:`check_envelopes`). ``origin``: with ``failed``,
    the global rank the fault came from when this rank only relays it (default: this rank).
    ``calibration``: the (count, sum of rho) this rank holds, see :func:`agreed_calibration`."""
    out = torch.zeros(ENVELOPE_SIZE, dtype=torch.float64)
    out[_ERROR] = float(failed)
    out[_MISSING] = float(missing)
    out[_ROWS] = float(rows)
    out[_RANK] = float(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0.0
    if failed and origin is not None:
        out[_RANK] = float(origin)
    if config is not None:
        out[_HAS_CONFIG] = 1.0
        out[_CONFIG:_CALIBRATION] = torch.tensor(config.fingerprint(), dtype=torch.float64)
    if calibration != NO_CALIBRATION:  # else zeros already: no extra op without calibration
        out[_CALIBRATION] = float(calibration[0])
        out[_CALIBRATION + 1] = float(calibration[1])
    return out


def exchange_envelopes(row: torch.Tensor, group: object | None, name: str) -> torch.Tensor:
    """All-gather the envelopes of ``group`` (``[size, ENVELOPE_SIZE]``)."""
    return all_gather_rows(row, group, name)


def any_missing(envelopes: torch.Tensor) -> bool:
    """Whether some rank of these envelopes lacks its log-prob inputs."""
    return bool((envelopes[:, _MISSING] > 0).any())


def check_envelopes(
    envelopes: torch.Tensor, name: str, *, same_rows: bool = False
) -> Exception | None:
    """The error every rank of the group must raise, identical on each, or None.

    In this order: a rank that failed (the others raise :class:`InvalidInputsElsewhereError`
    naming it; the rank itself re-raises its own error), configs that differ
    (:class:`ConfigMismatchError` naming the fields), payload heights that differ (with
    ``same_rows``: CP peers must hold the same trajectories).
    """
    rows = envelopes.tolist()
    ranks = [int(r[_RANK]) for r in rows]
    failed = list(dict.fromkeys(rank for rank, r in zip(ranks, rows, strict=True) if r[_ERROR] > 0))
    if failed:
        error = InvalidInputsElsewhereError(
            f"ESS-LR failed on rank(s) {', '.join(map(str, failed))} (reported through the "
            f"{name} group); see the error raised there. Every rank stops here rather than "
            "waiting in a collective"
        )
        error.ranks = failed  # type: ignore[attr-defined]  # relayed by origin_rank()
        return error
    configs = [(rank, r[_CONFIG:_CALIBRATION]) for rank, r in zip(ranks, rows, strict=True)]
    configs = [(rank, fp) for (rank, fp), r in zip(configs, rows, strict=True) if r[_HAS_CONFIG]]
    if len({tuple(fp) for _, fp in configs}) > 1:
        described = {rank: describe_fingerprint(fp) for rank, fp in configs}
        first = next(iter(described.values()))
        differing = [k for k in first if len({repr(d[k]) for d in described.values()}) > 1]
        detail = "; ".join(
            f"{field}: " + ", ".join(f"rank {rank} {d[field]!r}" for rank, d in described.items())
            for field in differing
        )
        return ConfigMismatchError(
            f"ESS-LR settings differ between the ranks of the {name} group ({detail}); every "
            "rank must use the same --ess-lr-* flags / EssLrConfig, or ranks would train with "
            "different LR scales"
        )
    if same_rows and len({int(r[_ROWS]) for r in rows}) > 1:
        counts = ", ".join(
            f"rank {rank} has {int(r[_ROWS])}" for rank, r in zip(ranks, rows, strict=True)
        )
        return EssPatchValueError(
            f"the {name} ranks hold different numbers of trajectories ({counts}); CP peers must "
            "pass the same samples (each its own chunk of every sample)"
        )
    return None


def agreed_calibration(envelopes: torch.Tensor) -> tuple[float, float]:
    """The calibration every rank of these envelopes continues from: the most advanced one
    (most results counted; the first such row on a tie). A rank that restarted, or joined
    late, so catches up with its peers instead of computing another base ratio."""
    pairs = envelopes[:, _CALIBRATION:].tolist()
    count, total = max(pairs, key=lambda pair: pair[0])  # max keeps the first of equals
    return (count, total)


def origin_rank(error: BaseException) -> int:
    """The global rank a fault came from: the first one an
    :class:`InvalidInputsElsewhereError` from :func:`check_envelopes` names, else this rank."""
    ranks = getattr(error, "ranks", None)
    if isinstance(error, InvalidInputsElsewhereError) and ranks:
        return int(ranks[0])
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def broadcast_from_last_stage(
    result: EssLrResult | None,
    pp_group: object | None,
    *,
    config: EssLrConfig | None = None,
    error: BaseException | None = None,
) -> EssLrResult:
    """Give every pipeline stage the last stage's result (one all-gather when PP > 1).

    The lower-level half of ``compute_ess_lr(..., pp_group=pp_group)`` (prefer that: one
    call on every rank, and a fault on a non-last stage also reaches the other pipelines).
    Only the last stage has log-probs; the others pass None and receive its result. A stage
    that failed passes its exception as ``error``: it still joins, so that the others raise
    :class:`InvalidInputsElsewhereError` instead of waiting, and then re-raises it. With
    ``config`` the stages also check that they run the same settings. The error path is
    not optional: without it a stage whose ``compute_ess_lr`` raised never joins, and the
    other stages wait here until it exits::

        result, error = None, None
        if is_last_stage:
            try:
                result = ess_patch.compute_ess_lr(lp, rlp, masks, cp_group=cp, dp_group=dp)
            except Exception as exc:
                error = exc
        result = ess_patch.broadcast_from_last_stage(result, pp_group, error=error)

    A fault on a non-last stage passed here reaches only the stages of its own PP group.

    Raises:
        ValueError: the last stage (or a single-stage run) passed None without an error.
        InvalidInputsElsewhereError / ConfigMismatchError: see :func:`check_envelopes`.
    """
    size = group_size(pp_group, "PP")
    if size <= 1:
        if error is not None:
            raise error
        if result is None:
            raise EssPatchValueError(
                "broadcast_from_last_stage: the last pipeline stage passed nothing to broadcast"
            )
        return result
    is_last = dist.get_rank(pp_group) == size - 1
    if is_last and result is None and error is None:
        # it still joins, flagged, so that every stage raises instead of waiting
        error = EssPatchValueError(
            f"broadcast_from_last_stage: the last pipeline stage (rank {dist.get_rank()}) passed "
            "nothing; it must compute its result (compute_ess_lr) before broadcasting"
        )
    payload = torch.zeros(ENCODED_SIZE, dtype=torch.float64)
    if is_last and error is None:
        payload = torch.tensor(result.encode(), dtype=torch.float64)  # type: ignore[union-attr]
    origin = None if error is None else origin_rank(error)
    row = torch.cat([envelope(failed=error is not None, config=config, origin=origin), payload])
    rows = all_gather_rows(row, pp_group, "PP")
    if error is not None:
        raise error
    fault = check_envelopes(rows[:, :ENVELOPE_SIZE], "PP")
    if fault is not None:
        raise fault
    return result if is_last else EssLrResult.decode(rows[-1, ENVELOPE_SIZE:].tolist())


def agree(
    result: EssLrResult | None,
    error: BaseException | None,
    group: object | None,
    name: str,
    config: EssLrConfig | None,
    who: str,
    why: str,
) -> BaseException | None:
    """One all-gather over ``group`` of each rank's envelope and result, for ranks that each
    computed the same result (e.g. CP or PP peers holding the same whole rows): the error this
    rank must raise (its own, a peer's failure, other settings), or None. A group of one
    issues no collective. ``who`` names the caller in a fault's message, ``why`` says what it
    means that the peers' results differ (the message shows them).
    """
    payload = torch.zeros(ENCODED_SIZE, dtype=torch.float64)
    if error is None:
        assert result is not None
        payload = torch.tensor(result.encode(), dtype=torch.float64)
    row = torch.cat([envelope(failed=error is not None, config=config), payload])
    rows = all_gather_rows(row, group, name)
    if error is not None:
        return error
    fault = check_envelopes(rows[:, :ENVELOPE_SIZE], name)
    if fault is None and not bool((rows[:, ENVELOPE_SIZE:] == rows[0, ENVELOPE_SIZE:]).all()):
        seen = rows[:, ENVELOPE_SIZE:].tolist()
        fault = EssPatchValueError(
            f"{who}: the {name} ranks computed different ESS results ({seen}); {why}"
        )
    return fault
