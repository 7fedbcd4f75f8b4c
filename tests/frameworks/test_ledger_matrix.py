"""The configuration matrix through slime's REAL actor train path (``train_actor``).

For every configuration: the LR each optimizer step applied equals the scheduled LR times the
scale of a float64 reference computed here, independently, from the same model weights and
rollout log-probs (current policy at that step vs the rollout engine), the logged metrics equal
it; or the launch is refused when the arguments are parsed, naming the flag to change. See
``ledger_run.py`` for what is real and what is the test's own.

Where the log-probs at the advantage hook are not the current policy's (slime's one-step reuse:
none; ``--keep-old-actor``: the old actor's), ESS-LR measures inside the policy loss, one result
per optimizer step; elsewhere at the advantage hook, one result per rollout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared helpers
from harness import run_ranks
from reference import reference_ess
from upstream import skip_reason

import ess_patch

FULL = skip_reason("slime", "full")
MILES_FULL = skip_reason("miles", "full")
pytestmark = pytest.mark.skipif(FULL is not None, reason=FULL or "")
needs_miles = pytest.mark.skipif(MILES_FULL is not None, reason=MILES_FULL or "")

# the product weight mode brakes hard: the scales stay far from 1 and from each other
MODE = "product"
REL = 2e-5  # fp32 train log-probs against the float64 reference


@pytest.fixture
def slime_world(tmp_path, clean_ess):
    from ledger_run import megatron_groups

    from ess_patch.demo.cpu import megatron_on_cpu

    with megatron_on_cpu(), megatron_groups(tmp_path):
        ess_patch.install(["megatron", "slime"])
        yield


def _step_samples(rollout: dict, step: int) -> list[int]:
    """The (global) sample indices optimizer step ``step`` of a rollout trained on, on this
    rank: its micro-batches of the schedule the test built."""
    start = sum(rollout["num_microbatches"][:step])
    batches = rollout["micro_batch_indices"][start : start + rollout["num_microbatches"][step]]
    return [rollout["local"][i] for batch in batches for i in batch]


def _reference(weights: dict, samples: list[dict], indices: list[int]) -> dict:
    """float64 ESS of the policy with ``weights`` against the rollout engine's log-probs."""
    from ledger_run import reference_log_probs

    picked = [samples[i] for i in indices]
    current = [reference_log_probs(weights, s["tokens"], s["response_length"]) for s in picked]
    return reference_ess(
        current,
        [s["rollout_log_probs"].double() for s in picked],
        [s["loss_mask"] for s in picked],
        mode=MODE,
    )


def _check_step(run: dict, step: int, expected: dict) -> None:
    """The LR step ``step`` applied and what it logged equal ``expected``'s scale and rho."""
    from ledger_run import scaled_ratio

    record = run["records"][step]
    assert scaled_ratio(record) == pytest.approx(expected["scale"], rel=REL)
    logged = run["logged"][step]
    assert logged["train/step"] == step
    assert logged["train/lr_scale"] == pytest.approx(expected["scale"], rel=REL)
    assert logged["train/rho_ess"] == pytest.approx(expected["rho"], rel=REL)
    assert logged["train/ess_num_trajectories"] == expected["num_trajectories"]


def _per_step_references(run: dict) -> list[dict]:
    """Measured inside the loss: each step, the weights it started from, its own samples."""
    refs = []
    for rollout in run["rollouts"]:
        for j, step in enumerate(rollout["steps"]):
            weights = run["records"][step]["weights"]
            refs.append(_reference(weights, rollout["samples"], _step_samples(rollout, j)))
    return refs


# --- slime's one-step recipe: log-probs reused inside the loss ------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param([], id="plain"),
        pytest.param(["--recompute-loss-function"], id="recompute-loss"),
    ],
)
def test_slime_one_step_reuse_is_measured_inside_the_loss(slime_world, extra):
    """scripts/run-qwen3-4B.sh's shape: one optimizer step per rollout, kl_coef 0. slime skips
    the log-prob forward (no log_probs at the advantage hook); ESS-LR measures the current
    policy inside the loss, and each rollout's update uses its scale. With
    --recompute-loss-function the loss runs again in the backward: counted once."""
    from ledger_run import slime_train

    flags = ["--use-ess-lr", "--global-batch-size", "8", *extra]
    run = slime_train(flags, rollouts=2, steps=1)
    assert all(r["hook_log_probs"] is None for r in run["rollouts"])  # slime reused them
    assert len(run["records"]) == len(run["logged"]) == 2
    refs = _per_step_references(run)
    for step, ref in enumerate(refs):
        assert ref["scale"] < 0.9  # the rollout policy is far away: the brake acts
        _check_step(run, step, ref)
    assert refs[0]["scale"] != pytest.approx(refs[1]["scale"], rel=1e-3)


# --- granularity step: always measured inside the loss ------------------------------------------


def test_slime_step_granularity_measures_each_step_inside_the_loss(slime_world):
    """--ess-lr-granularity step with the log-probs recomputed before the advantages: the hook
    arms nothing (its log-probs are the weights before the rollout's first update); each
    optimizer step's LR uses the ESS of the weights that step started from, on its own
    mini-batch, as the real train loop split it."""
    from ledger_run import slime_train

    flags = ["--use-ess-lr", "--global-batch-size", "4", "--ess-lr-granularity", "step"]
    run = slime_train(flags, rollouts=2, steps=2)
    assert all(r["hook_log_probs"] is not None for r in run["rollouts"])  # recomputed
    assert len(run["records"]) == len(run["logged"]) == 4
    refs = _per_step_references(run)
    for step, ref in enumerate(refs):
        assert ref["scale"] < 0.9
        _check_step(run, step, ref)
    # the second step of a rollout: other samples, other weights than the hook's
    assert refs[0]["scale"] != pytest.approx(refs[1]["scale"], rel=1e-3)


# --- --keep-old-actor: the hook's log-probs are the old actor's -----------------------------------


def test_slime_keep_old_actor_measures_the_current_policy_at_each_step(slime_world):
    """--keep-old-actor, 2 optimizer steps per rollout, --ess-lr-granularity step: the hook's
    log_probs come from the old actor (the rollout policy: nearly no mismatch); each step's LR
    uses the ESS of the current policy on its own mini-batch."""
    from ledger_run import reference_log_probs, slime_train

    flags = ["--use-ess-lr", "--keep-old-actor", "--global-batch-size", "4"]
    run = slime_train([*flags, "--ess-lr-granularity", "step"], rollouts=2, steps=2)
    assert len(run["records"]) == len(run["logged"]) == 4
    refs = _per_step_references(run)
    for step, ref in enumerate(refs):
        _check_step(run, step, ref)
    # what the hook's log-probs would have given (old actor vs rollout): nearly 1, not refs
    rollout = run["rollouts"][0]
    samples = rollout["samples"]
    hook = rollout["hook_log_probs"]
    assert hook is not None
    expected_hook = [
        reference_log_probs(rollout["rollout_weights"], s["tokens"], s["response_length"])
        for s in samples
    ]
    for got, want in zip(hook, expected_hook, strict=True):  # they are the old actor's
        assert torch.allclose(got.double(), want, atol=1e-5)
    wrong = reference_ess(
        hook,
        [s["rollout_log_probs"] for s in samples],
        [s["loss_mask"] for s in samples],
        mode=MODE,
    )
    assert wrong["scale"] > refs[0]["scale"] * 1.2


def test_slime_keep_old_actor_with_dynamic_batches_follows_the_real_mini_batches(slime_world):
    """--use-dynamic-batch-size: slime's schedule packs micro-batches by tokens, so steps and
    micro-batches differ in size (here steps of 3 and 5 samples, the second in two
    micro-batches of 2 and 3). Each step's ESS covers exactly the samples it trained on."""
    from ledger_run import slime_train

    flags = ["--use-ess-lr", "--keep-old-actor", "--global-batch-size", "4"]
    dynamic = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"]
    uneven = ([1, 2], [[0, 1, 2], [3, 4], [5, 6, 7]])
    run = slime_train(
        [*flags, *dynamic, "--ess-lr-granularity", "step"], rollouts=1, steps=2, uneven=uneven
    )
    refs = _per_step_references(run)
    assert [ref["num_trajectories"] for ref in refs] == [3, 5]
    for step, ref in enumerate(refs):
        _check_step(run, step, ref)


def test_slime_keep_old_actor_with_several_steps_per_rollout_is_refused_at_parse(clean_ess):
    """One ESS per rollout does not exist before its first step when it is measured inside
    the loss: the parse names the flag to set. One step per rollout, or granularity step: fine."""
    from ledger_run import slime_parse

    ess_patch.install(["megatron", "slime"])
    flags = ["--use-ess-lr", "--keep-old-actor"]
    with pytest.raises(ValueError, match=r"--keep-old-actor.*--ess-lr-granularity step"):
        slime_parse([*flags, "--global-batch-size", "4"])  # 8 samples: 2 steps
    assert slime_parse([*flags, "--global-batch-size", "8"]).keep_old_actor
    step = slime_parse([*flags, "--global-batch-size", "4", "--ess-lr-granularity", "step"])
    assert step.ess_lr_granularity == "step"


@pytest.fixture
def miles_world(tmp_path, clean_ess):
    from ledger_run import megatron_groups

    from ess_patch.demo.cpu import megatron_on_cpu

    with megatron_on_cpu(), megatron_groups(tmp_path):
        ess_patch.install(["megatron", "miles"])
        yield


NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]  # miles asks it of the flag


@needs_miles
@pytest.mark.parametrize(
    ("flags", "steps"),
    [
        pytest.param(
            ["--keep-old-actor", "--global-batch-size", "4", "--ess-lr-granularity", "step"],
            2,
            id="keep-old-actor",
        ),
        pytest.param(
            ["--skip-actor-forward-only", "--global-batch-size", "8", *NO_DROPOUT],
            1,
            id="skip-forward",
        ),
        pytest.param(["--global-batch-size", "4", "--ess-lr-granularity", "step"], 2, id="step"),
    ],
)
def test_miles_measures_the_current_policy_inside_the_loss(miles_world, flags, steps):
    """miles' real train_actor: --keep-old-actor (log_probs from the old actor at the hook)
    and --skip-actor-forward-only (none at the hook): each optimizer step's LR uses the ESS of
    the current policy on its own mini-batch, and logs it."""
    from ledger_run import miles_train

    run = miles_train(["--use-ess-lr", *flags], rollouts=2)
    assert all(len(r["steps"]) == steps for r in run["rollouts"])
    assert len(run["records"]) == len(run["logged"]) == 2 * steps
    refs = _per_step_references(run)
    for step, ref in enumerate(refs):
        assert ref["scale"] < 0.9
        _check_step(run, step, ref)


@needs_miles
def test_miles_keep_old_actor_with_several_steps_per_rollout_is_refused_at_parse(clean_ess):
    from ledger_run import miles_parse

    ess_patch.install(["megatron", "miles"])
    with pytest.raises(ValueError, match=r"--keep-old-actor.*--ess-lr-granularity step"):
        miles_parse(["--use-ess-lr", "--keep-old-actor", "--global-batch-size", "4"])


# --- the rollout path: log-probs recomputed before the advantages ---------------------------------


def _rollout_references(run: dict) -> list[dict]:
    """Measured at the hook: every step of a rollout uses the ESS of the rollout's samples
    under the weights the rollout started from."""
    refs = []
    for rollout in run["rollouts"]:
        weights = run["records"][rollout["steps"][0]]["weights"]
        ref = _reference(weights, rollout["samples"], list(range(len(rollout["samples"]))))
        refs.extend([ref] * len(rollout["steps"]))
    return refs


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param([], id="recompute"),
        pytest.param(
            [
                "--use-rollout-logprobs",
                "--get-mismatch-metrics",
                "--custom-tis-function-path",
                "slime.backends.megatron_utils.loss.vanilla_tis_function",
            ],
            id="rollout-logprobs-mismatch",
        ),
        pytest.param(["--use-critic", "--advantage-estimator", "ppo"], id="ppo-critic"),
    ],
)
def test_slime_multi_step_with_recompute_uses_the_rollouts_scale(slime_world, extra):
    """2 optimizer steps per rollout: slime recomputes the log-probs before the advantages
    (as it does with a critic, PPO's GAE on its values); both steps use the rollout's ESS
    (granularity rollout)."""
    from ledger_run import slime_train

    run = slime_train(["--use-ess-lr", "--global-batch-size", "4", *extra], rollouts=2, steps=2)
    assert all(r["hook_log_probs"] is not None for r in run["rollouts"])
    refs = _rollout_references(run)
    assert len(run["records"]) == len(run["logged"]) == 4
    for step, ref in enumerate(refs):
        assert ref["scale"] < 0.9
        _check_step(run, step, ref)
    if "--get-mismatch-metrics" in extra:
        assert "train/ois" in run["logged"][0]  # slime's own mismatch metrics still there


# --- several processes ----------------------------------------------------------------------------


def _rank_one_step_reuse() -> dict:
    from ledger_run import slime_train

    from ess_patch.demo.cpu import megatron_on_cpu

    with megatron_on_cpu():
        ess_patch.install(["megatron", "slime"])
        run = slime_train(["--use-ess-lr", "--global-batch-size", "8"], rollouts=2, steps=1)
    run["records"] = [
        {"lr": r["lr"], "scheduled": r["scheduled"], "weights": r["weights"]}
        for r in run["records"]
    ]
    return run


@pytest.mark.dist
@pytest.mark.parametrize(("dp", "cp"), [(2, 1), (1, 2)], ids=["dp2", "cp2"])
def test_slime_one_step_reuse_on_several_ranks(tmp_path, dp, cp):
    """DP2: each rank trains on its half, the ESS covers all 8 samples; CP2: each rank holds
    a zigzag half of every sample's tokens, the ESS is that of the whole samples. Every rank
    applies the same scale, that of the float64 reference over the whole rollout."""
    from ledger_run import scaled_ratio

    runs = run_ranks(
        _rank_one_step_reuse, dp=dp, cp=cp, tmp_path=tmp_path, timeout=240, gloo_groups=True
    )
    first = runs[0]
    for rollout_index, rollout in enumerate(first["rollouts"]):
        step = rollout["steps"][0]
        ref = _reference(first["records"][step]["weights"], rollout["samples"], list(range(8)))
        assert ref["num_trajectories"] == 8 and ref["scale"] < 0.9
        for run in runs:
            assert run["rollouts"][rollout_index]["hook_log_probs"] is None
            assert scaled_ratio(run["records"][step]) == pytest.approx(ref["scale"], rel=REL)
            if run["logged"]:  # slime logs on DP rank 0 / CP rank 0 only
                assert run["logged"][step]["train/lr_scale"] == pytest.approx(ref["scale"], rel=REL)
                assert run["logged"][step]["train/rho_ess"] == pytest.approx(ref["rho"], rel=REL)
    assert sum(1 for run in runs if run["logged"]) >= 1
