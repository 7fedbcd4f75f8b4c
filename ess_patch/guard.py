"""The fail-closed invariant, kept here once: a request for ESS-LR is honoured or stops the run.

A request is ``--use-ess-lr``, an ``ESS_LR_*`` variable (``ESS_LR_ENABLE``), verl's
``ess_scaling.enable``, an ``EssLrConfig`` given to ``install()``, or the auto-install
(``ESS_PATCH_AUTO_INSTALL``). In a process that trains a policy, every optimizer step then
applies the armed scale, or the run stops with one error, the same on every rank (every rank
reaches the same decision from the same inputs), naming the framework, what is missing and
what to do, before the first step where that can be known:

- :func:`check_applier` (from :func:`arm`, the public ``ess_patch.arm``): nothing that wraps
  an optimizer step is in effect (``install(["slime"])``, the megatron integration rolled
  back by a late import);
- :func:`watch_steps`: torch's global optimizer-step hook, registered at the first ``arm()``;
  a ``torch.optim.Optimizer`` stepping while a scale is armed, outside ess-patch's step
  wrapper and not ``attach()``-ed (a plain torch optimizer under ``install()``), raises before
  its update; so does every step in a process whose auto-install failed
  (:func:`fail_closed_after`);
- :func:`refuse`: what the integrations call when they know the request cannot be honoured
  (no rollout log-probs, actors that nothing patches, settings that disagree).

The only exception is the explicit opt-out ``ESS_PATCH_ALLOW_UNSCALED=1``: each refusal is
then logged once as a WARNING that says the opt-out let the run go on unscaled.

The scale a step applied is read back from that step (:func:`note_applied`, by the step
wrappers) and is what the metrics report (:func:`applied_scale`), never the armed result.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from . import state
from .errors import FailClosedError
from .result import EssLrResult, check_scale
from .state import STATE, is_scaled

__all__ = [
    "ALLOW_UNSCALED",
    "ATTACHED",
    "AUTO_INSTALL",
    "EssLrNotAppliedError",
    "allow_unscaled",
    "applied_scale",
    "arm",
    "auto_install_requested",
    "check_applier",
    "fail_closed_after",
    "note_applied",
    "refuse",
    "watch_steps",
]

logger = logging.getLogger(__name__)

#: The explicit opt-out: ``1``/``true``/``yes``/``on`` lets a run whose ESS-LR request cannot
#: be honoured go on at the scheduled LR, with a WARNING per refusal.
ALLOW_UNSCALED = "ESS_PATCH_ALLOW_UNSCALED"
#: The auto-install's variable: set (to ``1`` or a list of integrations) in a process, a request.
AUTO_INSTALL = "ESS_PATCH_AUTO_INSTALL"
_OFF = ("", "0", "false", "no", "off")
#: The instance attribute ``attach()`` keeps a torch optimizer's hook handles in.
ATTACHED = "_ess_patch_step_hooks"
_ON = ("1", "true", "yes", "on")


#: ESS-LR was requested and a step would not apply it: the run stops here. The one
#: fail-closed type (:class:`ess_patch.errors.FailClosedError`), under its older name.
EssLrNotAppliedError = FailClosedError


def auto_install_requested(environ: Mapping[str, str] | None = None) -> str | None:
    """The integrations ``ESS_PATCH_AUTO_INSTALL`` asks for ("" = the default set), or None
    (off)."""
    value = (os.environ if environ is None else environ).get(AUTO_INSTALL, "").strip()
    if value.lower() in _OFF:
        return None
    return "" if value.lower() in _ON else value


def allow_unscaled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the opt-out ``ESS_PATCH_ALLOW_UNSCALED`` is on in this process."""
    env = os.environ if environ is None else environ
    return env.get(ALLOW_UNSCALED, "").strip().lower() in _ON


def refuse(framework: str, missing: str, fix: str, *, kind: type[Exception] | None = None) -> None:
    """Stop the run: ESS-LR was requested for ``framework`` and cannot be honoured because of
    ``missing``; ``fix`` says what to do. With the opt-out on, log that once and return.

    Callers reach this on every rank alike (the decision is made from inputs every rank holds).

    Raises:
        EssLrNotAppliedError (or ``kind``): always, unless ``ESS_PATCH_ALLOW_UNSCALED`` is on.
    """
    message = (
        f"ess-patch ({framework}): ESS-LR was requested but {missing}, so the policy's "
        f"optimizer steps would run at the scheduled LR. {fix}. (To run on unscaled on "
        f"purpose, set {ALLOW_UNSCALED}=1.)"
    )
    if not allow_unscaled():
        raise (kind or EssLrNotAppliedError)(message)
    key = (framework, missing)
    if key not in STATE.opt_outs_logged:
        STATE.opt_outs_logged.add(key)
        logger.warning("%s=1 (opt-out): going on unscaled. %s", ALLOW_UNSCALED, message)


# --- proof that something applies the scale ---------------------------------------------------


def arm(result_or_scale: EssLrResult | float) -> EssLrResult:
    """``ess_patch.state.arm`` after :func:`check_applier`: the public ``ess_patch.arm``,
    and what every framework hook arms with.

    Raises:
        ValueError: a scale outside (0, 1]; or the auto-install failed on a bad setting.
        RuntimeError: the auto-install failed for another reason.
        EssLrNotAppliedError: install() is in effect and nothing wraps an optimizer step;
            nothing is armed then.
    """
    if not isinstance(result_or_scale, EssLrResult):
        check_scale(result_or_scale)
    check_applier()
    return state.arm(result_or_scale)


def check_applier() -> None:
    """Before a scale is armed or a rollout is measured inside the loss: is an optimizer-step
    wrapper in effect (``attach()``, a vendored step, an installed integration that wraps
    optimizer steps)? Registers the step guard. Nothing installed at all (a bare ``arm()``):
    warns once, and the step guard decides at the step.

    Raises:
        ValueError / RuntimeError: the auto-install failed in this process (names why).
        EssLrNotAppliedError: ``install()`` is in effect but no integration that wraps an
            optimizer step is (``install(["slime"])``, ``ESS_PATCH_INTEGRATIONS=slime``, the
            megatron integration rolled back by a late import); unless opted out.
    """
    watch_steps()
    if STATE.applied_elsewhere or STATE.step_wrappers:
        return
    failure = _autoinstall_failure()
    if failure is not None:
        raise failure
    if STATE.config is None:  # install() not in effect: a bare arm(), attach() may follow
        if not STATE.warned_no_effect:
            STATE.warned_no_effect = True
            logger.warning(
                "ess_patch.arm(): nothing in this process applies the armed scale yet "
                "(install() was not called, no optimizer is attach()ed, no vendored optimizer "
                "step): an optimizer step outside ess-patch will raise. Call "
                "ess_patch.install() or ess_patch.attach(optimizer) first. (Said once per "
                "process.)"
            )
        return
    installation = _installation()
    installed = sorted(getattr(installation, "patches", None) or {})
    rolled_back = dict(getattr(installation, "failures", None) or {})
    why = (
        f"the megatron integration was rolled back ({rolled_back['megatron']})"
        if "megatron" in rolled_back
        else "megatron is not among them"
    )
    refuse(
        ", ".join(installed) or "install()",
        f"nothing wraps the optimizer step: install() is in effect with "
        f"{', '.join(installed) or 'no integration'} and {why}",
        "Install the megatron integration too (install(['megatron', ...]) or "
        "ESS_PATCH_INTEGRATIONS=megatron,...), or call ess_patch.attach(optimizer)",
    )


def _installation() -> Any:
    # install.py sits above this module: its record is read where it lives, not imported
    return getattr(sys.modules.get(f"{__package__}.install"), "INSTALLATION", None)


def _autoinstall_failure() -> Exception | None:
    """The error for an ``arm()`` in a process whose auto-install failed, or None."""
    error = getattr(_installation(), "autoinstall_error", None)
    if error is None:
        return None
    kind = ValueError if isinstance(error, ValueError) else RuntimeError
    return kind(
        "ess_patch.arm(): ESS-LR was requested in this process (ESS_PATCH_AUTO_INSTALL) but "
        f"its auto-install failed at start-up: {type(error).__name__}: {error}. Nothing "
        "applies the scale, so nothing was armed; fix that and restart the process (or call "
        "ess_patch.install() / ess_patch.attach(optimizer) yourself)"
    )


# --- the step guard ----------------------------------------------------------------------------


def watch_steps() -> None:
    """Register the step guard, torch's global optimizer-step pre-hook (once per process;
    from the first ``arm()`` on, so that a run without ESS-LR has no extra call per step)."""
    if STATE.step_guard is not None:
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    STATE.step_guard = register_optimizer_step_pre_hook(_step_guard)


def fail_closed_after(error: BaseException) -> None:
    """The auto-install failed in this process: every torch optimizer step raises ``error``'s
    account (processes that never step an optimizer, a rollout engine, run on). Registered when
    ``torch.optim`` is imported: the auto-install runs at start-up and never imports torch."""
    import wrapt

    STATE.request_error = error
    wrapt.register_post_import_hook(lambda _module: watch_steps(), "torch.optim.optimizer")


def _step_guard(optimizer: Any, _args: tuple, _kwargs: dict) -> None:
    if STATE.request_error is not None:
        error = STATE.request_error
        refuse(
            "auto-install",
            f"its auto-install (ESS_PATCH_AUTO_INSTALL) failed in this process: "
            f"{type(error).__name__}: {error}",
            "Fix that and restart the job",
        )
        return
    measuring = STATE.ledger_run is not None and not STATE.ledger_run.shadow
    if STATE.armed is None and not measuring:  # shadow mode never changes an LR
        return
    # inside ess-patch's step wrapper (megatron-core's inner torch optimizers), or attach()-ed
    if getattr(STATE.local, "in_step", False) or ATTACHED in vars(optimizer):
        return
    if not is_scaled(optimizer):  # a critic, an exclude()d optimizer
        return
    installed = ", ".join(sorted(getattr(_installation(), "patches", None) or {}))
    refuse(
        installed or "torch optimizer",
        f"this {type(optimizer).__name__}.step() runs outside every ess-patch step wrapper "
        "(a plain torch optimizer under install(), or a megatron-core optimizer whose "
        "integration is not installed)",
        "Call ess_patch.attach(optimizer) on it, install the megatron integration for "
        "megatron-core optimizers, or ess_patch.exclude(optimizer) if it is not the policy's",
    )


# --- what a step applied -----------------------------------------------------------------------


def note_applied(scheduled: list[float], applied: list[float], intended: float) -> None:
    """Record one step's LRs, read from its param groups before and inside the scaled block:
    the applied scale is ``applied / scheduled`` of the first group with a non-zero LR
    (``intended`` when every group's LR is 0)."""
    ratio = intended
    for before, inside in zip(scheduled, applied):
        if before:
            ratio = float(inside) / float(before)
            break
    STATE.applied = ratio


def applied_scale() -> float | None:
    """The scale the last optimizer step since the current result was armed applied, read back
    from its param groups, or None (no step yet)."""
    return STATE.applied
