"""The ``--use-ess-lr`` / ``--ess-lr-*`` options, generated from :class:`EssLrConfig`'s fields,
and the settings a parsed namespace gives.

One option per field: ``--ess-lr-<field>`` (``_`` as ``-``), stored in ``args.ess_lr_<field>``,
its help text the field's ``metadata["help"]``, its check the field's own validation (an
out-of-range value is argparse's usage error, naming the option). Every option defaults to
None, "not given", so that the settings follow one precedence everywhere (miles, slime,
Megatron-RL, the demo): an option given > ``install(config=...)`` (itself ``ESS_LR_*`` by
default) > :class:`EssLrConfig`'s default.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable
from dataclasses import MISSING, Field, fields, replace
from typing import Any

from ..config import CHOICES, HELP, EssLrConfig
from ..errors import EssPatchValueError
from ..state import STATE
from .baseline_flags import add_baseline_arguments

__all__ = [
    "ENABLE",
    "EXPLICIT_NONE",
    "add_config_options",
    "add_ess_arguments",
    "compose_custom_arguments",
    "config_from_args",
    "config_options",
    "given_options",
    "option_for",
    "shadow_requested",
]

#: The switch that turns ESS-LR on (a plain ``store_true``: off unless given).
ENABLE = "--use-ess-lr"
_PREFIX = "--ess-lr-"
#: What an optional field's option stores for an explicit "none" (e.g. ``--ess-lr-weight-clip
#: none``): given, and meaning None, where None itself means "not given".
EXPLICIT_NONE = "none"


def option_for(name: str, prefix: str = _PREFIX) -> str:
    """The option of config field ``name``: ``--ess-lr-weight-mode`` for ``weight_mode``."""
    return prefix + name.replace("_", "-")


def _check(name: str) -> Callable[[str], Any]:
    """argparse ``type`` for field ``name``: :class:`EssLrConfig`'s own check of that field
    (its ``ValueError`` becomes argparse's usage error, naming the option)."""

    def parse(text: str) -> Any:
        try:
            value = getattr(EssLrConfig(**{name: text}), name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return EXPLICIT_NONE if value is None else value

    parse.__name__ = name  # argparse names the type in some messages
    return parse


def _default_text(f: Field, installed: bool) -> str:
    default = f.default if f.default is not MISSING else None
    if isinstance(default, bool):
        shown = "on" if default else "off"
    else:
        shown = "none" if default is None else default
    env = "ESS_LR_" + f.name.upper()
    source = f"install(config=...) / {env}" if installed else env
    return f" Not given: {source}, else {shown}."


def _option(
    f: Field, prefix: str, check: bool, installed: bool
) -> tuple[tuple[str, ...], dict[str, Any]]:
    kwargs: dict[str, Any] = {
        "default": None,
        "help": f.metadata[HELP] + _default_text(f, installed),
    }
    if f.type in ("bool", bool):
        # --x / --no-x: either wins over the environment; neither: not given
        kwargs["action"] = argparse.BooleanOptionalAction
        return (option_for(f.name, prefix),), kwargs
    if check:
        kwargs["type"] = _check(f.name)
    if f.name in CHOICES:
        kwargs["choices"] = CHOICES[f.name]
    else:
        kwargs["metavar"] = f.name.upper()
    return (option_for(f.name, prefix),), kwargs


def config_options(
    prefix: str = _PREFIX,
    names: Iterable[str] | None = None,
    *,
    check: bool = True,
    installed: bool = True,
) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    """``(option strings, add_argument kwargs)`` per field of :class:`EssLrConfig` (those in
    ``names``, in field order), each defaulting to None (not given).

    ``check``: argparse checks each value with the field's own validation (else the option
    stores the text, for a caller that checks it itself); ``installed``: the help names
    ``install(config=...)`` as well as ``ESS_LR_*`` as the fallback."""
    wanted = None if names is None else set(names)
    return [
        _option(f, prefix, check, installed)
        for f in fields(EssLrConfig)
        if wanted is None or f.name in wanted
    ]


def add_config_options(
    parser: argparse.ArgumentParser | Any,
    prefix: str = _PREFIX,
    names: Iterable[str] | None = None,
    **options: bool,
) -> None:
    """Add the options of ``names`` (default: every field) to ``parser`` (or a group);
    ``options``: :func:`config_options`' ``check`` / ``installed``."""
    for flags, kwargs in config_options(prefix, names, **options):
        parser.add_argument(*flags, **kwargs)


def _ess_options() -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    enable = (
        (ENABLE,),
        {
            "action": "store_true",
            "default": False,
            "help": "Scale each policy update's LR by clamp(rule(rho / base ratio), floor, 1), "
            "rho = ESS/B of the current-vs-rollout log-prob ratios (--ess-lr-rule: sqrt by "
            "default; ess-patch). Off by default.",
        },
    )
    return [enable, *config_options()]


def add_ess_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--use-ess-lr`` and the ``--ess-lr-*`` options to a host framework's parser.

    Merges with what the host (a fork, or a second call) already defines: each option the
    parser lacks is added, each it has is kept as the host wrote it, provided it stores into
    the attribute ess-patch reads (``args.use_ess_lr``, ``args.ess_lr_floor``...).

    Raises:
        ValueError: the host defines one of our option strings with another ``dest`` (ESS-LR
            would silently read a default instead of the user's value).
    """
    known = parser._option_string_actions
    missing = []
    for flags, kwargs in _ess_options():
        dest = flags[0].lstrip("-").replace("-", "_")
        action = known.get(flags[0])
        if action is None:
            missing.append((flags, kwargs))
        elif action.dest != dest:
            raise EssPatchValueError(
                f"the host parser already defines {flags[0]} with dest={action.dest!r}; "
                f"ess-patch reads args.{dest}. Rename the host's option or give it "
                f"dest={dest!r}, so that --use-ess-lr and its options are not silently ignored"
            )
    if missing:
        group = parser.add_argument_group("ESS learning-rate scaling (ess-patch)")
        for flags, kwargs in missing:
            group.add_argument(*flags, **kwargs)
    add_baseline_arguments(parser)
    return parser


def compose_custom_arguments(
    user: Callable[[argparse.ArgumentParser], Any] | None,
) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """The user's ``add_custom_arguments`` followed by ours (miles and slime accept one)."""

    def add(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if user is not None:
            returned = user(parser)
            parser = parser if returned is None else returned
        return add_ess_arguments(parser)

    return add


def given_options(
    args: Any, prefix: str = "ess_lr_", names: Iterable[str] | None = None
) -> dict[str, Any]:
    """The config fields (of ``names``, default all) whose option ``args`` holds a value for,
    in ``args.<prefix><field>`` (None: not given)."""
    wanted = [f.name for f in fields(EssLrConfig)] if names is None else list(names)
    values = {name: getattr(args, prefix + name, None) for name in wanted}
    return {name: value for name, value in values.items() if value is not None}


def config_from_args(args: Any) -> EssLrConfig:
    """The estimator settings: each ``--ess-lr-*`` option given in ``args``, else the config
    given to ``install()`` (``ESS_LR_*`` by default; read here when install() was not called,
    e.g. a tree patched with the ``patches/`` diffs), else :class:`EssLrConfig`'s default.

    Raises:
        ValueError: a value is out of range (the message names the field).
    """
    given = given_options(args)
    if STATE.config is None:
        return EssLrConfig.from_env(**given)  # the flags win over ESS_LR_*, in one build
    return replace(STATE.config, **given)


def shadow_requested(args: Any) -> bool:
    """Whether shadow mode is on: ``--ess-lr-shadow`` / ``--no-ess-lr-shadow``, else the
    installed config's ``shadow``, else ``ESS_LR_SHADOW`` (install() not called).

    Reads no other setting: a run without ESS-LR is not stopped by another malformed
    ``ESS_LR_*`` variable."""
    value = getattr(args, "ess_lr_shadow", None)
    if value is not None:
        return bool(value)
    if STATE.config is not None:
        return STATE.config.shadow
    key = "ESS_LR_SHADOW"
    return EssLrConfig.from_env({key: os.environ[key]} if key in os.environ else {}).shadow
