"""ess-patch on ONE snapshot's real code, in a fresh process (test_history.py runs
``report(FRAMEWORK, SNAPSHOT_FOLDER)`` there with ``fresh_python`` and gets its result back).

Returns what it saw (plain data) for the test to compare with hand-written expectations:
the shapes install() chose and recorded, the metrics the real train-step log function
returned or logged, the flags through the real ``parse_args``, and, for symbols removed
from the imported host, the error install() raised and whether anything stayed patched.
A snapshot per process: two versions of one framework cannot share ``sys.modules``.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
from argparse import Namespace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from upstream import MINIMAL_ARGV, parse_upstream_args, use_snapshot  # noqa: E402

LOG_MODULES = (
    "slime.observability.logging_utils",
    "slime.utils.logging_utils",
    "slime.utils.tracking_utils",
)
# slime v0.2.0 validates rollout_batch_size * n_samples_per_prompt % global_batch_size
BATCH = ("--global-batch-size", "4")
RESULT = dict(scale=0.5, rho=0.25, ess=2.0, num_trajectories=8)


def _existing(names):
    out = []
    for name in names:
        try:
            out.append(importlib.import_module(name))
        except ModuleNotFoundError as exc:
            if not (name + ".").startswith(f"{exc.name}."):
                raise
    return out


def _nothing_patched(fw: str) -> bool:
    from ess_patch.install import INTEGRATIONS
    from ess_patch.patching import is_ours

    for target in INTEGRATIONS[fw].targets:
        module = sys.modules.get(target.module)
        holder = module
        for part in filter(None, target.owner.split(".")):
            holder = getattr(holder, part, None)
        if holder is not None and is_ours(vars(holder).get(target.attribute)):
            return False
    return True


def slime_import_time_error() -> dict:
    """The train-step module imported while no known log location has ``log``: the import
    goes on, slime is rolled back (parse_args unwrapped) and the reason is recorded."""
    import ess_patch
    from ess_patch.install import INSTALLATION, failed_integrations
    from ess_patch.state import reset

    removed = [(m, vars(m)["log"]) for m in _existing(LOG_MODULES) if "log" in vars(m)]
    for module, _ in removed:
        delattr(module, "log")
    ess_patch.install("slime")
    importlib.import_module("slime.utils.arguments")
    wrapped_before = not _nothing_patched("slime")
    try:
        importlib.import_module("slime.backends.megatron_utils.model")  # must not raise
    finally:
        for module, original in removed:
            module.log = original
    error = failed_integrations().get("slime")
    out = {
        "removed": [m.__name__ for m, _ in removed],
        "wrapped_before": wrapped_before,
        "error": error,
        "still_installed": sorted(INSTALLATION.patches or {}),
        "nothing_patched": _nothing_patched("slime"),
    }
    ess_patch.uninstall()
    reset()
    return out


def _applied(result) -> None:
    """Arm ``result`` and run one optimizer step that applies it (an attach()ed torch SGD): the
    metrics report what a step applied, read back from it."""
    import torch

    import ess_patch

    param = torch.nn.Parameter(torch.ones(1))
    optimizer = ess_patch.attach(torch.optim.SGD([param], lr=0.5))
    ess_patch.arm(result)
    param.grad = torch.ones(1)
    optimizer.step()
    ess_patch.detach(optimizer)


def miles_metrics() -> dict:
    from miles.backends.megatron_utils import model
    from miles.backends.training_utils import log_utils

    import ess_patch

    args = Namespace()
    common = dict(loss_dict={"loss": 1.0}, grad_norm=0.5, rollout_id=1, step_id=2)
    plain = log_utils.log_train_step(args, *common.values(), 4, should_log=False)
    _applied(ess_patch.EssLrResult(**RESULT))
    try:
        # positional, through the name megatron_utils.model imported (as train() calls it)
        positional = model.log_train_step(
            args, *common.values(), 4, "actor", {"lr-pg_0": 1e-3}, False
        )
        keywords = log_utils.log_train_step(
            args=args,
            **common,
            num_steps_per_rollout=4,
            extra_metrics={"lr-pg_0": 1e-3},
            should_log=False,
        )
        critic = log_utils.log_train_step(
            args, *common.values(), 4, role="critic", should_log=False
        )
        ess_patch.arm(ess_patch.EssLrResult.noop("missing"))  # a rollout nothing measured
        unmeasured = log_utils.log_train_step(args, *common.values(), 4, should_log=False)
    finally:
        ess_patch.disarm()
    return {
        "plain": plain,
        "positional": positional,
        "keywords": keywords,
        "critic": critic,
        "unmeasured": unmeasured,
    }


def slime_metrics() -> dict:
    import ess_patch
    from ess_patch.integrations.slime import SLIME_HISTORY

    module = importlib.import_module(SLIME_HISTORY.choose("metrics").label.rsplit(".", 1)[0])
    logged: list = []
    module.wandb = Namespace(log=logged.append)  # the module's own reference, as slime's test
    args = Namespace(use_wandb=True, use_tensorboard=False)
    module.log(args, {"train/loss": 1.0, "train/step": 3}, step_key="train/step")
    _applied(ess_patch.EssLrResult(**RESULT))
    try:
        module.log(args, {"train/loss": 1.0, "train/step": 3}, step_key="train/step")
        module.log(args, {"train/loss": 1.0, "train/step": 4}, "train/step")
        module.log(args, {"rollout/x": 1.0, "rollout/step": 3}, step_key="rollout/step")
        ess_patch.arm(ess_patch.EssLrResult.noop("missing"))  # a rollout nothing measured
        module.log(args, {"train/loss": 1.0, "train/step": 5}, step_key="train/step")
    finally:
        ess_patch.disarm()
    return {"module": module.__name__, "logged": logged}


def parse_checks(fw: str) -> dict:
    from ess_patch.integrations.flags import config_from_args

    def attempt(argv):
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                args = parse_upstream_args(fw, [*MINIMAL_ARGV, *BATCH, *argv])
            # the floor the hook uses (the option itself is None when not given)
            return {"use_ess_lr": args.use_ess_lr, "floor": config_from_args(args).floor}
        except (ValueError, SystemExit, AssertionError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    out = {
        "off": attempt([]),
        "on": attempt(["--use-ess-lr", "--ess-lr-floor", "0.2"]),
        # measured inside the loss, one ESS per step: refused with 2 steps per rollout
        "no_train_logprobs": attempt(
            ["--use-ess-lr", "--use-rollout-logprobs", "--global-batch-size", "2"]
        ),
    }
    with contextlib.redirect_stderr(io.StringIO()):
        has_multi_lora = hasattr(parse_upstream_args(fw, [*MINIMAL_ARGV, *BATCH]), "multi_lora")
    if has_multi_lora:  # miles from 2026-07-21
        lora = ["--lora-rank", "8", "--target-modules", "linear_qkv"]
        out["multi_lora"] = attempt(["--use-ess-lr", "--multi-lora-n-adapters", "2", *lora])
    return out


def removal_errors(fw: str) -> list[dict]:
    """Each required symbol removed from the imported host in turn: install() raises one
    MissingTargetError and leaves nothing of ``fw`` patched."""
    import ess_patch
    from ess_patch.patching import MissingTargetError

    if fw == "miles":
        parallel = importlib.import_module("miles.backends.training_utils.parallel")
        loss = importlib.import_module("miles.backends.training_utils.loss")
        log_utils = importlib.import_module("miles.backends.training_utils.log_utils")
        groups = (
            (parallel, "get_parallel_state")
            if hasattr(parallel, "get_parallel_state")
            else (loss, "compute_advantages_and_returns")
        )
        cases = [groups, (log_utils, "log_train_step")]
    else:
        from ess_patch.integrations.slime import SLIME_HISTORY

        loss = importlib.import_module("slime.backends.megatron_utils.loss")
        log_module = importlib.import_module(
            SLIME_HISTORY.choose("metrics").label.rsplit(".", 1)[0]
        )
        cases = [(loss, "compute_advantages_and_returns"), (log_module, "log")]
    out = []
    for module, name in cases:
        original = vars(module)[name]
        delattr(module, name)
        error = None
        try:
            ess_patch.install(fw)
        except MissingTargetError as exc:
            error = str(exc)
        finally:
            setattr(module, name, original)
        out.append(
            {
                "removed": f"{module.__name__}.{name}",
                "error": error,
                "installed": ess_patch.is_installed(),
                "nothing_patched": _nothing_patched(fw),
            }
        )
        if ess_patch.is_installed():
            ess_patch.uninstall()
    return out


def loss_hooks(fw: str) -> dict[str, bool]:
    """Whether the policy loss the train loop calls, and the ``get_log_probs_and_entropy`` it
    looks up, are ess-patch's wrappers (the loss ledger measures there) in this snapshot."""
    from ess_patch.patching import is_ours

    candidates = (
        ("miles.backends.training_utils.loss_hub.losses", "miles.backends.training_utils.loss")
        if fw == "miles"
        else ("slime.backends.megatron_utils.loss",)
    )
    for name in candidates:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        loss = getattr(module, "policy_loss_function", None)
        if loss is None:
            continue
        # the name the loss body resolves at call time: its own module's global
        looked_up = loss.__wrapped__.__globals__.get("get_log_probs_and_entropy")
        return {
            "policy_loss_function": is_ours(loss),
            "get_log_probs_and_entropy": is_ours(looked_up),
        }
    return {}


def report(fw: str, folder: str) -> dict:
    """Everything above on ``fw`` imported from ``folder``, as plain data. An unexpected
    error propagates: the fresh interpreter fails and the test shows its traceback."""
    use_snapshot(fw, folder, "full")
    import ess_patch
    from ess_patch.install import installed_shapes

    out: dict = {}
    if fw == "slime":
        out["import_error"] = slime_import_time_error()
    ess_patch.install(fw)
    loss = "training_utils.loss" if fw == "miles" else "megatron_utils.loss"
    importlib.import_module(f"{fw}.backends.{loss}")
    importlib.import_module(f"{fw}.backends.megatron_utils.model")
    out["shapes"] = installed_shapes()[fw]
    out["loss_hooks"] = loss_hooks(fw)
    out["targets"] = ess_patch.installed_targets()
    out["metrics"] = miles_metrics() if fw == "miles" else slime_metrics()
    out["parse"] = parse_checks(fw)
    ess_patch.uninstall()
    out["removals"] = removal_errors(fw)
    return out
