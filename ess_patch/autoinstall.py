"""Activate ess-patch in every process of a job with one environment variable.

miles and slime parse arguments in a driver but train in Ray actor processes. Setting
``ESS_PATCH_AUTO_INSTALL=1`` in those processes' environment (for example with
``--train-env-vars '{"ESS_PATCH_AUTO_INSTALL": "1"}'``, which both frameworks copy into
every train actor's ``runtime_env``) makes the ``ess_patch-autoinstall.pth`` file that the
wheel puts in site-packages call :func:`run` at interpreter start-up: ``install()`` runs
before any framework module is imported. Without the variable, the ``.pth`` line reads one
environment variable and imports nothing.

The value is ``1``/``true``/``yes``/``on`` (install the integrations named by
``ESS_PATCH_INTEGRATIONS``, default all) or a comma-separated list of integration names.

``ESS_LR_ENABLE`` (verl's request for ESS-LR, set through Ray's ``runtime_env``) in a process's
environment is a request too: a verl worker that was given it without the auto-install variable
is patched, so its hooks apply the scale or refuse, instead of training unscaled.

``--use-ess-lr`` (or ``--ess-lr-shadow``) on a process's own command line is a request too: the
``.pth`` installs then as with ``ESS_PATCH_AUTO_INSTALL=1``. A driver that forgot
``install()`` would otherwise hand them to a parser that drops unknown arguments without a
word (slime >= v0.3.0); patched, the driver parses them and checks that its actors are patched.

A failed auto-install stops every optimizer step of the process (``guard.fail_closed_after``).
"""

from __future__ import annotations

import logging
import os

from .guard import AUTO_INSTALL as ENV
from .guard import auto_install_requested as requested
from .integrations.verl.config import ENV_ENABLE, enable_requested

__all__ = ["ENV", "FLAGS", "megatron_init", "requested", "requested_by_argv", "run"]

logger = logging.getLogger(__name__)

#: Command-line flags that request ESS-LR in the process that parses them.
FLAGS = ("--use-ess-lr", "--ess-lr-shadow")


def requested_by_argv(argv: list[str] | None = None) -> bool:
    """Whether this process's command line asks for ESS-LR (``--use-ess-lr``,
    ``--ess-lr-shadow``)."""
    import sys

    return any(arg in FLAGS for arg in (getattr(sys, "argv", []) if argv is None else argv))


def run() -> bool:
    """Install if the environment asks for it; never raises (it runs at start-up).

    Idempotent: ``site`` reads a virtualenv's site-packages twice, so the ``.pth`` line can
    run twice in one process; the second call does nothing and says nothing. A failure is
    logged once: a bad ``ESS_LR_*`` value as one line naming it, anything else with its
    traceback. Returns whether ess-patch is installed afterwards. After a failure,
    :func:`ess_patch.arm` and every torch optimizer step in this process raise an error that
    says the auto-install failed and why, while processes that never step an optimizer (a
    rollout engine) run on.
    """
    from .guard import fail_closed_after
    from .install import INSTALLATION, install, is_installed

    raw = os.environ.get(ENV, "")
    wanted = requested()
    if wanted is None and requested_by_argv():
        wanted = ""
        raw = "(--use-ess-lr on the command line)"
        logger.info("ess-patch: installing: ESS-LR is requested on this command line")
    if wanted is None and enable_requested():
        wanted = ""
        raw = f"(unset; {ENV_ENABLE} is on)"
        logger.info("ess-patch: installing: %s asks for ESS-LR in this process", ENV_ENABLE)
    if wanted is None:
        return False
    if INSTALLATION.autoinstall is not None:
        return is_installed()
    INSTALLATION.autoinstall = "attempted"
    try:
        install(wanted or None)
    except ValueError as exc:  # a setting the user gave (ESS_LR_FLOOR=5, an unknown name)
        INSTALLATION.autoinstall = f"failed: {exc}"
        INSTALLATION.autoinstall_error = exc  # arm() in this process raises it, named
        fail_closed_after(exc)  # and so does every optimizer step
        logger.error(
            "ess-patch: %s=%r was set but not installed in this process: %s", ENV, raw, exc
        )
    except Exception as exc:  # a broken start-up must say so loudly, not kill every process
        INSTALLATION.autoinstall = f"failed: {type(exc).__name__}: {exc}"
        INSTALLATION.autoinstall_error = exc
        fail_closed_after(exc)
        logger.exception("ess-patch: %s=%r was set but install() failed", ENV, raw)
    else:
        INSTALLATION.autoinstall = "installed"
    return is_installed()


def megatron_init(args: object = None) -> None:
    """For ``--custom-megatron-init-path ess_patch.autoinstall.megatron_init`` (Megatron
    backends of miles and slime): install in the train actor if not done yet."""
    from .install import install, is_installed

    if not is_installed():
        install()
