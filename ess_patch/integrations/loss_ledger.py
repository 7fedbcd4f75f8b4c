"""ESS measured inside the policy loss, decided at the optimizer step (miles, slime).

Where the advantage hook has no current-policy log-probs (slime's one-step recipe reuses the
loss's own; miles' ``--skip-actor-forward-only``), or has the wrong ones (``--keep-old-actor``:
computed with the ``old_actor`` weights, i.e. the rollout policy), the only place the current
policy's log-probs exist is the policy loss, beside the rollout log-probs its IS correction
uses. So, at no extra forward pass:

1. the advantage hook starts a :class:`~ess_patch.ledger.LedgerRun` (:func:`start_run`) and
   arms nothing; granularity "step" is always measured this way (:func:`per_step_reason`);
2. each call of the policy loss (``policy_loss_function``; never the value loss, never a
   forward-only log-prob pass) adds its samples' per-trajectory partial sums, CP-local and
   detached (``[sum of masked log-ratio, masked tokens, non-finite flag]``, float64), to the
   step's ledger; the log-probs are the ones ``get_log_probs_and_entropy`` returned inside
   that call;
3. at ``optimizer.step()``, which every rank of the DP x CP x PP world enters together, the
   step wrapper reduces the ledger (``ess_patch/ledger.py``): summed over CP per trajectory,
   gathered over DP, decided on the last pipeline stage and broadcast to the others (faults
   and settings in the envelopes, as for a rollout), armed for that step, and emptied.

Granularity: one result per optimizer step, over that step's own mini-batch (its real
micro-batches, whatever the host's batching schedule). With one step per rollout that is the
rollout. A skipped step (the host never calls ``optimizer.step()``) leaves its samples in the
ledger of the next step of the rollout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import ledger
from ..config import EssLrConfig
from ..errors import EssPatchRuntimeError, EssPatchTypeError, EssPatchValueError
from ..ledger import LedgerRun
from ..patching import Target
from ..state import STATE
from .binding import bind
from .flags import config_from_args, shadow_requested

__all__ = [
    "log_probs_wrapper",
    "loss_targets",
    "per_step_reason",
    "policy_loss_wrapper",
    "start_run",
    "steps_per_rollout_refusal",
]


def start_run(
    framework: str,
    args: Any,
    config: EssLrConfig,
    groups: Any,
    reason: str,
    *,
    shadow: bool = False,
) -> LedgerRun:
    """Measure this rollout inside the policy loss (``reason``: why), over ``groups`` (an
    ``framework.Groups``: the CP / DP / PP groups of this rank)."""
    run = LedgerRun(
        framework=framework,
        reason=reason,
        config=config,
        cp_group=groups.cp_group,
        dp_group=groups.dp_group,
        pp_group=groups.pp_group,
        is_pp_last=groups.is_pp_last,
        shadow=shadow,
        context=(args, groups),
    )
    ledger.start(run)
    return run


def per_step_reason(config: EssLrConfig) -> str | None:
    """Granularity "step" is always measured inside the loss: each step over its own
    mini-batch, as the host's train loop really splits it."""
    if config.granularity == "step":
        return "granularity 'step' measures each optimizer step's mini-batch inside the loss"
    return None


def _in_backward() -> bool:
    """Whether autograd is running a backward pass now (a checkpointed loss recomputing)."""
    import torch

    return torch._C._current_graph_task_id() != -1


def policy_loss_wrapper(
    wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict
) -> Any:
    """Wrap ``policy_loss_function(args, batch, logits, sum_of_sample_mean)``: catch the
    log-probs it computes and add this call's samples to the step's ledger."""
    run = ledger.running()
    local = STATE.local
    if (
        run is None
        or getattr(local, "ledger_capture", None) is not None  # nested: the outer call adds
        or _in_backward()  # --recompute-loss-function: already counted in the forward
    ):
        return wrapped(*args, **kwargs)
    capture: list = []
    local.ledger_capture = capture
    try:
        out = wrapped(*args, **kwargs)
    finally:
        local.ledger_capture = None
    try:
        call = bind(wrapped, args, kwargs)
        batch = None if call is None else call.arguments.get("batch")
        if batch is None:
            raise EssPatchValueError(
                f"ess-patch ({run.framework}): the policy loss was called without a batch "
                "argument; ESS-LR cannot measure this step"
            )
        ledger.add(_partial_sums(run, batch, capture))
    except Exception as exc:
        # raised at the optimizer step, through the collectives, on every rank alike
        ledger.fail(exc)
    return out


def log_probs_wrapper(
    wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict
) -> Any:
    """Wrap ``get_log_probs_and_entropy``: inside a wrapped policy loss, keep what it returns
    (its first call there: the current policy's log-probs of the batch)."""
    out = wrapped(*args, **kwargs)
    capture = getattr(STATE.local, "ledger_capture", None)
    if capture is not None and not capture:
        capture.append(out)
    return out


def _log_probs_of(returned: Any) -> list:
    """The per-sample log-probs from ``get_log_probs_and_entropy``'s return value: a dict
    (miles) or ``(_, dict)`` (slime)."""
    found = returned
    if isinstance(found, tuple):
        found = next((item for item in found if isinstance(item, dict)), None)
    if not isinstance(found, dict) or found.get("log_probs") is None:
        raise EssPatchTypeError(
            "get_log_probs_and_entropy returned no 'log_probs' (got "
            f"{type(returned).__name__}); ess-patch does not know this host version's shape"
        )
    return list(found["log_probs"])


def _partial_sums(run: LedgerRun, batch: dict, capture: list) -> Any:
    """This loss call's ``[B, 3]`` table, CP-local, detached, float64."""
    from ..cp_slicing import local_response_masks
    from ..estimator import trajectory_stats

    if not capture:
        raise EssPatchRuntimeError(
            f"ess-patch ({run.framework}): the policy loss computed its log-probs without "
            "get_log_probs_and_entropy; ESS-LR cannot measure this step"
        )
    log_probs = [lp.detach() for lp in _log_probs_of(capture[0])]
    rollout = batch.get("rollout_log_probs")
    if not rollout:
        raise EssPatchValueError(
            f"ess-patch ({run.framework}): the policy loss's batch has no rollout_log_probs; "
            "ESS-LR needs the rollout engine's log-probs (the rollout must record them)"
        )
    masks = batch["loss_masks"]
    args, groups = run.context
    if groups.cp_size > 1:  # full-length masks, CP-local log-probs (both frameworks)
        masks = local_response_masks(
            masks,
            batch["total_lengths"],
            batch["response_lengths"],
            groups.cp_rank,
            groups.cp_size,
            qkv_format=getattr(args, "qkv_format", "thd"),
            max_seq_lens=batch.get("max_seq_lens"),
        )
    return trajectory_stats(log_probs, [r.detach() for r in rollout], masks)


def loss_targets(
    framework: str, modules: tuple[str, ...], defined: dict[str, str]
) -> tuple[Target, ...]:
    """``policy_loss_function`` and the ``get_log_probs_and_entropy`` it looks up, in each
    module that may hold them (optional: the loss moved between versions). ``defined``: the
    module that defines each name in the newest version, where the ``patches/`` series
    decorate it (``<framework>_policy_loss`` / ``<framework>_log_probs``)."""
    hooks = {
        "policy_loss_function": (policy_loss_wrapper, f"{framework}_policy_loss"),
        "get_log_probs_and_entropy": (log_probs_wrapper, f"{framework}_log_probs"),
    }
    sites = {(module, name) for module in modules for name in hooks}
    sites |= {(module, name) for name, module in defined.items()}
    return tuple(
        Target(
            module,
            "",
            name,
            hooks[name][0],
            required=False,
            decorator=hooks[name][1] if defined.get(name) == module else None,
        )
        for module, name in sorted(sites)
    )


def steps_per_rollout(args: Any) -> int | None:
    """Optimizer steps per rollout as the parsed args fix them (None: not known at parse
    time, e.g. no global batch size yet)."""
    steps = getattr(args, "num_steps_per_rollout", None)
    if isinstance(steps, int):
        return steps
    sizes = [getattr(args, k, None) for k in ("rollout_batch_size", "n_samples_per_prompt")]
    batch = getattr(args, "global_batch_size", None)
    if all(isinstance(v, int) and v > 0 for v in (*sizes, batch)):
        return max(1, sizes[0] * sizes[1] // batch)
    return None


def steps_per_rollout_refusal(args: Any, reason: str | None) -> str | None:
    """The parse-time refusal for a run measured inside the loss (``reason`` not None): with
    granularity 'rollout' and several optimizer steps per rollout, or with --allgather-cp;
    else None."""
    if reason is None:
        return None
    if getattr(args, "allgather_cp", False):
        return (
            f"{reason}, and --allgather-cp lays the tokens out in a way ESS-LR does not slice "
            "inside the loss; drop --allgather-cp"
        )
    if config_from_args(args).granularity == "step":
        return None
    steps = steps_per_rollout(args)
    if steps is None or steps <= 1:
        return None  # one step: step == rollout (more is refused at the second step)
    if shadow_requested(args) and not getattr(args, "use_ess_lr", False):
        return (
            f"{reason} and this run has {steps} optimizer steps per rollout: ESS-LR then "
            "measures inside the policy loss, one ESS per optimizer step, and shadow mode "
            "logs one per rollout; drop --ess-lr-shadow (or use --use-ess-lr with "
            "--ess-lr-granularity step)"
        )
    return (
        f"{reason} and this run has {steps} optimizer steps per rollout: ESS-LR then measures "
        "inside the policy loss, one ESS per optimizer step, never one per rollout; set "
        "--ess-lr-granularity step (or ESS_LR_GRANULARITY=step)"
    )
