"""Load one train-data dump file safely and classify it.

Formats (from the frameworks' own writers):

* per-rank (miles ``save_debug_train_data_for_rank``; slime up to v0.3.1):
  ``{rollout_id, rank, rollout_data}`` with CP-local ``log_probs``/``rollout_log_probs``,
  full-length ``loss_masks``; miles since 2026-08 adds ``cp_rank``, ``cp_size``, ``qkv_format``.
* gathered (slime since ``format_version`` 2): ``{format_version, rollout_id, rank, samples,
  dp_shards}``; one dict per sample with full-length (CP-gathered) tensors.
* rollout-only (``--save-debug-rollout-data``): ``{rollout_id, samples}`` without train
  log-probs: refused.
"""

from __future__ import annotations

import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import EssPatchError

__all__ = ["NO_TRAIN_LOGPROBS", "DumpError", "DumpFile", "Trajectory", "load_dump"]

NO_TRAIN_LOGPROBS = (
    "has no train log-probs ('log_probs'): ESS needs both the trainer's and the rollout "
    "engine's log-probs. Dump with --save-debug-train-data and without --use-rollout-logprobs "
    "(miles), or with slime's --save-debug-train-data (slime recomputes or captures them)"
)


class DumpError(EssPatchError, ValueError):
    """A dump file or a set of them cannot be analysed; the message says which and why."""


@dataclass
class Trajectory:
    """One sample's (possibly CP-local) tensors."""

    log_probs: torch.Tensor
    rollout_log_probs: torch.Tensor
    loss_mask: torch.Tensor
    total_length: int
    response_length: int


@dataclass
class DumpFile:
    """What one file holds: a rollout's trajectories from one rank (or all, gathered)."""

    path: Path
    framework: str  # "per-rank" or "gathered"
    rollout_id: int
    rank: int
    cp_rank: int | None
    cp_size: int | None
    qkv_format: str
    trajectories: list[Trajectory] | None  # None: no train log-probs (e.g. a non-last PP stage)


def load_dump(path: Path) -> DumpFile:
    """Load ``path`` with ``torch.load(weights_only=True)`` and classify it.

    Raises:
        DumpError: truncated, foreign, rollout-only, or without train log-probs.
    """
    # torch.save writes a zip archive; a cut-off copy loses its central directory.
    if not zipfile.is_zipfile(path):
        raise DumpError(
            f"{path}: not a torch.save archive (truncated or foreign file?); expected a "
            "--save-debug-train-data dump"
        )
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # weights_only refuses arbitrary classes: a dump holding them is not one of ours.
        raise DumpError(
            f"{path}: refused by torch.load(weights_only=True) (it holds objects other than "
            f"tensors, numbers, strings, lists and dicts; not loading untrusted code): {exc}"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as exc:
        raise DumpError(
            f"{path}: not a readable torch file (truncated or foreign?): {exc}"
        ) from None
    if not isinstance(obj, dict) or "rollout_id" not in obj:
        raise DumpError(
            f"{path}: not a train-data dump (expected a dict with 'rollout_id'; got "
            f"{type(obj).__name__})"
        )
    if "rollout_data" in obj:
        return _per_rank(path, obj)
    if "samples" in obj and "format_version" in obj:
        return _gathered(path, obj)
    if "samples" in obj:
        raise DumpError(
            f"{path}: a rollout dump (--save-debug-rollout-data): it {NO_TRAIN_LOGPROBS[4:]}"
        )
    raise DumpError(f"{path}: unknown dump layout (keys: {sorted(map(str, obj))})")


def _int(path: Path, obj: dict, key: str, default: int | None = None) -> int | None:
    value = obj.get(key, default)
    if value is None:
        return None
    return _as_int(path, f"'{key}'", value)


def _as_int(path: Path, field: str, value: object, *, minimum: int | None = None) -> int:
    """An integer field (a Python int or a one-element integer tensor), or one line naming
    the file and the field."""
    if (
        isinstance(value, torch.Tensor)
        and value.numel() == 1
        and not value.dtype.is_floating_point
        and not value.dtype.is_complex
        and value.dtype != torch.bool
    ):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int):
        shown = _describe(value)
        raise DumpError(f"{path}: {field} is {shown}, expected an integer")
    if minimum is not None and value < minimum:
        raise DumpError(f"{path}: {field} is {value}, expected an integer >= {minimum}")
    return value


def _describe(value: object) -> str:
    """A short description of a bad value (never the whole of a large one)."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__} ({text[:40]}...)"


def _per_rank(path: Path, obj: dict) -> DumpFile:
    data = obj["rollout_data"]
    if not isinstance(data, dict):
        raise DumpError(f"{path}: 'rollout_data' is {type(data).__name__}, expected a dict")
    # Non-last pipeline stages dump without log-probs; the rollout is judged as a whole.
    trajectories = None if data.get("log_probs") is None else _columns(path, data)
    return DumpFile(
        path=path,
        framework="per-rank",
        rollout_id=_int(path, obj, "rollout_id"),
        rank=_int(path, obj, "rank", 0),
        cp_rank=_int(path, obj, "cp_rank"),
        cp_size=_int(path, obj, "cp_size"),
        qkv_format=str(obj.get("qkv_format") or "thd"),
        trajectories=trajectories,
    )


def _gathered(path: Path, obj: dict) -> DumpFile:
    samples = obj["samples"]
    if not isinstance(samples, list):
        raise DumpError(f"{path}: 'samples' is {type(samples).__name__}, expected a list")
    columns: dict[str, list] = {}
    for i, sample in enumerate(samples):
        if not isinstance(sample, dict):
            raise DumpError(f"{path}: samples[{i}] is {type(sample).__name__}, expected a dict")
        for key in (
            "log_probs",
            "rollout_log_probs",
            "loss_masks",
            "total_lengths",
            "response_lengths",
        ):
            columns.setdefault(key, []).append(sample.get(key))
    data = {k: (None if any(v is None for v in vs) else vs) for k, vs in columns.items()}
    if not samples:
        data = {k: [] for k in columns} | {"log_probs": [], "rollout_log_probs": []}
    return DumpFile(
        path=path,
        framework="gathered",
        rollout_id=_int(path, obj, "rollout_id"),
        rank=_int(path, obj, "rank", 0),
        cp_rank=0,
        cp_size=1,  # slime gathers the CP fields before writing
        qkv_format="thd",
        trajectories=_columns(path, data) if samples else [],
    )


def _columns(path: Path, data: dict) -> list[Trajectory]:
    if data.get("log_probs") is None:
        raise DumpError(f"{path}: {NO_TRAIN_LOGPROBS}")
    for key in ("rollout_log_probs", "loss_masks", "total_lengths", "response_lengths"):
        if data.get(key) is None:
            raise DumpError(f"{path}: has no '{key}'; cannot compute the train/rollout ratio")
    keys = ("log_probs", "rollout_log_probs", "loss_masks", "total_lengths", "response_lengths")
    for key in keys:
        if not isinstance(data[key], (list, tuple)):
            raise DumpError(
                f"{path}: '{key}' is {_describe(data[key])}, expected a list with one entry "
                "per sample"
            )
    cols = [data[k] for k in keys]
    n = len(cols[0])
    if any(len(c) != n for c in cols):
        raise DumpError(
            f"{path}: per-sample columns differ in length ({[len(c) for c in cols]}): "
            "truncated or inconsistent dump"
        )
    out = []
    for i, (lp, rlp, mask, total, resp) in enumerate(zip(*cols, strict=True)):
        for name, t in (("log_probs", lp), ("rollout_log_probs", rlp), ("loss_masks", mask)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise DumpError(
                    f"{path}: sample {i}: '{name}' is {_describe(t)}, expected a 1-D tensor"
                )
        for name, t in (("log_probs", lp), ("rollout_log_probs", rlp)):
            if not t.dtype.is_floating_point:
                raise DumpError(
                    f"{path}: sample {i}: '{name}' has dtype {t.dtype}, expected floating point "
                    "log-probs"
                )
        if mask.dtype.is_complex:
            raise DumpError(
                f"{path}: sample {i}: 'loss_masks' has dtype {mask.dtype}, expected a real "
                "(bool, integer or float) mask"
            )
        total = _as_int(path, f"sample {i}: 'total_lengths'", total, minimum=1)
        resp = _as_int(path, f"sample {i}: 'response_lengths'", resp, minimum=0)
        if resp > total:
            raise DumpError(
                f"{path}: sample {i}: 'response_lengths' is {resp}, more than its "
                f"'total_lengths' {total}"
            )
        if lp.shape != rlp.shape:
            raise DumpError(
                f"{path}: sample {i}: log_probs has {lp.shape[0]} tokens, rollout_log_probs "
                f"{rlp.shape[0]}"
            )
        if mask.shape[0] != resp:
            raise DumpError(
                f"{path}: sample {i}: loss_masks has {mask.shape[0]} entries, response_length "
                f"is {resp}"
            )
        out.append(Trajectory(lp, rlp, mask, total, resp))
    return out
