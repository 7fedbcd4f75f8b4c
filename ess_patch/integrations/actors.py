"""miles and slime: what the driver hands to its Ray train actors, checked on both sides.

The driver parses the arguments; the actors train. So (issue 35):

- the driver resolves every setting into ``args`` (:func:`resolve_in_driver`): an ``ESS_LR_*``
  variable set only in the driver's environment reaches every actor through ``args``, and the
  driver's ``ESS_LR_*`` are recorded in ``args.ess_lr_driver_env``;
- the driver stops when nothing will patch its actors (:func:`check_actors_patched`):
  ``ESS_PATCH_AUTO_INSTALL`` neither in ``--train-env-vars`` nor in the driver's environment
  (which Ray started from it inherits), or set but without the ``.pth`` that acts on it (an
  editable install), and no ``--custom-megatron-init-path ess_patch.autoinstall.megatron_init``;
- an actor stops (:func:`check_in_actor`) when its ``args`` come from a driver that was not
  patched (slime >= v0.3.0 parses with ``ignore_unknown_args=True``: ``--use-ess-lr`` and every
  ``--ess-lr-*`` were dropped without a word) while this actor was asked to run ess-patch, or
  when its own ``ESS_LR_*`` disagree with the driver's.
"""

from __future__ import annotations

import os
import site
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..config import ENV_NAMES, EssLrConfig
from ..errors import EssPatchValueError
from ..guard import AUTO_INSTALL, refuse
from ..guard import auto_install_requested as requested
from .flags import EXPLICIT_NONE, config_from_args, option_for

__all__ = ["INIT_PATH", "check_actors_patched", "check_in_actor", "resolve_in_driver"]

#: ``--custom-megatron-init-path`` value that installs ess-patch in each Megatron train actor.
INIT_PATH = "ess_patch.autoinstall.megatron_init"
PTH = "ess_patch-autoinstall.pth"
#: where the driver records its ``ESS_LR_*`` environment for the actors to compare with theirs
DRIVER_ENV = "ess_lr_driver_env"


def _ess_env(environ: Any = None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k in ENV_NAMES and v != ""}


def resolve_in_driver(args: Any) -> None:
    """Write every setting the driver resolved (flag > ``ESS_LR_*`` > default) into ``args``,
    so that the actors read them from ``args``, and record the driver's ``ESS_LR_*``."""
    config = config_from_args(args)
    for f in fields(EssLrConfig):
        value = getattr(config, f.name)
        setattr(args, "ess_lr_" + f.name, EXPLICIT_NONE if value is None else value)
    setattr(args, DRIVER_ENV, _ess_env())


def _pth_installed() -> bool:
    folders = [*site.getsitepackages(), site.getusersitepackages()]
    return any((Path(folder) / PTH).exists() for folder in folders)


def check_actors_patched(framework: str, args: Any, flag: str) -> None:
    """In the driver, once ``flag`` (``--use-ess-lr``) is parsed: stop unless something will
    install ess-patch in the train actors.

    A host without ``train_env_vars`` has no Ray train actors of this kind: nothing to check.

    Raises:
        EssLrNotAppliedError: nothing patches the actors (unless opted out).
    """
    if not hasattr(args, "train_env_vars"):
        return
    if getattr(args, "custom_megatron_init_path", None) == INIT_PATH:
        return
    env_vars = args.train_env_vars if isinstance(args.train_env_vars, dict) else {}
    asked = requested({k: str(v) for k, v in env_vars.items()}) is not None
    inherited = requested() is not None
    if (asked or inherited) and _pth_installed():
        return
    if asked or inherited:
        missing = (
            f"{AUTO_INSTALL} is set for the train actors, but {PTH} (which acts on it at "
            "start-up) is not in site-packages (an editable install does not ship it), so "
            "nothing patches the actors"
        )
    else:
        missing = (
            f"this driver parsed {flag}, and nothing patches the Ray train actors that "
            f"train: {AUTO_INSTALL} is not in --train-env-vars nor in the driver's "
            "environment, and --custom-megatron-init-path is not ess-patch's"
        )
    refuse(
        framework,
        missing,
        f'Add --train-env-vars \'{{"{AUTO_INSTALL}": "1"}}\' (with ess-patch installed from '
        f"its wheel) or --custom-megatron-init-path {INIT_PATH}",
    )


def check_in_actor(framework: str, args: Any) -> bool:
    """In a train actor, at its first hook: whether ``args`` carry ESS-LR's options at all.

    Raises:
        EssLrNotAppliedError: they do not (the driver was not patched) while this process was
            asked to run ess-patch (``ESS_PATCH_AUTO_INSTALL``, or ess-patch's megatron init).
        ValueError: an ``ESS_LR_*`` variable of this actor disagrees with what the driver
            resolved (the actors use the driver's).
    """
    if not hasattr(args, "use_ess_lr"):
        if requested() is not None or getattr(args, "custom_megatron_init_path", None) == (
            INIT_PATH
        ):
            refuse(
                framework,
                f"this train actor runs ess-patch ({AUTO_INSTALL} or its megatron init) and "
                "its args have no use_ess_lr: the driver's parse_args was not patched, and "
                f"{framework} parses with ignore_unknown_args (slime >= v0.3.0), so "
                "--use-ess-lr and every --ess-lr-* were dropped",
                f"Patch the driver too: import ess_patch; ess_patch.install() before {framework} "
                f"is imported in train.py, or {AUTO_INSTALL}=1 in the driver's environment",
            )
        return False
    driver = getattr(args, DRIVER_ENV, None)
    if driver is None:  # parsed in this process or by an older ess-patch: nothing to compare
        return True
    mine = _ess_env()
    differ = sorted(k for k in mine if driver.get(k) != mine[k])
    if differ:
        said = "; ".join(f"{k}={mine[k]!r} here, {driver.get(k)!r} in the driver" for k in differ)
        raise EssPatchValueError(
            f"ess-patch ({framework}): this train actor's ESS_LR_* disagree with the driver's "
            f"({said}); the actors use the settings the driver resolved (args.ess_lr_*). Set "
            f"them in one place: as flags ({', '.join(option_for(_field(k)) for k in differ)}) "
            "or in the driver's environment only"
        )
    return True


def _field(variable: str) -> str:
    return variable.removeprefix("ESS_LR_").lower()
