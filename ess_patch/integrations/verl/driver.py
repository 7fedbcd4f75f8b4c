"""verl's driver: the Ray actors it starts run ess-patch whenever the driver does.

verl's workers are Ray actors; ess-patch is active in one only when its auto-install runs
there (``ESS_PATCH_AUTO_INSTALL`` in the actor's environment, through the ``.pth`` line). A
driver that runs ess-patch (auto-installed, or ``install()`` in a recipe's script) with
``ESS_LR_ENABLE=1`` used to start workers whose runtime environment lacked it: they trained at
the scheduled LR, and nothing said so. verl's ``run_ppo`` builds the environment every actor
starts with from ``get_ppo_ray_runtime_env()`` (every release, called in the driver before
``ray.init``; the user's ``ray_kwargs.ray_init.runtime_env`` is merged over it). Its wrapper
adds the auto-install and the driver's ``ESS_LR_*`` settings there, so the request reaches
every actor; a value the user sets in ``ray_kwargs.ray_init.runtime_env.env_vars`` still wins
(an explicit ``ESS_PATCH_AUTO_INSTALL=0`` there is an opt-out).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from ...state import STATE
from .config import ENV_ENABLE, enable_requested

__all__ = ["runtime_env_wrapper", "worker_env"]

logger = logging.getLogger(__name__)

# the variables of layers above this one (install, autoinstall: never imported from here)
#: the auto-install's switch (``autoinstall.ENV``)
AUTO_INSTALL = "ESS_PATCH_AUTO_INSTALL"
#: which integrations the auto-install installs (``install.ENV_INTEGRATIONS``)
_INTEGRATIONS = "ESS_PATCH_INTEGRATIONS"
#: the estimator's settings (``EssLrConfig.from_env``)
_SETTINGS_PREFIX = "ESS_LR_"


def worker_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What every verl Ray actor's environment gets from a driver that runs ess-patch: the
    auto-install of (at least) verl, and the driver's ``ESS_LR_*`` settings."""
    env = os.environ if environ is None else environ
    integrations = [p.strip() for p in env.get(_INTEGRATIONS, "").split(",") if p.strip()]
    out = {k: v for k, v in env.items() if k.startswith(_SETTINGS_PREFIX) or k == ENV_ENABLE}
    out[AUTO_INSTALL] = "1"
    out[_INTEGRATIONS] = ",".join(dict.fromkeys([*integrations, "verl"]))
    return out


def runtime_env_wrapper(
    wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict
) -> Any:
    """``get_ppo_ray_runtime_env(...)``: verl's default runtime environment, its ``env_vars``
    with :func:`worker_env` added (verl's own keys kept) when this driver runs ess-patch
    (``install()`` in effect) or asks for ESS-LR (``ESS_LR_ENABLE``); else untouched (a
    vendored tree's decorator runs without either)."""
    runtime_env = wrapped(*args, **kwargs)
    if STATE.config is None and not enable_requested():
        return runtime_env
    env_vars = runtime_env.get("env_vars") if isinstance(runtime_env, dict) else None
    if not isinstance(env_vars, dict):
        logger.warning(
            "ess-patch (verl): get_ppo_ray_runtime_env() returned no env_vars dict; set %s=1 "
            "in ray_kwargs.ray_init.runtime_env.env_vars yourself",
            AUTO_INSTALL,
        )
        return runtime_env
    added = {k: v for k, v in worker_env().items() if k not in env_vars}
    env_vars.update(added)
    logger.info(
        "ess-patch (verl): every Ray actor starts with %s (the driver runs ess-patch)",
        ", ".join(f"{k}={v}" for k, v in sorted(added.items())),
    )
    return runtime_env
