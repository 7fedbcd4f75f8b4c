"""Megatron-RL (NVIDIA Megatron-LM's ``megatron/rl``, ``train_rl.py``): flags, ESS hook, metrics.

What this relies on, detected by symbol and parameter name (``MEGATRON_RL_HISTORY``), never by
commit; tested on core_v0.16.1, core_v0.17.1, core_v0.18.2 and radixark's miles-main fork:

- ``megatron.training.arguments.parse_args(extra_args_provider=None, ...)``; ``initialize``
  imports it by name (``megatron.training.initialize.parse_args``), so both sites are wrapped.
  A Megatron-RL run is one with ``--perform-rl-step``.
- ``megatron.rl.rl_utils.prepare_data_for_update`` runs once per rollout collection on every
  rank; the old (train) log-probs are computed there for the rank's rows (rollouts split over
  the data-parallel group without CP) and broadcast over PP, so every stage and every CP peer
  holds them whole (on main, CP RL all-gathers them back to whole rows). With inference
  log-probs it calls, by module-global name, ``align_unpacked_inference_logprobs(
  inference_logprobs, old_logprobs_for_data, generation_masks, group_stats)`` (unpacked) or
  ``compute_packed_inference_logprobs_stats(old_logprobs, packed_inference_logprobs,
  packed_loss_mask, group_stats[, filled_mask])`` (packed; the bins are in
  ``get_rl_runtime_state().packing_context``). The ESS is computed there and armed for every
  optimizer step until the next collection.
- Which positions count: those the inference engine scored, i.e. the i-th inference log-prob
  of a row scores its i-th generated token (the appended eod has none). Packed, where the
  release passes ``filled_mask`` (core_v0.19 on), only among the positions it marks. A row with no
  such position (main's all-pad rows, inference log-probs ``None``; rows without generated
  tokens) is not a trajectory. A trajectory is a training row, as in each release: one turn of
  a multi-turn rollout up to core_v0.19 (each turn is its own row with the rollout's
  advantage), the whole rollout on main (one row with a multi-region generation mask).
- ``maybe_log_training_metrics`` logs the collection's flat-named metrics (``mean_reward``...);
  the ESS metrics go to the same writers: its ``wandb_writer`` / ``tb_writer`` parameters up to
  core_v0.16.x, Megatron's global writers since core_v0.17.0.

Every rank enters the same collectives (DP inside ``compute_ess_lr``, then one gather over CP
and one over PP of each rank's envelope and result), so that a fault on any rank is an error on
all of them, and CP peers or PP stages that computed different results (rows that were not
whole) are an error too. Shadow mode (``--ess-lr-shadow`` / ``ESS_LR_SHADOW``) runs the same
hooks and collectives but keeps the result for the logs only (``ess_lr_shadow_scale``).

VCPO's baseline (``--use-ess-baseline`` / ``--ess-baseline-shadow`` / ``--ess-baseline-path``,
``ESS_LR_BASELINE*``; on with or without ESS-LR), ``integrations/megatron_rl_baseline.py``:

- ``prepare_data_for_update(model, rollouts, tokenizer, ...)``: before its body, the norm pass
  on this DP rank's share of the rollouts and ``b*`` of every group (``grpo_group_size``
  consecutive rollouts, the outer list), groups split over DP reduced; after it, the read-back.
- ``calculate_grpo_advantages(rewards, num_turns)`` (core_v0.16.1 to core_v0.18.2; install()
  only, no ``patches/`` call site): ``b*`` replaces the group mean, upstream's std kept.
- ``maybe_log_training_metrics``: the read-back (up to core_v0.16 it runs inside the
  collection), then ``ess_baseline_*`` beside the ESS metrics, in the same writers.

Refused at parse time by name (:func:`validate_megatron_rl_baseline`): CP, virtual
pipelines (pipeline stages run the norm pass together), ``--grpo-group-size`` below 2, a
tree without ``calculate_grpo_advantages`` (radixark's fork computes the advantages
inline), an unpatched routine (a tree patched with the ``patches/`` series only); at run
time, on every rank: multi-turn rollouts, groups of unequal size, a collection that does not
split evenly over DP.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

from .. import collapse_warning
from ..errors import EssPatchValueError
from ..guard import refuse
from ..patching import MissingTargetError, Target, is_ours
from ..state import STATE, armed, disarm
from . import Integration
from .baseline_flags import ENV_ON, ENV_SHADOW, baseline_mode, baseline_path, parallel_problems
from .binding import bind
from .flags import compose_custom_arguments, config_from_args, shadow_requested
from .framework import Framework, ess_metrics, megatron_groups, validate
from .shapes import Aspect, Feature, History, Shape

__all__ = ["MEGATRON_RL", "MEGATRON_RL_FRAMEWORK", "MEGATRON_RL_HISTORY"]

logger = logging.getLogger(__name__)

SUPPORTED = (
    "Megatron-LM core_v0.16.1 to core_v0.18.2 (megatron/rl with prepare_data_for_update) and "
    "radixark's miles-main fork @2e64d788b; core_v0.19 / main shapes detected by feature"
)
NAME = "megatron_rl"
#: the upstream commit (Megatron-LM tag core_v0.16.1) the newest patches/ series and the
#: framework tests are cut from
SNAPSHOT = "55ac7082517c3878ae653c07c09c534b8aed49f6"

_RL_UTILS = "megatron.rl.rl_utils"
_PACKING = "megatron.rl.sequence_packing_utils"
_ARGUMENTS = "megatron.training.arguments"
_GLOBALS = "megatron.training.global_vars"
_UNPACKED = ("inference_logprobs", "old_logprobs_for_data", "generation_masks")
_PACKED = ("old_logprobs", "packed_inference_logprobs", "packed_loss_mask")


# --- the shapes Megatron-RL has had ------------------------------------------------------------


def _writers_from_parameters(call: Mapping[str, Any]) -> tuple[Any, Any]:
    return call.get("wandb_writer"), call.get("tb_writer")


def _global_writers(_call: Mapping[str, Any]) -> tuple[Any, Any]:
    from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

    return get_wandb_writer(), get_tensorboard_writer()


_PACKING_CONTEXT = (Feature(_RL_UTILS, "get_rl_runtime_state"), Feature(_PACKING, "PackingInfo"))

MEGATRON_RL_HISTORY = History(
    framework=NAME,
    supported=SUPPORTED,
    aspects=(
        Aspect(
            "arguments",
            (
                Shape(
                    "parse_args(extra_args_provider)",
                    "core_v0.16.1 to main",
                    (Feature(_ARGUMENTS, "parse_args", ("extra_args_provider",)),),
                ),
            ),
            phrase="flags via {label}",
        ),
        Aspect(
            "collection",
            (
                Shape(
                    "prepare_data_for_update",
                    "core_v0.16.1 to main",
                    (Feature(_RL_UTILS, "prepare_data_for_update"),),
                ),
            ),
            phrase="one ESS per {label}",
        ),
        Aspect(
            "unpacked",
            (
                Shape(
                    f"align_unpacked_inference_logprobs({', '.join(_UNPACKED)})",
                    "core_v0.16.1 to main",
                    (Feature(_RL_UTILS, "align_unpacked_inference_logprobs", _UNPACKED),),
                ),
            ),
            phrase="unpacked via {label}",
        ),
        Aspect(
            "packed",
            (
                Shape(
                    "compute_packed_inference_logprobs_stats(..., filled_mask): the positions "
                    "the release marks filled",
                    "core_v0.19.0 to main",
                    (
                        Feature(
                            _PACKING,
                            "compute_packed_inference_logprobs_stats",
                            (*_PACKED, "filled_mask"),
                        ),
                        *_PACKING_CONTEXT,
                    ),
                    lambda call: call.get("filled_mask"),
                ),
                Shape(
                    f"compute_packed_inference_logprobs_stats({', '.join(_PACKED)}): the "
                    "scored positions from the packing context",
                    "core_v0.16.1 to core_v0.18.x",
                    (
                        Feature(_PACKING, "compute_packed_inference_logprobs_stats", _PACKED),
                        *_PACKING_CONTEXT,
                    ),
                    lambda _call: None,
                ),
            ),
            phrase="packed via {label}",
        ),
        Aspect(
            "metrics",
            (
                Shape(
                    "maybe_log_training_metrics(wandb_writer, tb_writer)",
                    "core_v0.16.1 to core_v0.16.x",
                    (
                        Feature(
                            _RL_UTILS,
                            "maybe_log_training_metrics",
                            ("current_iteration", "wandb_writer", "tb_writer"),
                        ),
                    ),
                    _writers_from_parameters,
                ),
                Shape(
                    "Megatron's global writers (get_wandb_writer / get_tensorboard_writer)",
                    "core_v0.17.0 to main",
                    (
                        Feature(_RL_UTILS, "maybe_log_training_metrics", ("current_iteration",)),
                        Feature(_GLOBALS, "get_wandb_writer"),
                        Feature(_GLOBALS, "get_tensorboard_writer"),
                    ),
                    _global_writers,
                ),
            ),
            phrase="metrics to {label}",
        ),
    ),
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
    # CP peers hold the same rows whole: no CP reduction in the estimate; the CP group is
    # used only to check that the peers agree (see reduction.agree)
    groups=megatron_groups,
    no_input_reason=_no_input_reason,
    unsupported_reason=lambda _args: None,
    history=MEGATRON_RL_HISTORY,
)


def _call(wrapped: Callable[..., Any], aspect: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by parameter name, after checking the host has the aspect's shape
    (a clear error naming what is missing and the supported range, else)."""
    MEGATRON_RL_HISTORY.choose(aspect)
    call = bind(wrapped, args, kwargs)
    return dict(kwargs) if call is None else dict(call.arguments)


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


# --- which positions count ---------------------------------------------------------------------

Rows = tuple[list, list, list]


def _scored(generation_mask: Any, count: int, offset: int, end: int) -> Any:
    """The log-prob positions the engine scored in one row: the i-th of its ``count`` inference
    log-probs scores the i-th generated token, whose log-prob sits one position earlier
    (shifted by ``offset``, the row's start in a packed bin), kept inside ``[offset, end)``."""
    generated = generation_mask.nonzero(as_tuple=True)[0]
    target = offset + generated[: max(0, min(count, generated.numel()))] - 1
    return target[(target >= offset) & (target < end)]


def _count(inference: Any) -> int:
    """How many log-probs the engine reported for a row (0: none, e.g. an all-pad row)."""
    import torch

    return len(inference) if isinstance(inference, torch.Tensor) else 0


def _padded_count(generation_mask: Any, tokens: Any, inference: Any, eod: int) -> int:
    """The packed path (every release so far) pads each row's inference log-probs with zeros to
    the sequence length, so their number is gone: every generated token, less a final eod
    that reads as padding (the train side appends it and the engine never scores it; a
    filled_mask does not leave it out either, as its slot is inside the padded row); none for
    a row of zeros (main's all-pad rows)."""
    import torch

    if not isinstance(inference, torch.Tensor) or not bool(inference.any()):
        return 0
    generated = generation_mask.nonzero(as_tuple=True)[0]
    count = generated.numel()
    if count and int(tokens[generated[-1]]) == eod and count <= len(inference):
        count -= int(float(inference[count - 1]) == 0.0)
    return count


def _unpacked_inputs(inference_list: Any, old: Any, generation_masks: Any, padded: Any) -> Rows:
    """One trajectory per row with a scored position; the values upstream's statistics and
    loss use (its aligned tensor ``padded``)."""
    if inference_list is None:
        raise EssPatchValueError(
            f"ess-patch ({NAME}): the rollouts carry no inference log-probs "
            "(inference_logprobs is None)"
        )
    if (
        old.dim() != 2
        or len(inference_list) != old.shape[0]
        or generation_masks.shape[0] != old.shape[0]
    ):
        raise EssPatchValueError(
            f"ess-patch ({NAME}): {len(inference_list)} inference log-prob tensors and "
            f"generation masks {tuple(generation_masks.shape)} for old log-probs of shape "
            f"{tuple(old.shape)} (one per trajectory expected)"
        )
    if padded.shape != old.shape:
        raise EssPatchValueError(
            f"ess-patch ({NAME}): aligned inference log-probs {tuple(padded.shape)} and old "
            f"log-probs {tuple(old.shape)} must have the same shape"
        )
    lps, rlps = [], []
    for i, inference in enumerate(inference_list):
        positions = _scored(generation_masks[i], _count(inference), 0, old.shape[1])
        if positions.numel():
            lps.append(old[i, positions])
            rlps.append(padded[i, positions])
    return lps, rlps, [lp.new_ones(lp.shape, dtype=bool) for lp in lps]


def _packed_inputs(old: Any, packed_inference: Any, packed_loss_mask: Any, filled: Any) -> Rows:
    """One trajectory per packed sequence with a scored position: its positions in
    ``[start, start + len - 1)`` of the log-prob row (the last one would predict the next
    sequence's first token) that the loss mask keeps and the engine scored (from the packing
    context's generation masks and padded inference log-probs; and, where the release passes
    one, inside its ``filled`` mask)."""
    import torch
    from megatron.rl.rl_utils import get_rl_runtime_state

    context = getattr(get_rl_runtime_state(), "packing_context", None)
    info = getattr(context, "packing_info", None)
    if info is None:
        raise EssPatchValueError(
            f"ess-patch ({NAME}): sequence packing without a packing context "
            "(get_rl_runtime_state().packing_context.packing_info): the trajectory "
            "boundaries are unknown"
        )
    old, packed_inference = old.cpu(), packed_inference.cpu()
    mask = packed_loss_mask.cpu()[:, 1:].bool()
    if old.shape != packed_inference.shape or mask.shape != old.shape:
        raise EssPatchValueError(
            f"ess-patch ({NAME}): packed old log-probs {tuple(old.shape)}, inference "
            f"log-probs {tuple(packed_inference.shape)} and loss mask "
            f"{tuple(packed_loss_mask.shape)} (minus its first column) do not line up"
        )
    if len(info.bin_seq_indices) != old.shape[0]:
        raise EssPatchValueError(
            f"ess-patch ({NAME}): {len(info.bin_seq_indices)} bins in the packing info, "
            f"{old.shape[0]} rows of packed log-probs"
        )
    from megatron.training.global_vars import get_tokenizer

    eod = get_tokenizer().eod
    scored = torch.zeros_like(mask)
    masks, tokens = context.original_generation_masks, context.original_trajs
    inferences = context.original_inference_logprobs
    for b, seqs in enumerate(info.bin_seq_indices):
        for j, seq in enumerate(seqs):
            start = info.seq_starts[b][j]
            end = min(start + info.seq_lengths[seq] - 1, old.shape[1])
            count = _padded_count(masks[seq], tokens[seq], inferences[seq], eod)
            scored[b, _scored(masks[seq], count, start, end)] = True
    scored &= mask
    if filled is not None:  # the release's own mark: never count a position it left out
        if filled.shape != mask.shape:
            raise EssPatchValueError(
                f"ess-patch ({NAME}): filled_mask {tuple(filled.shape)} and packed old "
                f"log-probs {tuple(old.shape)} do not line up"
            )
        scored &= filled.cpu().bool()
    lps, rlps = [], []
    for b, seqs in enumerate(info.bin_seq_indices):
        for j, seq in enumerate(seqs):
            start = info.seq_starts[b][j]
            end = min(start + info.seq_lengths[seq] - 1, old.shape[1])
            positions = start + scored[b, start:end].nonzero(as_tuple=True)[0]
            if positions.numel():
                lps.append(old[b, positions])
                rlps.append(packed_inference[b, positions])
    return lps, rlps, [lp.new_ones(lp.shape, dtype=bool) for lp in lps]


# --- the ESS of one collection, agreed on every rank -------------------------------------------


#: Why CP / PP peers must agree: a fault when they did not (``reduction.agree``).
_WHY = (
    "Megatron-RL gives every {} peer the same whole rows, so this tree splits them in a way "
    "ess-patch does not know"
)


def _compute_and_arm(args: Any, build: Callable[[], Rows], shadow: bool = False) -> None:
    """``build()`` -> per-trajectory (train, inference, mask) lists on this rank; arm the ESS
    (shadow mode: keep it for the logs only), or raise the same fault on every rank."""
    # Imported here: install() (run at start-up) must not import torch.
    from .. import calibration
    from ..compute import compute_ess_lr
    from ..reduction import agree

    groups = MEGATRON_RL_FRAMEWORK.groups()
    config = config_from_args(args)
    inputs: Rows = ([], [], [])
    fault: BaseException | None = None
    try:
        inputs = build()
    except Exception as exc:  # inside compute_ess_lr's collectives: its DP peers learn of it
        fault = (
            exc if isinstance(exc, ValueError) else EssPatchValueError(f"ess-patch ({NAME}): {exc}")
        )
    error: BaseException | None = None
    result = None
    # what the calibration held before: kept only once every stage agreed on the result
    before = calibration.snapshot()
    try:
        # every stage holds the rows: each computes over its DP group (no PP broadcast)
        result = compute_ess_lr(*inputs, config=config, dp_group=groups.dp_group, error=fault)
    except Exception as exc:
        error = exc
    for group, name in ((groups.cp_group, "CP"), (groups.pp_group, "PP")):
        error = agree(result, error, group, name, config, f"ess-patch ({NAME})", _WHY.format(name))
    if error is not None:
        calibration.restore(before)
        raise error
    assert result is not None  # no error: computed
    collapse_warning.publish(result, config, framework=NAME, shadow=shadow)
    logger.debug("ess-patch (%s): %s %s", NAME, "shadow" if shadow else "armed", result)


# --- wrappers ----------------------------------------------------------------------------------


def _run_then_compute(
    wrapped: Callable[..., Any], args: tuple, kwargs: dict, host: Any, shadow: bool, build: Any
) -> Any:
    """Run the upstream function, then the ESS; if either fails on one rank, every rank
    raises (the failing one its own error)."""
    try:
        out = wrapped(*args, **kwargs)
    except Exception as exc:
        failure = exc

        def fail() -> Rows:
            raise failure

        with contextlib.suppress(Exception):  # the peers learn of it in the collectives
            _compute_and_arm(host, fail, shadow)
        raise  # upstream's own error, on this rank
    _compute_and_arm(host, lambda: build(out), shadow)
    return out


def _beside(
    wrapped: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    aspect: str,
    inputs: Callable[[dict[str, Any], Any, bool], Callable[[Any], Rows]],
) -> Any:
    """With ESS-LR (or shadow mode) on: the call bound (``aspect``'s shape checked), then
    upstream run and this collection's ESS armed from ``inputs(call, host, shadow)``, which
    builds the rows from upstream's output (:func:`_run_then_compute`)."""
    enabled = _enabled()
    if enabled is None:
        return wrapped(*args, **kwargs)
    host, shadow = enabled
    build = inputs(_call(wrapped, aspect, args, kwargs), host, shadow)
    return _run_then_compute(wrapped, args, kwargs, host, shadow, build)


def _aligned(call: dict[str, Any], host: Any, shadow: bool) -> Callable[[Any], Rows]:
    inference, old, masks = (call.get(name) for name in _UNPACKED)
    if inference is None:  # upstream would fail on it with a TypeError, on this rank only
        _compute_and_arm(host, lambda: _unpacked_inputs(None, old, masks, old), shadow)
    return lambda padded: _unpacked_inputs(inference, old, masks, padded)


def _packed(call: dict[str, Any], _host: Any, _shadow: bool) -> Callable[[Any], Rows]:
    filled = MEGATRON_RL_HISTORY.choose("packed").adapter(call)
    return lambda _out: _packed_inputs(*(call.get(name) for name in _PACKED), filled)


def align_wrapper(wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict) -> Any:
    """Unpacked: after upstream aligns the inference log-probs, arm this collection's ESS."""
    return _beside(wrapped, args, kwargs, "unpacked", _aligned)


def packed_stats_wrapper(
    wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict
) -> Any:
    """Packed: beside upstream's mismatch statistics, arm this collection's ESS."""
    return _beside(wrapped, args, kwargs, "packed", _packed)


def _baseline_on(host: Any) -> bool:
    return baseline_mode(host) is not None


def prepare_wrapper(wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict) -> Any:
    """A new collection replaces the last one's ESS; one that armed none stops the run
    (shadow mode: says so). With VCPO's baseline: the norm pass and ``b*`` before upstream's
    body, the read-back checked after it (``megatron_rl_baseline``)."""
    host = _host_args()
    baseline = _baseline_on(host)
    enabled = _enabled()
    if enabled is None and not baseline:
        return wrapped(*args, **kwargs)
    record = None
    if baseline:
        from . import megatron_rl_baseline  # torch: only when on

        call = bind(wrapped, args, kwargs)
        arguments = {} if call is None else dict(call.arguments)
        lacking = [p for p in ("model", "rollouts", "tokenizer") if p not in arguments]
        if lacking:
            raise MissingTargetError(
                f"ess-patch ({NAME}): prepare_data_for_update has no parameter "
                f"{', '.join(lacking)}, so VCPO's baseline cannot take its norms. Supported: "
                f"{BASELINE_SUPPORTED}"
            )
        dp_group = MEGATRON_RL_FRAMEWORK.groups().dp_group
        record = megatron_rl_baseline.begin(
            host, arguments["model"], arguments["rollouts"], arguments["tokenizer"], dp_group
        )
    if enabled is not None:
        disarm()
        STATE.shadow = None
    out = wrapped(*args, **kwargs)
    if record is not None:
        if not record["checked"]:  # core_v0.17 on: logged after the collection, not inside
            megatron_rl_baseline.check_applied(_returned_stats(out), record, dp_group)
        megatron_rl_baseline.finish(record, dp_group)
    if enabled is not None and armed() is None and STATE.shadow is None:
        missing = "this rollout collection had no inference log-probs (nothing was measured)"
        fix = (
            "Use an inference backend that returns log-probs and keep "
            "--rl-inference-logprobs-is-correction on"
        )
        if not enabled[1]:
            refuse(NAME, missing, fix)
        logger.warning("ess-patch (%s): %s; shadow mode logs nothing for it", NAME, missing)
    return out


def _returned_stats(out: Any) -> Any:
    """The ``group_stats`` ``prepare_data_for_update`` returns (core_v0.17 on: ``(iterator,
    group_stats, example_groups)``), else None."""
    if isinstance(out, tuple) and len(out) >= 2 and hasattr(out[1], "advantages"):
        return out[1]
    return None


def advantages_wrapper(
    wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict
) -> Any:
    """``calculate_grpo_advantages(rewards, num_turns)``: inside a collection that took the
    baseline's norms, ``b*`` replaces the group mean (shadow mode: computed, not applied);
    elsewhere (evaluation) it calls straight through."""
    record = STATE.baseline
    if not isinstance(record, dict) or not record.get("pending"):
        return wrapped(*args, **kwargs)
    from . import megatron_rl_baseline

    call = bind(wrapped, args, kwargs)
    arguments = {} if call is None else dict(call.arguments)
    out = wrapped(*args, **kwargs)
    return megatron_rl_baseline.substitute(
        out, arguments.get("rewards"), arguments.get("num_turns"), record
    )


def log_metrics_wrapper(
    wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict
) -> Any:
    """Add the ESS metrics (armed, or shadow mode's) and VCPO's baseline's (``ess_baseline_*``,
    after its read-back of ``group_stats``) to the collection's wandb / tensorboard record, in
    the writers this release logs to."""
    record = STATE.baseline
    if isinstance(record, dict) and "b_star" in record and not record.get("checked"):
        from . import megatron_rl_baseline

        call = bind(wrapped, args, kwargs)
        stats = None if call is None else call.arguments.get("group_stats")
        megatron_rl_baseline.check_applied(stats, record, MEGATRON_RL_FRAMEWORK.groups().dp_group)
    out = wrapped(*args, **kwargs)
    metrics = ess_metrics()
    if not metrics:
        return out
    call = _call(wrapped, "metrics", args, kwargs)
    wandb_writer, tb_writer = MEGATRON_RL_HISTORY.choose("metrics").adapter(call)
    step = call["current_iteration"]
    if wandb_writer:
        wandb_writer.log(metrics, step=step)
    if tb_writer:
        for key, value in metrics.items():
            tb_writer.add_scalar(key, value, step)
    return out


BASELINE_SUPPORTED = (
    "Megatron-LM core_v0.16.1 to core_v0.18.2 (megatron.rl.rl_utils.calculate_grpo_advantages"
    "(rewards, num_turns)), installed with ess_patch.install(); one model chunk (no virtual "
    "pipeline), no context parallelism, single-turn rollouts"
)


def validate_megatron_rl_baseline(parsed: Any) -> None:
    """Refuse, at parse time and by name, a Megatron-RL run that asks for VCPO's baseline
    (``--use-ess-baseline`` / ``--ess-baseline-shadow`` or ``ESS_LR_BASELINE`` /
    ``ESS_LR_BASELINE_SHADOW``) on anything the baseline does not serve.

    Raises:
        EssPatchValueError: naming each setting (or the tree) it cannot serve, and what is
            supported; or malformed ``ESS_LR_BASELINE*`` variables.
    """
    mode = baseline_mode(parsed)
    if mode is None:
        return
    baseline_path(parsed)
    setting = (
        ("--use-ess-baseline" if getattr(parsed, "use_ess_baseline", None) else ENV_ON)
        if mode == "on"
        else (
            "--ess-baseline-shadow" if getattr(parsed, "ess_baseline_shadow", None) else ENV_SHADOW
        )
    )
    problems = parallel_problems(parsed)
    if (getattr(parsed, "grpo_group_size", 2) or 0) < 2:
        problems.append(
            f"--grpo-group-size {getattr(parsed, 'grpo_group_size', None)} (a group of one has "
            "no baseline)"
        )
    import importlib
    import inspect

    rl_utils = importlib.import_module(_RL_UTILS)
    routine = getattr(rl_utils, "calculate_grpo_advantages", None)
    try:
        params = set(inspect.signature(routine).parameters) if routine is not None else set()
    except (TypeError, ValueError):
        params = set()
    if not {"rewards", "num_turns"} <= params:
        problems.append(
            "this Megatron-LM tree (no megatron.rl.rl_utils.calculate_grpo_advantages(rewards, "
            "num_turns): radixark's miles-main fork @2e64d788b and later trees compute GRPO's "
            "advantages inline in prepare_data_for_update, with nothing to hook by name)"
        )
    elif not is_ours(routine):
        problems.append(
            "megatron.rl.rl_utils.calculate_grpo_advantages not patched (the patches/megatron_rl "
            "series does not cover the baseline): call ess_patch.install(['megatron', "
            "'megatron_rl']) (or ESS_PATCH_AUTO_INSTALL=1)"
        )
    if problems:
        raise EssPatchValueError(
            f"ess-patch ({NAME}): {setting} (VCPO's minimum-variance baseline) is not supported "
            "in Megatron-RL (train_rl.py, --perform-rl-step) with "
            + "; ".join(problems)
            + f". Supported: {BASELINE_SUPPORTED}. Drop {setting} (unset {ENV_ON} / "
            f"{ENV_SHADOW}) or change that setting"
        )


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
    call = _call(wrapped, "arguments", args, kwargs)
    if "extra_args_provider" not in call:
        raise MissingTargetError(
            f"ess-patch ({NAME}): {wrapped.__module__}.parse_args was called without "
            f"extra_args_provider. Supported: {SUPPORTED}"
        )
    user = call["extra_args_provider"]
    host_flags: list[bool] = []

    def user_then_note(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if user is not None:
            returned = user(parser)
            parser = parser if returned is None else returned
        # the host (miles, slime, a fork) declared --use-ess-lr itself: it owns the validation
        host_flags.append("--use-ess-lr" in parser._option_string_actions)
        return parser

    call["extra_args_provider"] = compose_custom_arguments(user_then_note)
    parsed = wrapped(**call)
    requested = getattr(parsed, "use_ess_lr", False) or shadow_requested(parsed)
    if getattr(parsed, "perform_rl_step", False):
        validate(MEGATRON_RL_FRAMEWORK, parsed)
        validate_megatron_rl_baseline(parsed)
        if requested:  # decided afresh for this run: an unknown tree fails here, not later
            MEGATRON_RL_HISTORY.clear()
            MEGATRON_RL_HISTORY.choose_all()
    elif requested and host_flags and not host_flags[0]:
        raise EssPatchValueError(
            "--use-ess-lr (or --ess-lr-shadow) was given to Megatron's parse_args, but this is "
            "not a Megatron-RL run (no --perform-rl-step) and no RL framework that ess-patch "
            "integrates with (miles, slime) declared the flag: nothing would measure the ESS. "
            "Add --perform-rl-step for Megatron-RL (train_rl.py), or launch through miles / "
            f"slime with ess_patch.install() ({NAME})"
        )
    elif host_flags and not host_flags[0] and baseline_mode(parsed) is not None:
        raise EssPatchValueError(
            "--use-ess-baseline (or --ess-baseline-shadow, ESS_LR_BASELINE*) was given to "
            "Megatron's parse_args, but this is not a Megatron-RL run (no --perform-rl-step) "
            "and no RL framework that ess-patch integrates with (miles, slime) declared the "
            "flag: no advantage would take the baseline. Launch through miles / slime with "
            f"ess_patch.install(), or drop the setting ({NAME})"
        )
    return parsed


MEGATRON_RL = Integration(
    name=NAME,
    snapshot=SNAPSHOT,
    distribution=None,
    supported=SUPPORTED,
    targets=(
        # the order of the call sites in the patches/ series' message
        Target(
            _ARGUMENTS,
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
        # VCPO's baseline (core_v0.16.1 to core_v0.18.2; the fork computes the advantages
        # inline and validate_megatron_rl_baseline refuses it): install() only
        Target(
            _RL_UTILS,
            "",
            "calculate_grpo_advantages",
            advantages_wrapper,
            required=False,
            vendored=False,
        ),
    ),
    history=MEGATRON_RL_HISTORY,
)
