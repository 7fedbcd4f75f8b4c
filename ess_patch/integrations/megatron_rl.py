"""Megatron-RL (NVIDIA Megatron-LM's ``megatron/rl``, ``train_rl.py``): flags, ESS hook, metrics.

Megatron-LM ``core_v0.16.1`` facts this relies on (detected by symbol and parameter name,
never by commit):

- ``megatron.training.arguments.parse_args(extra_args_provider=None, ...)``; ``initialize``
  imports it by name (``megatron.training.initialize.parse_args``), so both sites are wrapped.
- ``megatron.rl.rl_utils.prepare_data_for_update`` runs once per rollout collection on every
  rank; the old (train) log-probs are computed there for the rank's trajectories (rollouts
  split over the data-parallel group without CP), broadcast over PP, so every stage and
  every CP peer holds them whole. With inference log-probs it then calls, by module-global
  name, either ``align_unpacked_inference_logprobs(inference_logprobs,
  old_logprobs_for_data, generation_masks, group_stats)`` (unpacked) or
  ``compute_packed_inference_logprobs_stats(old_logprobs, packed_inference_logprobs,
  packed_loss_mask, group_stats)`` (packed; the bins are in
  ``get_rl_runtime_state().packing_context.packing_info``). The ESS is computed in those,
  from the same tensors Megatron-RL's own mismatch statistics use, and armed for every
  optimizer step until the next collection; ``train_step`` runs the scheduler after
  ``optimizer.step()``, whose megatron-core wrapper has restored the LRs by then.
- ``maybe_log_training_metrics(group_stats, current_iteration, ..., wandb_writer, tb_writer)``
  logs the collection's flat-named metrics (``mean_reward``, ``mean_piold_to_inf_prob``...);
  the ESS metrics go to the same writers under the same flat naming.

Shadow mode (``--ess-lr-shadow`` / ``ESS_LR_SHADOW``) runs the same hooks and collectives but
keeps the result for the logs only (``ess_lr_shadow_scale``), never arming it.
"""

from __future__ import annotations

import argparse
import inspect
import logging
from collections.abc import Callable
from typing import Any

from ..patching import MissingTargetError, Target
from ..state import STATE, arm, armed, disarm
from . import Integration
from .binding import bind, parameters
from .rl_hooks import (
    Framework,
    Groups,
    add_ess_arguments,
    config_from_args,
    ess_metrics,
    shadow_requested,
    validate,
)

__all__ = ["MEGATRON_RL", "MEGATRON_RL_FRAMEWORK"]

logger = logging.getLogger(__name__)

SUPPORTED = "Megatron-LM core_v0.16.x (megatron/rl with prepare_data_for_update)"
NAME = "megatron_rl"

_RL_UTILS = "megatron.rl.rl_utils"
_PACKING = "megatron.rl.sequence_packing_utils"

#: Parameters each wrapped function must have (bound by name, not position).
_SIGNATURES: dict[str, tuple[str, ...]] = {
    "parse_args": ("extra_args_provider",),
    "align_unpacked_inference_logprobs": (
        "inference_logprobs",
        "old_logprobs_for_data",
        "generation_masks",
    ),
    "compute_packed_inference_logprobs_stats": (
        "old_logprobs",
        "packed_inference_logprobs",
        "packed_loss_mask",
    ),
    "prepare_data_for_update": (),
    "maybe_log_training_metrics": ("current_iteration", "wandb_writer", "tb_writer"),
}


def _groups() -> Groups:
    from megatron.core import parallel_state as mpu

    dp_group = mpu.get_data_parallel_group(with_context_parallel=False)
    pp_size = mpu.get_pipeline_model_parallel_world_size()
    # CP peers hold the same trajectories' whole log-probs: no CP reduction (cp_group None).
    return Groups(
        cp_group=None,
        cp_rank=mpu.get_context_parallel_rank(),
        cp_size=mpu.get_context_parallel_world_size(),
        dp_group=dp_group if mpu.get_data_parallel_world_size() > 1 else None,
        pp_group=mpu.get_pipeline_model_parallel_group() if pp_size > 1 else None,
        is_pp_last=mpu.is_pipeline_last_stage(),
    )


def _no_input_reason(args: argparse.Namespace) -> str | None:
    if not getattr(args, "rl_inference_logprobs_is_correction", False) and not getattr(
        args, "rl_partial_rollouts", False
    ):
        return (
            "--rl-inference-logprobs-is-correction and --rl-partial-rollouts are both off "
            "(the run keeps no inference log-probs to compare with; turn on "
            "--rl-inference-logprobs-is-correction)"
        )
    return None


MEGATRON_RL_FRAMEWORK = Framework(
    name=NAME,
    groups=_groups,
    no_input_reason=_no_input_reason,
    unsupported_reason=lambda _args: None,
)


# --- binding by parameter name -----------------------------------------------------------------


def _bind(wrapped: Callable[..., Any], name: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by parameter name (:func:`binding.bind`), or a clear error if the
    host's shape differs."""
    names = parameters(wrapped)
    missing = [p for p in _SIGNATURES[name] if names and p not in names]
    if missing:
        raise MissingTargetError(
            f"ess-patch ({NAME}): {wrapped.__module__}.{name} has no parameter "
            f"{', '.join(missing)}. Supported: {SUPPORTED}"
        )
    call = bind(wrapped, args, kwargs)
    return dict(kwargs) if call is None else dict(call.arguments)


#: What the hooks use besides the wrapped functions: module -> names it must define.
_FEATURES: dict[str, tuple[str, ...]] = {
    _RL_UTILS: (
        "prepare_data_for_update",
        "align_unpacked_inference_logprobs",
        "maybe_log_training_metrics",
        "get_rl_runtime_state",
    ),
    _PACKING: ("compute_packed_inference_logprobs_stats", "PackingInfo"),
}


def check_host_shape() -> None:
    """At start-up (``parse_args`` with ``--use-ess-lr``): the host has every symbol and
    parameter the hooks rely on, detected by feature, not by version.

    Raises:
        MissingTargetError: naming the missing module, symbol or parameter and the
            supported range.
    """
    import importlib

    for module_name, names in _FEATURES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise MissingTargetError(
                f"ess-patch ({NAME}): --use-ess-lr needs {module_name}, which does not import "
                f"({exc}). Supported: {SUPPORTED}"
            ) from exc
        for name in names:
            value = getattr(module, name, None)
            if value is None:
                raise MissingTargetError(
                    f"ess-patch ({NAME}): {module_name}.{name} is missing. Supported: {SUPPORTED}"
                )
            wanted = _SIGNATURES.get(name, ())
            params = inspect.signature(value).parameters if wanted else {}
            missing = [p for p in wanted if p not in params]
            if missing:
                raise MissingTargetError(
                    f"ess-patch ({NAME}): {module_name}.{name} has no parameter "
                    f"{', '.join(missing)}. Supported: {SUPPORTED}"
                )


def _host_args() -> Any:
    from megatron.training.global_vars import get_args

    return get_args()


def _enabled() -> tuple[Any, bool] | None:
    """(the host args, shadow mode?) when ``--use-ess-lr`` or ``--ess-lr-shadow`` is on, else
    None (the hooks call straight through)."""
    args = _host_args()
    if getattr(args, "use_ess_lr", False):
        return args, False
    if shadow_requested(args):
        return args, True
    return None


# --- the ESS of one collection -----------------------------------------------------------------


def _agree_on_errors(error: BaseException | None) -> None:
    """One all-reduce over the world: if any rank's input was bad, every rank raises.

    Every rank runs ``prepare_data_for_update`` and reaches this point together, so no rank
    is left waiting in a later collective for a peer that failed.
    """
    import torch
    import torch.distributed as dist

    from ..reduction import comm_device

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    flag = torch.tensor(
        [0.0 if error is None else float(world - rank)],
        dtype=torch.float64,
        device=comm_device(None),
    )
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if error is not None:
        raise error
    if flag.item() > 0:
        culprit = world - int(flag.item())
        raise ValueError(
            f"ess-patch ({NAME}): rank {culprit} had bad ESS-LR input in this rollout "
            "collection (its own error is in its log); stopping on every rank so none hangs"
        )


def _compute_and_arm(
    args: Any, build: Callable[[], tuple[list, list, list]], shadow: bool = False
) -> None:
    """``build()`` -> per-trajectory (train, inference, mask) lists on this rank; arm the ESS
    (shadow mode: keep it for the logs only)."""
    import torch.distributed as dist

    from ..compute import compute_ess_lr

    error: BaseException | None = None
    inputs = None
    try:
        inputs = build()
    except (TypeError, ValueError, IndexError, AttributeError) as exc:
        error = exc if isinstance(exc, ValueError) else ValueError(f"ess-patch ({NAME}): {exc}")
    _agree_on_errors(error)
    groups = MEGATRON_RL_FRAMEWORK.groups()
    payload: list[Any] = [None, None]  # [error message, result]
    local_error: BaseException | None = None
    if groups.is_pp_last:
        try:
            payload[1] = compute_ess_lr(
                *inputs, config=config_from_args(args), dp_group=groups.dp_group
            )
        except Exception as exc:  # sent to the other stages, then re-raised here
            if groups.pp_group is None:
                raise
            payload[0] = f"{type(exc).__name__}: {exc}"
            local_error = exc
    if groups.pp_group is not None:
        last = dist.get_process_group_ranks(groups.pp_group)[-1]
        dist.broadcast_object_list(payload, src=last, group=groups.pp_group)
        if groups.is_pp_last and local_error is not None:
            raise local_error
        if payload[0] is not None:
            raise ValueError(
                f"ess-patch ({NAME}): the last pipeline stage failed to compute the ESS: "
                f"{payload[0]}"
            )
    if shadow:
        STATE.shadow = payload[1]
        logger.debug("ess-patch (%s): shadow %s", NAME, payload[1])
        return
    result = arm(payload[1])
    logger.debug("ess-patch (%s): armed %s", NAME, result)


def _rows(old: Any, inference: Any, mask: Any) -> tuple[list, list, list]:
    if old.shape != inference.shape or mask.shape != old.shape:
        raise ValueError(
            f"ess-patch ({NAME}): old log-probs {tuple(old.shape)}, inference log-probs "
            f"{tuple(inference.shape)} and mask {tuple(mask.shape)} must have the same shape"
        )
    return list(old.unbind(0)), list(inference.unbind(0)), list(mask.unbind(0))


def _unpacked_inputs(
    inference_list: Any, old: Any, generation_masks: Any, padded: Any
) -> tuple[list, list, list]:
    """Rows = trajectories; the mask is upstream's (generated tokens, shifted by one)."""
    import torch

    if inference_list is None:
        raise ValueError(
            f"ess-patch ({NAME}): the rollouts carry no inference log-probs "
            "(inference_logprobs is None)"
        )
    if old.dim() != 2 or len(inference_list) != old.shape[0]:
        raise ValueError(
            f"ess-patch ({NAME}): {len(inference_list)} inference log-prob tensors for old "
            f"log-probs of shape {tuple(old.shape)} (one per trajectory expected)"
        )
    mask = generation_masks[:, 1:].bool()
    width = old.shape[1]
    if mask.shape[1] >= width:
        mask = mask[:, :width]
    else:
        mask = torch.nn.functional.pad(mask, (0, width - mask.shape[1]), value=False)
    if mask.shape[0] != old.shape[0]:
        raise ValueError(
            f"ess-patch ({NAME}): generation masks for {mask.shape[0]} trajectories, old "
            f"log-probs for {old.shape[0]}"
        )
    return _rows(old, padded, mask)


def _packed_inputs(
    old: Any, packed_inference: Any, packed_loss_mask: Any
) -> tuple[list, list, list]:
    """One trajectory per packed sequence: its positions ``[start, start + len - 1)`` in the
    log-prob row (position p predicts token p + 1; the last one would predict the next
    sequence's first token)."""
    from megatron.rl.rl_utils import get_rl_runtime_state

    context = getattr(get_rl_runtime_state(), "packing_context", None)
    info = getattr(context, "packing_info", None)
    if info is None:
        raise ValueError(
            f"ess-patch ({NAME}): sequence packing without a packing context "
            "(get_rl_runtime_state().packing_context.packing_info): the trajectory "
            "boundaries are unknown"
        )
    old, packed_inference = old.cpu(), packed_inference.cpu()
    mask = packed_loss_mask.cpu()[:, 1:].bool()
    if old.shape != packed_inference.shape or mask.shape != old.shape:
        raise ValueError(
            f"ess-patch ({NAME}): packed old log-probs {tuple(old.shape)}, inference "
            f"log-probs {tuple(packed_inference.shape)} and loss mask "
            f"{tuple(packed_loss_mask.shape)} (minus its first column) do not line up"
        )
    # Upstream pads each trajectory's inference log-probs with zeros to seq_length before
    # packing, so the appended eod (which inference never scored) reads 0 in the packed
    # tensor; the unpacked path reuses the train value there. Do the same here (an exact
    # 0.0 from inference is p = 1, where the train value is ~0 too), so that packing does
    # not change the ESS.
    packed_inference = packed_inference.where(packed_inference != 0, old)
    if len(info.bin_seq_indices) != old.shape[0]:
        raise ValueError(
            f"ess-patch ({NAME}): {len(info.bin_seq_indices)} bins in the packing info, "
            f"{old.shape[0]} rows of packed log-probs"
        )
    lps, rlps, masks = [], [], []
    for b, seqs in enumerate(info.bin_seq_indices):
        for j, seq in enumerate(seqs):
            start = info.seq_starts[b][j]
            end = min(start + info.seq_lengths[seq] - 1, old.shape[1])
            lps.append(old[b, start:end])
            rlps.append(packed_inference[b, start:end])
            masks.append(mask[b, start:end])
    return lps, rlps, masks


# --- wrappers ----------------------------------------------------------------------------------


def _guarded(wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run the upstream function; if it fails, every rank learns it (then re-raise)."""
    try:
        return wrapped(*args, **kwargs)
    except Exception as exc:
        _agree_on_errors(exc)
        raise


def align_wrapper(wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict) -> Any:
    """Unpacked: after upstream aligns the inference log-probs, arm this collection's ESS."""
    enabled = _enabled()
    if enabled is None:
        return wrapped(*args, **kwargs)
    host, shadow = enabled
    call = _bind(wrapped, "align_unpacked_inference_logprobs", args, kwargs)
    if call["inference_logprobs"] is None:  # before upstream fails on it, on this rank only
        _agree_on_errors(
            ValueError(
                f"ess-patch ({NAME}): the rollouts carry no inference log-probs "
                "(inference_logprobs is None)"
            )
        )
    padded = _guarded(wrapped, args, kwargs)
    _compute_and_arm(
        host,
        lambda: _unpacked_inputs(
            call["inference_logprobs"],
            call["old_logprobs_for_data"],
            call["generation_masks"],
            padded,
        ),
        shadow,
    )
    return padded


def packed_stats_wrapper(
    wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict
) -> Any:
    """Packed: beside upstream's mismatch statistics, arm this collection's ESS."""
    enabled = _enabled()
    if enabled is None:
        return wrapped(*args, **kwargs)
    host, shadow = enabled
    call = _bind(wrapped, "compute_packed_inference_logprobs_stats", args, kwargs)
    out = _guarded(wrapped, args, kwargs)
    _compute_and_arm(
        host,
        lambda: _packed_inputs(
            call["old_logprobs"], call["packed_inference_logprobs"], call["packed_loss_mask"]
        ),
        shadow,
    )
    return out


def prepare_wrapper(wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict) -> Any:
    """A new collection replaces the last one's ESS; say so when it armed none."""
    if _enabled() is None:
        return wrapped(*args, **kwargs)
    disarm()
    STATE.shadow = None
    out = wrapped(*args, **kwargs)
    if armed() is None and STATE.shadow is None:
        logger.warning(
            "ess-patch (%s): this rollout collection had no inference log-probs; ESS-LR "
            "is a no-op for it (the LR is the scheduled one)",
            NAME,
        )
    return out


def log_metrics_wrapper(
    wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict
) -> Any:
    """Add the ESS metrics (armed, or shadow mode's) to the collection's wandb / tensorboard
    record."""
    out = wrapped(*args, **kwargs)
    metrics = ess_metrics()
    if not metrics:
        return out
    call = _bind(wrapped, "maybe_log_training_metrics", args, kwargs)
    step = call["current_iteration"]
    if call.get("wandb_writer"):
        call["wandb_writer"].log(metrics, step=step)
    if call.get("tb_writer"):
        for key, value in metrics.items():
            call["tb_writer"].add_scalar(key, value, step)
    return out


def parse_args_wrapper(
    wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict
) -> Any:
    """Wrap ``parse_args(extra_args_provider=None, ...)``: add our flags; validate them for a
    Megatron-RL run.

    A Megatron-RL run is recognised by what it runs, ``--perform-rl-step`` (``train_rl.py``'s
    recipes set it; Megatron's own validation keys the RL step on it), never by which modules
    are imported: miles and slime call the same Megatron ``parse_args`` on trees that ship
    ``megatron/rl`` (``megatron.training.training`` imports ``megatron.rl.rl_utils``), and
    they validate ``--use-ess-lr`` with their own rules.
    """
    call = _bind(wrapped, "parse_args", args, kwargs)
    user = call.get("extra_args_provider")
    host_flags: list[bool] = []

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if user is not None:
            returned = user(parser)
            parser = parser if returned is None else returned
        # the host (miles, slime, a fork) declared --use-ess-lr itself: it owns the validation
        host_flags.append("--use-ess-lr" in parser._option_string_actions)
        return add_ess_arguments(parser)

    call["extra_args_provider"] = provider
    parsed = wrapped(**call)
    requested = getattr(parsed, "use_ess_lr", False) or shadow_requested(parsed)
    if getattr(parsed, "perform_rl_step", False):
        validate(MEGATRON_RL_FRAMEWORK, parsed)
        if requested:
            check_host_shape()
    elif requested and host_flags and not host_flags[0]:
        raise ValueError(
            "--use-ess-lr (or --ess-lr-shadow) was given to Megatron's parse_args, but this is "
            "not a Megatron-RL run (no --perform-rl-step) and no RL framework that ess-patch "
            "integrates with (miles, slime) declared the flag: nothing would measure the ESS. "
            "Add --perform-rl-step for Megatron-RL (train_rl.py), or launch through miles / "
            f"slime with ess_patch.install() ({NAME})"
        )
    return parsed


MEGATRON_RL = Integration(
    name=NAME,
    distribution=None,
    supported=SUPPORTED,
    targets=(
        # the order of the call sites in the patches/ series' message
        Target(
            "megatron.training.arguments",
            "",
            "parse_args",
            parse_args_wrapper,
            decorator="megatron_rl_parse_args",
        ),
        Target(
            _RL_UTILS,
            "",
            "prepare_data_for_update",
            prepare_wrapper,
            decorator="megatron_rl_prepare",
        ),
        Target(
            _RL_UTILS,
            "",
            "align_unpacked_inference_logprobs",
            align_wrapper,
            decorator="megatron_rl_align",
        ),
        Target(
            _PACKING,
            "",
            "compute_packed_inference_logprobs_stats",
            packed_stats_wrapper,
            decorator="megatron_rl_packed_stats",
        ),
        Target(_RL_UTILS, "", "compute_packed_inference_logprobs_stats", packed_stats_wrapper),
        Target(
            _RL_UTILS,
            "",
            "maybe_log_training_metrics",
            log_metrics_wrapper,
            decorator="megatron_rl_log_metrics",
        ),
        Target(
            "megatron.training.initialize", "", "parse_args", parse_args_wrapper, required=False
        ),
    ),
)
