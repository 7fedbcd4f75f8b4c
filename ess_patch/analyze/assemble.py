"""Group dump files by rollout and rebuild each rollout's full trajectories.

Per-rank dumps hold CP-local log-probs: the CP peers of a batch are the files with the same
``cp_size`` and identical lengths and loss masks; each contributes the zigzag chunks
:func:`ess_patch.cp_slicing.zigzag_response_ranges` assigns to its ``cp_rank``. Identical
files (tensor-parallel peers hold the same values) count once. Only one rollout's files are
in memory at a time.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cp_slicing import zigzag_response_ranges
from .read import NO_TRAIN_LOGPROBS, DumpError, DumpFile, Trajectory, load_dump

__all__ = ["Rollout", "discover", "iter_rollouts"]

_NAME = re.compile(r"^(?:eval_)?(\d+)(?:_(\d+))?\.pt$")


@dataclass
class Rollout:
    """One rollout's full-length trajectories (every DP rank's, CP slices joined)."""

    rollout_id: int
    framework: str
    cp_size: int
    num_files: int
    log_probs: list[torch.Tensor]
    rollout_log_probs: list[torch.Tensor]
    loss_masks: list[torch.Tensor]


def discover(paths: Sequence[Path]) -> dict[int, list[Path]]:
    """Files grouped by the rollout id in their name (``{rollout_id}_{rank}.pt``)."""
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            files.extend(sorted(q for q in p.rglob("*.pt") if q.is_file()))
        elif p.is_file():
            files.append(p)
        else:
            raise DumpError(f"{p}: no such file or folder")
    if not files:
        raise DumpError(f"no .pt dump files under {', '.join(map(str, paths))}")
    groups: dict[int, list[Path]] = {}
    for f in files:
        m = _NAME.match(f.name)
        # A name the writers' templates did not make: learn its id once (then dropped).
        rid = load_dump(f).rollout_id if m is None else int(m.group(1))
        groups.setdefault(rid, []).append(f)
    return dict(sorted(groups.items()))


def iter_rollouts(groups: dict[int, list[Path]]) -> Iterator[Rollout]:
    """Load and reassemble one rollout at a time; checks that the run is consistent."""
    run_shape: tuple | None = None
    for rid, files in groups.items():
        dumps = [load_dump(f) for f in files]
        for d in dumps:
            if d.rollout_id != rid:
                raise DumpError(
                    f"{d.path}: named for rollout {rid} but holds rollout {d.rollout_id}"
                )
        rollout = _assemble(rid, dumps)
        shape = (rollout.framework, rollout.cp_size, sorted(d.rank for d in dumps))
        if run_shape is None:
            run_shape = shape
        elif shape[:2] != run_shape[:2]:
            raise DumpError(
                f"rollout {rid}: {shape[0]} dumps with cp_size={shape[1]}, but earlier rollouts "
                f"were {run_shape[0]} with cp_size={run_shape[1]}: mixed runs? Analyse one run "
                "at a time"
            )
        elif shape[2] != run_shape[2]:
            missing = sorted(set(run_shape[2]) - set(shape[2]))
            extra = sorted(set(shape[2]) - set(run_shape[2]))
            raise DumpError(
                f"rollout {rid}: ranks {shape[2]} dumped, earlier rollouts had {run_shape[2]}"
                + (f"; missing rank(s) {missing}" if missing else "")
                + (f"; unexpected rank(s) {extra} (mixed runs?)" if extra else "")
            )
        yield rollout


def _assemble(rid: int, dumps: list[DumpFile]) -> Rollout:
    kinds = {d.framework for d in dumps}
    if len(kinds) > 1:
        raise DumpError(f"rollout {rid}: mixes per-rank and gathered dumps: mixed runs?")
    seen: dict[int, Path] = {}
    for d in dumps:
        if d.rank in seen:
            raise DumpError(
                f"rollout {rid}: rank {d.rank} appears twice ({seen[d.rank]} and {d.path}): "
                "mixed runs? Analyse one run's folder at a time"
            )
        seen[d.rank] = d.path
    with_lp = [d for d in dumps if d.trajectories is not None]
    if not with_lp:
        raise DumpError(f"rollout {rid} ({dumps[0].path}): {NO_TRAIN_LOGPROBS}")
    cp_sizes = {d.cp_size for d in with_lp}
    if len(cp_sizes) > 1:
        raise DumpError(f"rollout {rid}: files disagree on cp_size {sorted(map(str, cp_sizes))}")
    cp_size = cp_sizes.pop()
    if cp_size is None:
        cp_size = _legacy_cp_size(rid, with_lp)
    elif not 1 <= cp_size <= len(with_lp):
        # checked against the data before anything is sized from it: each cp_rank of a
        # batch has its own file
        raise DumpError(
            f"{with_lp[0].path}: 'cp_size' is {cp_size}, but rollout {rid} has "
            f"{len(with_lp)} file(s) with log-probs (one per cp_rank at least): a corrupt "
            "or foreign dump?"
        )
    trajs: list[Trajectory] = []
    for batch in _batches(rid, with_lp, cp_size):
        trajs.extend(_join(rid, batch, cp_size))
    return Rollout(
        rollout_id=rid,
        framework=dumps[0].framework,
        cp_size=cp_size,
        num_files=len(dumps),
        log_probs=[t.log_probs for t in trajs],
        rollout_log_probs=[t.rollout_log_probs for t in trajs],
        loss_masks=[t.loss_mask for t in trajs],
    )


def _legacy_cp_size(rid: int, dumps: list[DumpFile]) -> int:
    """Dumps from before ``cp_rank``/``cp_size`` were written: only CP=1 is unambiguous."""
    for d in dumps:
        for i, t in enumerate(d.trajectories or []):
            if t.log_probs.shape[0] != t.response_length:
                raise DumpError(
                    f"{d.path}: sample {i} holds {t.log_probs.shape[0]} of {t.response_length} "
                    "response log-probs (CP-sliced) but the dump has no cp_rank/cp_size (miles "
                    "before 2026-08, slime before format_version 2): cannot reassemble; dump "
                    "with a newer miles, or with CP=1"
                )
    return 1


def _key(d: DumpFile) -> tuple:
    trajs = d.trajectories or []
    return tuple(
        (t.total_length, t.response_length, tuple(t.loss_mask.to(torch.float64).tolist()))
        for t in trajs
    )


def _same(a: DumpFile, b: DumpFile) -> bool:
    return all(
        torch.equal(x.log_probs, y.log_probs)
        and torch.equal(x.rollout_log_probs, y.rollout_log_probs)
        for x, y in zip(a.trajectories or [], b.trajectories or [], strict=True)
    )


def _batches(rid: int, dumps: list[DumpFile], cp_size: int) -> Iterator[list[DumpFile]]:
    """The CP groups: one file per cp_rank holding the same samples, TP copies dropped."""
    by_key: dict[tuple, dict[int, list[DumpFile]]] = {}
    for d in sorted(dumps, key=lambda d: d.rank):
        cp_rank = 0 if d.cp_rank is None else d.cp_rank
        if not 0 <= cp_rank < cp_size:
            raise DumpError(f"{d.path}: cp_rank={cp_rank} outside cp_size={cp_size}")
        slot = by_key.setdefault(_key(d), {}).setdefault(cp_rank, [])
        if not any(_same(d, other) for other in slot):
            slot.append(d)
    for slices in by_key.values():
        counts = {r: len(slices.get(r, [])) for r in range(cp_size)}
        if len(set(counts.values())) != 1:
            have = sorted(f.rank for fs in slices.values() for f in fs)
            lacking = [r for r, c in counts.items() if c < max(counts.values())]
            raise DumpError(
                f"rollout {rid}: a batch dumped by rank(s) {have} lacks CP slice(s) "
                f"cp_rank={lacking} of cp_size={cp_size}: a missing rank's file?"
            )
        for j in range(counts[0]):
            yield [slices[r][j] for r in range(cp_size)]


def _join(rid: int, batch: list[DumpFile], cp_size: int) -> list[Trajectory]:
    if cp_size == 1:
        for i, t in enumerate(batch[0].trajectories or []):
            if t.log_probs.shape[0] != t.response_length:
                raise DumpError(
                    f"{batch[0].path}: sample {i}: 'log_probs' has {t.log_probs.shape[0]} "
                    f"entries but 'response_lengths' (and 'loss_masks') {t.response_length}: "
                    "with cp_size=1 each response token has one"
                )
        return list(batch[0].trajectories or [])
    out = []
    for i, pieces in enumerate(zip(*(d.trajectories or [] for d in batch), strict=True)):
        first = pieces[0]
        resp, total = first.response_length, first.total_length
        lp = torch.zeros(resp, dtype=first.log_probs.dtype)
        rlp = torch.zeros(resp, dtype=first.rollout_log_probs.dtype)
        for cp_rank, (d, t) in enumerate(zip(batch, pieces, strict=True)):
            if d.qkv_format != "thd":
                raise DumpError(
                    f"{d.path}: qkv_format={d.qkv_format!r}: only packed 'thd' CP dumps can be "
                    "reassembled (the padded length of 'bshd' is not in the dump)"
                )
            ranges = zigzag_response_ranges(total, resp, cp_rank, cp_size)
            n = sum(b - a for a, b in ranges)
            if t.log_probs.shape[0] != n:
                raise DumpError(
                    f"{d.path}: sample {i} holds {t.log_probs.shape[0]} log-probs but cp_rank "
                    f"{cp_rank} of {cp_size} should hold {n} of {resp}: not a CP-local slice"
                )
            offset = 0
            for a, b in ranges:
                lp[a:b] = t.log_probs[offset : offset + b - a]
                rlp[a:b] = t.rollout_log_probs[offset : offset + b - a]
                offset += b - a
        out.append(Trajectory(lp, rlp, first.loss_mask, total, resp))
    return out
