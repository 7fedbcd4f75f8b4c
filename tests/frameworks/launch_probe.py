"""The documented launch on ONE snapshot's real code, in a fresh process (test_launch.py runs
``report(FRAMEWORK, SNAPSHOT_FOLDER, CASES)`` there with ``fresh_python``, ``ESS_LR_*`` set).

Does what a user's ``train.py`` does: ``import ess_patch; ess_patch.install()`` (every
integration, ``ESS_LR_*`` read from this process's environment) before the framework is
imported, then the framework's real ``parse_args``. Returns plain data for the test to
compare with its expectations: per argv, the settings ``config_from_args`` gives (or the
error); then, after a re-install with no ``ESS_LR_*``, the same for the flags alone; and the
critic's real ``MegatronTrainRayActor.train_critic`` run up to its train step (its model
calls replaced), with the role seen by the advantage hook and what the real train-step log
function logged.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import os
import sys
from argparse import Namespace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from upstream import (  # noqa: E402
    ACTORS_PATCHED,
    MINIMAL_ARGV,
    parse_upstream_args,
    use_snapshot,
)

# slime v0.2.0 validates rollout_batch_size * n_samples_per_prompt % global_batch_size
BATCH = ("--global-batch-size", "4")


def parse(fw: str, argv: list[str]) -> dict:
    from ess_patch.integrations.flags import config_from_args

    try:  # argparse's own errors go to this process's stderr (the test shows its tail)
        args = parse_upstream_args(fw, [*MINIMAL_ARGV, *BATCH, *argv])
        return {"config": dataclasses.asdict(config_from_args(args)), "use": args.use_ess_lr}
    except SystemExit as exc:
        return {"error": f"SystemExit {exc.code}"}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


class _Stop(Exception):
    """Ends train_critic at its train step (the model's training is not under test)."""


class _Anything:
    """What the replaced model calls return: unpacks into two, takes any attribute."""

    def __iter__(self):
        return iter((_Anything(), _Anything()))

    def __len__(self):
        return 1

    def __getattr__(self, name):
        return _Anything()

    def __call__(self, *args, **kwargs):
        return _Anything()


def critic(fw: str, argv: list[str]) -> dict:
    """The real train_critic (wrapped by install()), its forward/train calls replaced: the
    role when its advantage call runs (rollout 0: loss_type is still policy_loss), and the
    train-step record the real log function writes for the critic afterwards."""
    import wrapt

    import ess_patch
    from ess_patch.state import STATE

    actor = importlib.import_module(f"{fw}.backends.megatron_utils.actor")
    args = parse_upstream_args(fw, [*MINIMAL_ARGV, *BATCH, *argv])
    args.num_critic_only_steps = 10**9  # no actor-critic data sync at rollout 0
    seen: dict = {}
    installed = vars(actor)["compute_advantages_and_returns"]
    takes_state = "parallel_state" in inspect.signature(installed.__wrapped__).parameters

    if takes_state:

        def compute_advantages_and_returns(args, parallel_state, rollout_data):
            seen.update(role=STATE.role, loss_type=args.loss_type)
    else:

        def compute_advantages_and_returns(args, rollout_data):
            seen.update(role=STATE.role, loss_type=args.loss_type)

    def train(*a, **k):
        raise _Stop

    replaced = {
        "get_data_iterator": lambda *a, **k: _Anything(),
        "forward_only": lambda *a, **k: {},
        # the advantage routine behind ess-patch's own installed wrapper (the real one needs
        # process groups; the role check happens in the wrapper, before anything is computed)
        "compute_advantages_and_returns": wrapt.FunctionWrapper(
            compute_advantages_and_returns, installed._self_wrapper
        ),
        "train": train,
    }
    saved = {name: vars(actor)[name] for name in replaced}
    vars(actor).update(replaced)
    rollout_data = {"num_microbatches": [1], "global_batch_sizes": [4], "log_probs": None}
    host = _Anything()  # the actor's self: model, optimizer... never really used
    host.args = args
    records: list = []  # ess-patch's warnings: the critic must have none
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("ess_patch").addHandler(handler)
    try:
        actor.MegatronTrainRayActor.train_critic(host, 0, rollout_data)
    except _Stop:
        pass
    finally:
        vars(actor).update(saved)
        logging.getLogger("ess_patch").removeHandler(handler)
    out = {
        "wrapped": ess_patch.patching.is_ours(vars(actor.MegatronTrainRayActor)["train_critic"]),
        "seen": seen,
        "warnings": [r.getMessage() for r in records],
        "role_after": STATE.role,
        "logged": critic_log(fw),
    }
    return out


def critic_log(fw: str) -> dict:
    """What the critic's train-step record holds through the real log function."""
    if fw == "miles":
        from miles.backends.training_utils import log_utils

        return log_utils.log_train_step(
            Namespace(), {"value_loss": 1.0}, 0.5, 0, 0, 1, role="critic", should_log=False
        )
    from ess_patch.integrations.slime import SLIME_HISTORY

    importlib.import_module("slime.backends.megatron_utils.model")
    module = importlib.import_module(SLIME_HISTORY.choose("metrics").label.rsplit(".", 1)[0])
    logged: list = []
    module.wandb = Namespace(log=logged.append)
    args = Namespace(use_wandb=True, use_tensorboard=False)
    module.log(args, {"train/critic-value_loss": 1.0, "train/step": 0}, step_key="train/step")
    return logged[0]


def _outcome(call) -> dict:
    """``call()``'s return value, or its error as text (argparse's exit as ``SystemExit``)."""
    try:
        return {"value": call()}
    except SystemExit as exc:
        return {"error": f"SystemExit {exc.code}"}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _advantages(fw: str, args) -> None:
    """The train actor's own reference to the (installed) advantage routine, as its train()
    calls it; ess-patch's checks run before upstream's code."""
    actor = importlib.import_module(f"{fw}.backends.megatron_utils.actor")
    actor.compute_advantages_and_returns(args, {"num_microbatches": [2], "log_probs": None})


def unpatched_driver(fw: str, folder: str) -> dict:
    """A driver that never installed ess-patch parses ``--use-ess-lr`` with the real
    ``parse_args``; then this process becomes a train actor started with
    ``ESS_PATCH_AUTO_INSTALL`` (what the ``.pth`` does: ``install()``) and gets those args."""
    use_snapshot(fw, folder, "full")
    parsed = _outcome(lambda: parse_upstream_args(fw, [*MINIMAL_ARGV, *BATCH, "--use-ess-lr"]))
    if "error" in parsed:  # refused loudly: nothing to catch later
        return {"parse": parsed["error"]}
    import ess_patch

    os.environ["ESS_PATCH_AUTO_INSTALL"] = "1"
    ess_patch.install()
    args = parsed["value"]
    return {
        "parse": {"has_use_ess_lr": hasattr(args, "use_ess_lr")},
        "actor": _outcome(lambda: _advantages(fw, args)),
    }


def actors(fw: str, env: dict) -> dict:
    """The driver / actor split (issue 35), through the real ``parse_args`` and the installed
    advantage routine of the actor module (its checks run before upstream's code):

    - ``unpatched_actors``: ``--use-ess-lr`` with nothing that patches the train actors;
    - ``env_vars``: ``--train-env-vars`` with the auto-install, the ``.pth`` on disk or not;
    - ``resolved``: the driver, with ``env`` (``ESS_LR_*``), writes every setting into args;
      an actor without those variables reads the same config from args;
    - ``disagree``: an actor whose own ``ESS_LR_FLOOR`` differs from the driver's.
    """
    import ess_patch
    from ess_patch.integrations.flags import config_from_args

    base = [a for a in MINIMAL_ARGV if a not in ACTORS_PATCHED]
    out: dict = {}
    ess_patch.uninstall()
    os.environ.update(env)
    ess_patch.install()
    out["unpatched_actors"] = _outcome(
        lambda: parse_upstream_args(fw, [*base, *BATCH, "--use-ess-lr"])
    )
    auto = '{"ESS_PATCH_AUTO_INSTALL": "1"}'
    out["env_vars"] = _outcome(
        lambda: parse_upstream_args(fw, [*base, *BATCH, "--use-ess-lr", "--train-env-vars", auto])
    )
    args = parse_upstream_args(fw, [*MINIMAL_ARGV, *BATCH, "--use-ess-lr"])
    out["driver_env"] = args.ess_lr_driver_env
    # an actor process: none of the driver's ESS_LR_* in its environment
    ess_patch.uninstall()
    for key in env:
        del os.environ[key]
    ess_patch.install()
    out["resolved"] = dataclasses.asdict(config_from_args(args))
    os.environ["ESS_LR_FLOOR"] = "0.2"
    out["disagree"] = _outcome(lambda: _advantages(fw, args))
    del os.environ["ESS_LR_FLOOR"]
    return out


def report(fw: str, folder: str, cases: dict) -> dict:
    """The cases (argv lists under "env", "plain" and "critic") on ``fw`` imported from
    ``folder``, as plain data. An unexpected error propagates: the fresh interpreter fails
    and the test shows its traceback."""
    use_snapshot(fw, folder, "full")
    import ess_patch

    ess_patch.install()  # the documented recipe: every integration, before the framework
    from ess_patch.install import INSTALLATION, failed_integrations

    out: dict = {"integrations": sorted(INSTALLATION.patches or {})}
    out["env"] = {name: parse(fw, argv) for name, argv in cases["env"].items()}
    # the same flags without any ESS_LR_*: a fresh install() reads the cleared environment
    ess_patch.uninstall()
    for key in [k for k in os.environ if k.startswith("ESS_LR_")]:
        del os.environ[key]
    ess_patch.install()
    out["plain"] = {name: parse(fw, argv) for name, argv in cases["plain"].items()}
    out["critic"] = critic(fw, cases["critic"])
    out["failed"] = failed_integrations()
    out["actors"] = actors(fw, cases["actors_env"])
    return out
