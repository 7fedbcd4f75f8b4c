"""ess-patch inside the REAL miles and slime code (snapshots in ../shared/upstream).

- the real parsers accept the flags after install(), reject bad floors and the combinations
  that can never give train log-probs, and leave every other default unchanged;
- the real ``compute_advantages_and_returns`` in the gloo harness (CP=2 x DP=2, inputs
  sliced as each framework slices them) arms on every rank the single-process reference
  scale, and its own outputs stay bitwise identical; disabled, nothing changes at all;
- miles' real ``train()`` -> ``train_one_step`` -> optimizer / scheduler -> ``log_train_step``
  shows the scaled update, the restored LR and the metrics; slime's real ``log`` gets them;
- the FSDP backend's plain torch optimizer and miles' own FSDP LR scheduler.

With ``ESS_PATCH_TEST_MODE=vendored`` the same tests run against trees patched with
``patches/`` (``MILES_SRC`` / ``SLIME_SRC`` pointing at patched copies, a patched megatron-core
first on ``PYTHONPATH``) and never call ``install()``: where a test would install, it checks
that every target it can see carries the diff's call site instead, and its "plain" baseline
is the upstream function under the decorator. tests/frameworks/test_vendored_frameworks.py
runs it that way.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared helpers
from dist_helpers import CollectiveCounter
from harness import run_ranks
from reference import reference_ess
from rollouts import CP, DP, SHAPES, host_args, local_batch, rollout
from upstream import (
    ENV_VARS,
    MINIMAL_ARGV,
    miles_parallel_state,
    no_snapshot_param,
    parse_upstream_args,
    skip_reason,
    snapshots,
    tier_reason,
    use_snapshot,
)

import ess_patch

FULL = {fw: skip_reason(fw, "full") for fw in ("miles", "slime")}
LOSS = {fw: skip_reason(fw, "loss") for fw in ("miles", "slime")}

# The trees on the path are patched with patches/ (see the module docstring).
VENDORED = os.environ.get("ESS_PATCH_TEST_MODE") == "vendored"


def _install(integrations) -> None:
    """``ess_patch.install(integrations)``; in vendored mode, a check that every target of
    theirs whose module is imported already calls ess-patch through the diff, instead."""
    if not VENDORED:
        ess_patch.install(integrations)
        return
    from ess_patch import patching
    from ess_patch.install import INTEGRATIONS

    names = [integrations] if isinstance(integrations, str) else list(integrations)
    seen = 0
    for name in names:
        for target in INTEGRATIONS[name].targets:
            if target.module not in sys.modules or not target.vendored:  # install()-only
                continue
            status = patching.target_status(target)
            if status == patching.MISSING and not target.required:
                continue
            assert status == patching.VENDORED, f"{target.path} is not patched (vendored mode)"
            seen += 1
    assert seen, f"vendored mode: no target of {names} is imported yet"
    assert not ess_patch.is_installed()


def _hooked(obj) -> bool:
    """Whether ess-patch's hook is on ``obj``: install()'s wrapper, or the diff's call site."""
    from ess_patch.patching import is_ours
    from ess_patch.vendored import is_vendored

    return is_vendored(obj) if VENDORED else is_ours(obj)


@contextlib.contextmanager
def _upstream(module, name: str):
    """``module.name`` as upstream wrote it, for a baseline: in vendored mode the function
    under the diff's decorator; else unchanged (install() has not run yet)."""
    if not VENDORED:
        yield
        return
    from ess_patch.vendored import is_vendored

    decorated = getattr(module, name)
    assert is_vendored(decorated), f"{module.__name__}.{name} is not patched (vendored mode)"
    setattr(module, name, decorated.__wrapped__)
    try:
        yield
    finally:
        setattr(module, name, decorated)


def _needs(tier: dict, fw: str):
    return pytest.mark.skipif(tier[fw] is not None, reason=tier[fw] or "")


def _framework_params(tier: dict):
    return [pytest.param(fw, marks=_needs(tier, fw)) for fw in ("miles", "slime")]


def _snapshot_params(tier: str = "loss"):
    """One param per snapshot folder (``upstream.snapshots()``: every ``miles-*`` /
    ``slime-*`` under ``$ESS_PATCH_UPSTREAM``); vendored mode: the patched trees only."""
    if VENDORED:
        found = [(fw, Path(os.environ[ENV_VARS[fw]])) for fw in ("miles", "slime")]
    else:
        found = snapshots()
    if not found:
        return [no_snapshot_param()]
    return [
        pytest.param(
            fw,
            str(folder),
            id=folder.name,
            marks=pytest.mark.skipif(
                tier_reason(fw, tier) is not None, reason=tier_reason(fw, tier) or ""
            ),
        )
        for fw, folder in found
    ]


# --- flags --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fw", _framework_params(FULL))
def test_parser_accepts_the_flags_and_changes_no_default(fw, clean_ess):
    args_module = importlib.import_module(f"{fw}.utils.arguments")
    with _upstream(args_module, "parse_args"):
        plain = parse_upstream_args(fw, MINIMAL_ARGV)
    _install(["megatron", fw])
    off = parse_upstream_args(fw, MINIMAL_ARGV)
    on = parse_upstream_args(fw, [*MINIMAL_ARGV, "--use-ess-lr", "--ess-lr-floor", "0.2"])
    assert on.use_ess_lr is True and on.ess_lr_floor == 0.2
    # each option not given: the settings then come from install() (ESS_LR_*), not argparse
    assert (off.use_ess_lr, off.ess_lr_floor, off.ess_lr_weight_mode) == (False, None, None)
    baseline = {"use_ess_baseline", "ess_baseline_shadow", "ess_baseline_path"}
    assert {k: getattr(off, k) for k in baseline} == dict.fromkeys(baseline)  # off: not given
    ours = {k for k in vars(off) if k == "use_ess_lr" or k.startswith("ess_lr_")} | baseline
    assert ours - baseline == {
        "use_ess_lr",
        "ess_lr_floor",
        "ess_lr_weight_mode",
        "ess_lr_rule",
        "ess_lr_base_ratio",
        "ess_lr_nonfinite",
        "ess_lr_shadow",
        "ess_lr_granularity",
        "ess_lr_weight_clip",
        "ess_lr_calibrate_rollouts",
        "ess_lr_warn_threshold",
        "ess_lr_warn_patience",
    }
    before = {k: repr(v) for k, v in vars(plain).items()}
    after = {k: repr(v) for k, v in vars(off).items() if k not in ours}
    assert after == before


@pytest.mark.parametrize("fw", _framework_params(FULL))
@pytest.mark.parametrize("floor", ["0", "1.5", "abc"])
def test_parser_rejects_a_bad_floor(fw, floor, clean_ess):
    _install(["megatron", fw])
    stderr = io.StringIO()
    with pytest.raises(SystemExit) as info, contextlib.redirect_stderr(stderr):
        parse_upstream_args(fw, [*MINIMAL_ARGV, "--use-ess-lr", "--ess-lr-floor", floor])
    assert info.value.code == 2
    assert "argument --ess-lr-floor" in stderr.getvalue()
    assert ("must be in (0, 1]" if floor != "abc" else "is not a number") in stderr.getvalue()


@pytest.mark.parametrize("fw", _framework_params(FULL))
def test_parser_rejects_settings_that_never_give_train_log_probs(fw, clean_ess):
    _install(["megatron", fw])
    # measured inside the loss, one ESS per optimizer step: refused with 2 steps per rollout
    argv = [*MINIMAL_ARGV, "--global-batch-size", "2", "--use-ess-lr", "--use-rollout-logprobs"]
    with pytest.raises(ValueError, match="--use-rollout-logprobs without --get-mismatch-metrics"):
        parse_upstream_args(fw, argv)
    # the same settings without ESS-LR are fine
    assert parse_upstream_args(fw, [*MINIMAL_ARGV, "--use-rollout-logprobs"]).use_rollout_logprobs


@pytest.mark.parametrize("fw", _framework_params(FULL))
def test_parser_takes_shadow_mode_and_refuses_it_with_use_ess_lr(fw, clean_ess):
    _install(["megatron", fw])
    shadow = parse_upstream_args(fw, [*MINIMAL_ARGV, "--ess-lr-shadow"])
    assert (shadow.ess_lr_shadow, shadow.use_ess_lr) == (True, False)
    with pytest.raises(ValueError, match=r"--use-ess-lr and --ess-lr-shadow .* both on"):
        parse_upstream_args(fw, [*MINIMAL_ARGV, "--use-ess-lr", "--ess-lr-shadow"])


@pytest.mark.parametrize("fw", _framework_params(FULL))
def test_user_custom_arguments_still_apply(fw, clean_ess):
    _install(["megatron", fw])

    def add(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--my-flag", type=int, default=7)
        return parser

    args = parse_upstream_args(fw, [*MINIMAL_ARGV, "--use-ess-lr"], add)
    assert args.my_flag == 7 and args.use_ess_lr


# --- the advantage hook, in the gloo harness ------------------------------------------------------


def _advantages(compute, args, batch):
    data = {k: None if v is None else list(v) for k, v in batch.items()}
    with CollectiveCounter() as counter:
        compute(args, data)
    return data["advantages"], [name for name, _ in counter.calls]


def _bind_state(compute, state):
    """miles before 2026-04-04 takes the ParallelState as an argument, as its actors pass it:
    ``compute_advantages_and_returns(self.args, self.parallel_state, rollout_data)``."""
    import inspect

    if "parallel_state" not in inspect.signature(compute).parameters:
        return compute
    return lambda args, data: compute(args, state, data)


def rank_advantage_hook(fw: str, snapshot: str | None = None, rollout_log_probs=True) -> dict:
    """The real routine before and after install(), off / shadow / on / critic; without
    ``rollout_log_probs`` (a custom rollout function that fills none): what it raises."""
    import inspect

    from megatron.core import parallel_state as mpu

    if snapshot is not None:
        use_snapshot(fw, snapshot)
    state = None
    if fw == "miles":
        import miles.backends.training_utils.loss as loss
        from miles.backends.training_utils.cp_utils import slice_log_prob_with_cp

        state = miles_parallel_state()
    else:
        import slime.backends.megatron_utils.loss as loss
        from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp
    slice_lp = slice_log_prob_with_cp
    if "parallel_state" in inspect.signature(slice_log_prob_with_cp).parameters:  # miles 2026-01

        def slice_lp(lp, total, response):
            return slice_log_prob_with_cp(lp, total, response, state)

    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=False)
    dp_size = mpu.get_data_parallel_world_size(with_context_parallel=False)
    _, batch = local_batch(slice_lp, dp_rank, dp_size)

    def compute():  # looked up at each call: install() replaces the module attribute
        return _bind_state(loss.compute_advantages_and_returns, state)

    if not rollout_log_probs:
        batch["rollout_log_probs"] = None
        _install(["megatron", fw])
        try:
            _advantages(compute(), host_args(fw, True), batch)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "armed": ess_patch.armed()}
        return {"error": None, "armed": ess_patch.armed()}
    with _upstream(loss, "compute_advantages_and_returns"):
        plain, plain_calls = _advantages(compute(), host_args(fw, True), batch)
    _install(["megatron", fw])
    from ess_patch.install import installed_shapes

    shapes = installed_shapes().get(fw)
    off, off_calls = _advantages(compute(), host_args(fw, False), batch)
    armed_when_off = ess_patch.armed()
    shadow_args = host_args(fw, False)
    shadow_args.ess_lr_shadow = True
    shadow_out, shadow_calls = _advantages(compute(), shadow_args, batch)
    armed_when_shadow = ess_patch.armed()
    shadow = ess_patch.state.STATE.shadow
    on, on_calls = _advantages(compute(), host_args(fw, True), batch)
    result = ess_patch.armed()
    critic_args = host_args(fw, True)
    critic_args.loss_type = "value_loss"
    _advantages(compute(), critic_args, batch)
    if not VENDORED:
        ess_patch.uninstall()
    return {
        "off_identical": all(torch.equal(a, b) for a, b in zip(plain, off, strict=True)),
        "on_identical": all(torch.equal(a, b) for a, b in zip(plain, on, strict=True)),
        "armed_when_off": armed_when_off,
        "calls": (plain_calls, off_calls, on_calls),
        "shadow_identical": all(torch.equal(a, b) for a, b in zip(plain, shadow_out, strict=True)),
        "armed_when_shadow": armed_when_shadow,
        "shadow_calls": shadow_calls,
        "shadow": None if shadow is None else (shadow.scale, shadow.rho, shadow.status),
        "result": None if result is None else (result.scale, result.rho, result.status),
        "critic_role": ess_patch.state.STATE.role,
        "shapes": shapes,
    }


@pytest.mark.dist
@pytest.mark.parametrize(("fw", "snapshot"), _snapshot_params("loss"))
def test_advantage_hook_arms_the_reference_scale_on_every_rank(fw, snapshot, tmp_path):
    """Every snapshot folder: the real routine, patched by install(), in DP2 x CP2."""
    results = run_ranks(
        rank_advantage_hook, dp=DP, cp=CP, args=(fw, snapshot), tmp_path=tmp_path, timeout=120
    )
    full = rollout()
    ref = reference_ess(
        [s["log_probs"] for s in full],
        [s["rollout_log_probs"] for s in full],
        [s["loss_mask"] for s in full],
        mode="product",
    )
    assert len(SHAPES) == 8 and ref["rho"] < 0.99  # a real check, not rho = 1
    scales = {r["result"] for r in results}
    assert len(scales) == 1, scales  # every rank armed exactly the same result
    scale, rho, status = scales.pop()
    assert status == "ok"
    assert rho == pytest.approx(ref["rho"], rel=1e-6)
    assert scale == pytest.approx(ref["scale"], rel=1e-6)
    for r in results:
        assert r["off_identical"] and r["on_identical"]  # advantages bitwise unchanged
        assert r["armed_when_off"] is None
        plain_calls, off_calls, on_calls = r["calls"]
        assert off_calls == plain_calls  # disabled: not one extra collective
        # shadow mode: the same collectives and the same result as enabled, nothing armed
        assert r["shadow_identical"] and r["armed_when_shadow"] is None
        assert r["shadow_calls"] == on_calls
        assert r["shadow"] == r["result"]
        # CP: envelopes, then the table; DP: summaries with envelopes
        assert on_calls == [*plain_calls, "all_gather", "all_reduce", "all_gather"]
        assert r["critic_role"] == "critic"
        if not VENDORED:  # the shape install() chose for this snapshot, recorded
            assert r["shapes"].startswith(f"{fw}: groups from ") and "hook " in r["shapes"]


@pytest.mark.dist
@pytest.mark.parametrize("fw", _framework_params(LOSS))
def test_a_rollout_without_rollout_log_probs_stops_the_run_on_every_rank(fw, tmp_path):
    """A custom rollout function that fills no ``rollout_log_probs``: 0.3.0 warned per rank per
    rollout and trained unscaled; now every rank of DP2 x CP2 raises the same clear error."""
    results = run_ranks(
        rank_advantage_hook, dp=DP, cp=CP, args=(fw, None, False), tmp_path=tmp_path, timeout=120
    )
    assert len(results) == DP * CP
    for r in results:
        assert r["armed"] is None
        assert r["error"].startswith(f"EssLrNotAppliedError: ess-patch ({fw}): ESS-LR was req")
        assert "the rollout engine returned no log-probs" in r["error"]
        assert "Sample.rollout_log_probs" in r["error"]


def rank_pipeline_hook(fw: str, snapshot: str) -> dict:
    """PP=2: only the last stage has train log-probs (miles returns early on the others);
    every stage must arm the last stage's result, whatever the version's PP source."""
    from megatron.core import parallel_state as mpu

    use_snapshot(fw, snapshot)
    import miles.backends.training_utils.loss as loss

    state = miles_parallel_state()
    batch = _one_rollout_batch()
    if not mpu.is_pipeline_last_stage():
        batch.pop("log_probs")  # what a non-last stage's actor has
    _install(["megatron", fw])
    from ess_patch.install import installed_shapes

    compute = _bind_state(loss.compute_advantages_and_returns, state)
    compute(host_args(fw, True), batch)  # returns early (no advantages) on a non-last stage
    result = ess_patch.armed()
    return {
        "last": mpu.is_pipeline_last_stage(),
        "result": None if result is None else (result.scale, result.rho, result.status),
        "shapes": None if VENDORED else installed_shapes()[fw],
    }


@pytest.mark.dist
@pytest.mark.parametrize(
    ("fw", "snapshot"), [p for p in _snapshot_params("loss") if p.values[0] in ("miles", None)]
)
def test_every_pipeline_stage_arms_the_last_stages_result(fw, snapshot, tmp_path):
    results = run_ranks(rank_pipeline_hook, pp=2, args=(fw, snapshot), tmp_path=tmp_path)
    rollout = _one_rollout_batch()
    ref = reference_ess(
        rollout["log_probs"], rollout["rollout_log_probs"], rollout["loss_masks"], mode="product"
    )
    assert [r["last"] for r in results] == [False, True]
    scale, rho, status = results[1]["result"]
    assert results[0]["result"] == results[1]["result"] and status == "ok"
    assert scale == pytest.approx(ref["scale"], rel=1e-6) and rho == pytest.approx(ref["rho"])
    if not VENDORED:
        assert "PP from " in results[1]["shapes"]


def rank_advantage_hook_steps(fw: str) -> dict:
    """Granularity step through the real advantage routine, on every rank of DP x CP: the
    hook's log-probs predate every update of the rollout, so it arms nothing and issues no
    collective; each step is measured inside the policy loss over the groups of this rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from ess_patch import ledger

    if fw == "miles":
        import miles.backends.training_utils.loss as loss
        from miles.backends.training_utils.cp_utils import slice_log_prob_with_cp

        miles_parallel_state()
    else:
        import slime.backends.megatron_utils.loss as loss
        from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp
    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=False)
    dp_size = mpu.get_data_parallel_world_size(with_context_parallel=False)
    _, batch = local_batch(slice_log_prob_with_cp, dp_rank, dp_size)
    with _upstream(loss, "compute_advantages_and_returns"):  # the host's own collectives
        _, plain_calls = _advantages(
            loss.compute_advantages_and_returns, host_args(fw, True), batch
        )
    _install(["megatron", fw])
    args = host_args(fw, True)
    args.ess_lr_granularity = "step"
    _, calls = _advantages(loss.compute_advantages_and_returns, args, batch)
    run = ledger.running()
    out = {
        "calls": calls,
        "plain_calls": plain_calls,
        "armed": ess_patch.armed(),
        "reason": None if run is None else run.reason,
        "groups": None
        if run is None
        else [
            None if g is None else dist.get_process_group_ranks(g)
            for g in (run.cp_group, run.dp_group)
        ],
        "cp": [
            dist.get_process_group_ranks(g)
            for g in (
                mpu.get_context_parallel_group(),
                mpu.get_data_parallel_group(with_context_parallel=False),
            )
        ],
    }
    ledger.stop()
    if not VENDORED:
        ess_patch.uninstall()
    return out


@pytest.mark.dist
@pytest.mark.parametrize("fw", _framework_params(LOSS))
def test_advantage_hook_in_step_mode_measures_inside_the_loss_on_every_rank(fw, tmp_path):
    """The per-step results themselves, through the real train loop and loss, are
    tests/frameworks/test_ledger_matrix.py's."""
    results = run_ranks(rank_advantage_hook_steps, dp=DP, cp=CP, args=(fw,), tmp_path=tmp_path)
    for r in results:
        # nothing armed, not one collective beyond the host's own (its advantage whitening)
        assert r["armed"] is None and r["calls"] == r["plain_calls"]
        assert "granularity 'step'" in r["reason"]
        assert r["groups"] == r["cp"]  # the step reduces over this rank's CP and DP groups


# --- the train step, logging, FSDP ------------------------------------------------------------


def _one_rollout_batch() -> dict:
    full = rollout()
    return {
        "log_probs": [s["log_probs"] for s in full],
        "rollout_log_probs": [s["rollout_log_probs"] for s in full],
        "loss_masks": [s["loss_mask"] for s in full],
        "response_lengths": [s["response_length"] for s in full],
        "total_lengths": [s["total_length"] for s in full],
        "rewards": [s["reward"] for s in full],
    }


def _miles_train_step(monkeypatch, flags, integrations=("megatron", "miles"), between=None):
    """One rollout through miles' real advantage hook and ``train`` (two optimizer steps):
    the armed result, the (lr, param, grad) each step started from, the optimizer, the logs.
    ``between()`` runs after the rollout is armed, before ``train``. The LR each inner torch
    optimizer saw inside its step is in ``seen["inside"]``."""
    from megatron_cpu import batch, build_megatron_optimizer, inner_optimizers, param_triples

    if VENDORED:  # what install() would also hook once imported: import it to check it
        from ess_patch.install import INTEGRATIONS

        for integration in ("megatron", "miles"):
            for name in INTEGRATIONS[integration].modules:
                try:
                    importlib.import_module(name)
                except ModuleNotFoundError as exc:  # another version's location of a target
                    if not (name + ".").startswith(f"{exc.name}."):
                        raise
    _install(list(integrations))
    argv = [*MINIMAL_ARGV, "--lr", "1e-2", *flags, "--ess-lr-weight-mode", "product"]
    args = parse_upstream_args("miles", argv)
    import miles.backends.megatron_utils.model as model_module
    import miles.backends.training_utils.log_utils as log_utils
    from megatron.training.global_vars import set_args
    from miles.backends.megatron_utils import actor as actor_module

    set_args(args)
    miles_parallel_state()
    setup = build_megatron_optimizer("fp32", optimizer="sgd")

    # the actor's own reference to the advantage routine arms the rollout's result
    rollout = _one_rollout_batch()
    seen: dict = {"inside": [], "scheduled": []}
    actor_module.compute_advantages_and_returns(args, rollout)
    result = ess_patch.armed()
    if between is not None:
        between(setup)
    for inner in inner_optimizers(setup.optimizer):
        inner.optimizer.register_step_pre_hook(
            lambda o, a, k: seen["inside"].append(o.param_groups[0]["lr"])
        )

    def fake_forward_backward(**kw):  # miles' GPT forward cannot run on CPU: one real backward
        model = kw["model"][0]
        x, y = batch(0, 0)
        loss = torch.nn.functional.mse_loss(model(x), y)
        setup.optimizer.scale_loss(loss).backward()
        model.finish_grad_sync()
        seen["before"] = [
            (g["lr"], p.detach().clone(), m.main_grad.clone())  # fp32: the grad it will use
            for g, p, m in param_triples(setup.optimizer)
        ]
        seen["scheduled"].append(setup.optimizer.param_groups[0]["lr"])
        return [{"keys": ["loss"], "values": torch.tensor([1.0, loss.item()])}]

    logged = []
    monkeypatch.setattr(model_module, "get_forward_backward_func", lambda: fake_forward_backward)
    monkeypatch.setattr(log_utils.tracking, "log", lambda a, d, step_key: logged.append(dict(d)))

    class Iterator:
        def reset(self):
            pass

    model_module.train(
        0,
        setup.models,
        setup.optimizer,
        setup.scheduler,
        [Iterator()],
        [1, 1],
        [4, 4],
        witness_info=None,
        attempt=0,
    )
    return result, seen, setup, logged


@_needs(FULL, "miles")
def test_miles_train_step_scales_once_restores_the_lr_and_logs(world, clean_ess, monkeypatch):
    from megatron_cpu import param_triples

    result, seen, setup, logged = _miles_train_step(monkeypatch, ["--use-ess-lr"])
    before = seen["before"]
    assert result is not None and result.status == "ok" and result.scale < 1.0
    # the update used lr * scale, exactly once, for every parameter
    for (lr, p0, grad), (_, p1, _) in zip(before, param_triples(setup.optimizer), strict=True):
        assert grad.abs().sum() > 0
        assert torch.equal(p1, p0.add(grad, alpha=-(lr * result.scale)))
        assert not torch.equal(p1, p0.add(grad, alpha=-lr))
    # the scheduler's LR, not a scaled one, is in the groups after the step
    for group in setup.optimizer.param_groups:
        assert group["lr"] == setup.scheduler.get_lr(group)
    assert [r["train/step"] for r in logged] == [0, 1]  # two optimizer steps in this rollout
    # each step logs what it applied, read back from the step: the LR inside the inner torch
    # optimizer's step over the scheduled LR (the same scale on both steps of the rollout)
    assert len(seen["inside"]) == 2
    for record, inside, scheduled in zip(logged, seen["inside"], seen["scheduled"], strict=True):
        assert record["train/lr_scale"] == inside / scheduled
        assert record["train/lr_scale"] == pytest.approx(result.scale, rel=1e-12)
        assert record["train/rho_ess"] == result.rho
        assert record["train/ess_num_trajectories"] == 8
        assert "train/loss" in record  # miles' own metrics are still there


@_needs(FULL, "miles")
def test_miles_shadow_mode_logs_the_would_be_scale_and_changes_no_parameter(
    world, clean_ess, monkeypatch
):
    from megatron_cpu import param_triples

    from ess_patch.state import STATE

    result, seen, setup, logged = _miles_train_step(monkeypatch, ["--ess-lr-shadow"])
    before = seen["before"]
    assert result is None  # nothing the optimizer wrappers read is armed
    shadow = STATE.shadow
    assert shadow is not None and shadow.status == "ok" and shadow.scale < 1.0
    # the same number the enabled mode arms: the float64 reference of this rollout
    rollout = _one_rollout_batch()
    ref = reference_ess(
        rollout["log_probs"], rollout["rollout_log_probs"], rollout["loss_masks"], mode="product"
    )
    assert shadow.ess == pytest.approx(ref["ess"], rel=1e-9)
    assert shadow.scale == pytest.approx(ref["scale"], rel=1e-9)
    # plain SGD at the scheduled LR, bitwise: what miles does without ess-patch
    for (lr, p0, grad), (_, p1, _) in zip(before, param_triples(setup.optimizer), strict=True):
        assert grad.abs().sum() > 0
        assert torch.equal(p1, p0.add(grad, alpha=-lr))
    for group in setup.optimizer.param_groups:
        assert group["lr"] == setup.scheduler.get_lr(group)
    assert [r["train/step"] for r in logged] == [0, 1]
    for record in logged:
        assert "train/lr_scale" not in record  # cannot be mistaken for an applied scale
        assert record["train/ess_lr_shadow_scale"] == shadow.scale
        assert record["train/rho_ess"] == shadow.rho
        assert record["train/ess"] == shadow.ess
        assert record["train/ess_num_trajectories"] == 8
        assert "train/loss" in record


@_needs(FULL, "miles")
@pytest.mark.parametrize("collapsing", [True, False], ids=["below", "above"])
def test_miles_shadow_mode_warns_once_when_rho_stays_below_the_threshold(
    world, clean_ess, collapsing
):
    """Three rollouts through miles' real advantage hook in shadow mode, the warning's
    threshold just above (or below) the rollout's rho, patience 2: one WARNING at rollout 1
    (or none), and nothing armed."""
    import logging

    import miles.backends.megatron_utils.actor as actor_module

    batch = _one_rollout_batch()
    ref = reference_ess(
        batch["log_probs"], batch["rollout_log_probs"], batch["loss_masks"], mode="product"
    )
    threshold = ref["rho"] * (1.01 if collapsing else 0.99)
    _install(["megatron", "miles"])
    argv = [*MINIMAL_ARGV, "--ess-lr-shadow", "--ess-lr-weight-mode", "product"]
    argv += ["--ess-lr-warn-threshold", repr(threshold), "--ess-lr-warn-patience", "2"]
    args = parse_upstream_args("miles", argv)
    from megatron.training.global_vars import set_args

    set_args(args)
    miles_parallel_state()
    # a handler on the logger itself: the host's logging set-up may replace the root's handlers
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("ess_patch.collapse_warning")
    logger.addHandler(handler)
    try:
        for _ in range(3):
            actor_module.compute_advantages_and_returns(args, _one_rollout_batch())
    finally:
        logger.removeHandler(handler)
    assert ess_patch.armed() is None  # shadow mode: no LR is ever scaled
    if not collapsing:
        assert messages == []
        return
    [message] = messages
    assert message.startswith("ess-patch (miles): ESS early warning at rollout 1 ")
    assert f"rho {ref['rho']:.3g}, {ref['rho']:.3g} over rollouts 0-1" in message
    assert "shadow mode" in message and "--use-ess-lr" in message


def _roll_back_megatron(_setup) -> None:
    """What a late import lacking a megatron-core symbol does (install's post-import hook)."""
    from ess_patch.install import _roll_back

    _roll_back("megatron", ImportError("megatron.core.optimizer lacks a symbol (test)"))


@_needs(FULL, "miles")
@pytest.mark.skipif(VENDORED, reason="vendored trees decorate the optimizer step themselves")
@pytest.mark.parametrize(
    ("integrations", "between", "stops_at"),
    [
        (("miles",), None, "advantages"),  # install(["miles"]): no optimizer integration
        (("megatron", "miles"), _roll_back_megatron, "step"),  # rolled back after the arm
    ],
    ids=["no-megatron-integration", "megatron-rolled-back"],
)
def test_miles_stops_before_a_step_that_would_not_apply_the_scale(
    world, clean_ess, monkeypatch, integrations, between, stops_at
):
    """Issue 35: the hooks arm, the optimizer steps at the scheduled LR, and the metrics
    said lr_scale 0.5. Now the run stops with one clear error, before any parameter moves."""
    from megatron_cpu import param_triples

    kept = {}

    def keep_then(setup):  # after the arm: the parameters, then the test's own change
        kept["setup"] = setup
        kept["params"] = [p.detach().clone() for _, p, _ in param_triples(setup.optimizer)]
        if between is not None:
            between(setup)

    with pytest.raises(ess_patch.EssLrNotAppliedError) as error:
        _miles_train_step(monkeypatch, ["--use-ess-lr"], integrations, between=keep_then)
    message = str(error.value)
    if stops_at == "advantages":  # at arm(), before train() was reached
        assert kept == {} and ess_patch.armed() is None
        assert "nothing wraps the optimizer step" in message and "megatron" in message
    else:  # at the first optimizer step, before its update: no parameter moved
        after = [p.detach() for _, p, _ in param_triples(kept["setup"].optimizer)]
        assert all(torch.equal(a, b) for a, b in zip(kept["params"], after, strict=True))
        assert "runs outside every ess-patch step wrapper" in message
    assert "ess_patch.attach(optimizer)" in message and "ESS_PATCH_ALLOW_UNSCALED=1" in message


@_needs(FULL, "slime")
def test_slime_train_log_gets_the_metrics(clean_ess, monkeypatch):
    import slime.observability.logging_utils as logging_utils

    _install(["megatron", "slime"])
    logged = []
    monkeypatch.setattr(logging_utils, "wandb", Namespace(log=logged.append))
    args = Namespace(use_wandb=True, use_tensorboard=False)
    logging_utils.log(args, {"train/loss": 1.0, "train/step": 3}, step_key="train/step")
    assert logged == [{"train/loss": 1.0, "train/step": 3}]  # nothing armed: unchanged
    ess_patch.arm(ess_patch.EssLrResult(scale=0.5, rho=0.25, ess=2.0, num_trajectories=8))
    param = torch.nn.Parameter(torch.ones(1))
    optimizer = ess_patch.attach(torch.optim.SGD([param], lr=0.5))
    param.grad = torch.ones(1)
    optimizer.step()  # the step the record reports: lr 0.25 inside, 0.5 scheduled
    ess_patch.detach(optimizer)
    logging_utils.log(args, {"train/loss": 1.0, "train/step": 3}, step_key="train/step")
    logging_utils.log(args, {"rollout/x": 1.0, "rollout/step": 3}, step_key="rollout/step")
    assert logged[1]["train/lr_scale"] == 0.5 and logged[1]["train/rho_ess"] == 0.25
    assert logged[1]["train/loss"] == 1.0
    assert logged[2] == {"rollout/x": 1.0, "rollout/step": 3}  # only the train step
    # shadow mode: the would-be scale under its own name, never train/lr_scale
    from ess_patch.state import STATE

    ess_patch.disarm()
    STATE.shadow = ess_patch.EssLrResult(scale=0.5, rho=0.25, ess=2.0, num_trajectories=8)
    logging_utils.log(args, {"train/loss": 1.0, "train/step": 4}, step_key="train/step")
    assert "train/lr_scale" not in logged[3]
    assert logged[3]["train/ess_lr_shadow_scale"] == 0.5 and logged[3]["train/rho_ess"] == 0.25
    assert logged[3]["train/ess"] == 2.0 and logged[3]["train/ess_num_trajectories"] == 8


def _fsdp_run(scale, *, attach: bool, by_hand: bool = False):
    """miles' FSDP step order: optimizer.step(), then its FSDPLRScheduler.step()."""
    from miles.backends.fsdp_utils.lr_scheduler import FSDPLRScheduler

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = FSDPLRScheduler(
        opt,
        init_lr=1e-3,
        max_lr=1e-2,
        min_lr=1e-3,
        lr_warmup_steps=2,
        lr_decay_steps=6,
        lr_decay_style="cosine",
    )
    if attach:
        ess_patch.attach(opt)
        ess_patch.arm(scale)
    lrs = []
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        opt.zero_grad()
        loss = model(torch.randn(5, 4, generator=gen)).pow(2).mean()
        loss.backward()
        saved = [g["lr"] for g in opt.param_groups]
        if by_hand:
            for g in opt.param_groups:
                g["lr"] = g["lr"] * scale
        opt.step()
        if by_hand:
            for g, lr in zip(opt.param_groups, saved, strict=True):
                g["lr"] = lr
        sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])  # what miles logs as lr-pg_i
    ess_patch.disarm()
    return [p.detach().clone() for p in model.parameters()], lrs


@_needs(FULL, "miles")
def test_fsdp_plain_optimizer_is_scaled_like_the_megatron_one(clean_ess):
    plain, plain_lrs = _fsdp_run(0.3, attach=False)
    scaled, lrs = _fsdp_run(0.3, attach=True)
    manual, _ = _fsdp_run(0.3, attach=False, by_hand=True)
    assert all(torch.equal(a, b) for a, b in zip(scaled, manual, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(scaled, plain, strict=True))
    assert lrs == plain_lrs  # the scheduler and the logged LRs never see a scaled LR


@_needs(FULL, "miles")
def test_fsdp_actor_attaches_its_optimizer_when_enabled(clean_ess):
    from miles.backends.fsdp_utils.actor import FSDPTrainRayActor

    from ess_patch.integrations.miles import fsdp_train_core_wrapper

    _install(["megatron", "miles"])
    assert _hooked(vars(FSDPTrainRayActor)["_train_core"])
    for enabled in (False, True):
        actor = FSDPTrainRayActor.__new__(FSDPTrainRayActor)
        actor.args = Namespace(use_ess_lr=enabled)
        param = torch.nn.Parameter(torch.ones(1))
        actor.optimizer = torch.optim.SGD([param], lr=0.1)
        ran = fsdp_train_core_wrapper(lambda *a, **k: "trained", actor, (), {})
        assert ran == "trained"
        ess_patch.arm(0.5)
        param.grad = torch.ones(1)
        if enabled:  # attached: the armed scale applies
            actor.optimizer.step()
        else:  # a plain torch optimizer under install(), not attached: it never steps unscaled
            with pytest.raises(ess_patch.EssLrNotAppliedError, match=r"SGD\.step"):
                actor.optimizer.step()
        ess_patch.disarm()
        lr = 0.1 * 0.5 if enabled else 0.0
        assert torch.equal(param.detach(), torch.ones(1).add(torch.ones(1), alpha=-lr))
        assert actor.optimizer.param_groups[0]["lr"] == 0.1


# --- every process: the documented one-line launch change -------------------------------------

_PTH_INSTALLED = any(
    (Path(d) / "ess_patch-autoinstall.pth").exists() for d in __import__("site").getsitepackages()
)


@_needs(LOSS, "miles")
@pytest.mark.skipif(
    not _PTH_INSTALLED, reason="the .pth ships with the wheel, not editable installs"
)
def test_a_train_actor_started_with_the_env_var_has_the_hooks(tmp_path, fresh_python):
    """What ``--train-env-vars '{"ESS_PATCH_AUTO_INSTALL": "1"}'`` gives each Ray actor.

    Vendored mode: the patched tree has the hook with or without the variable, and the
    auto-install that the variable triggers does not wrap it a second time.
    """
    code = """
        import miles.backends.training_utils.loss as loss
        from ess_patch.patching import is_ours
        from ess_patch.vendored import is_vendored
        f = loss.compute_advantages_and_returns
        emit({"hooked": is_ours(f), "vendored": is_vendored(f)})
    """
    env = {**os.environ, "ESS_PATCH_AUTO_INSTALL": "1", "PYTHONPATH": os.environ["MILES_SRC"]}
    on = fresh_python(code, env, cwd=tmp_path, timeout=120).result
    assert on == (
        {"hooked": False, "vendored": True} if VENDORED else {"hooked": True, "vendored": False}
    )
    env.pop("ESS_PATCH_AUTO_INSTALL")
    off = fresh_python(code, env, cwd=tmp_path, timeout=120).result
    assert off == {"hooked": False, "vendored": VENDORED}
