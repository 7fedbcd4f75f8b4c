"""The documented launch on every miles and slime snapshot (``upstream.snapshots()``), on the
Megatron tree it runs on (``MEGATRON_LM_SRC``: megatron-lm-2e64d788b, which has megatron/rl):
``import ess_patch; ess_patch.install()`` with every integration, in a fresh interpreter,
then the framework's real ``parse_args`` (``launch_probe.report`` through ``fresh_python``).

- the settings reach the hook with one precedence, every field checked: (a) the flags only,
  (b) ``ESS_LR_*`` only, (c) both (the flags win), and neither (the defaults);
- ``--disable-compute-advantages-and-returns`` with ``--use-ess-lr`` or ``--ess-lr-shadow`` is
  refused when the arguments are parsed, naming the flag; alone it parses;
- the driver / actor split (issue 35): a driver that parsed ``--use-ess-lr`` with nothing to
  patch its train actors stops; ``ESS_LR_*`` set only in the driver reach an actor through
  args, and an actor whose own ``ESS_LR_*`` disagree stops; an actor started with the
  auto-install whose args came from an unpatched driver (slime >= v0.3.0 dropped the flags)
  stops before its first rollout is trained;
- the critic: the real ``train_critic`` (its model calls replaced) runs the advantage hook
  with the process already the critic (at rollout 0 ``loss_type`` is still the policy's), no
  warning, and its train-step record through the real log function has no ESS metrics.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import pytest
from upstream import no_snapshot_param, snapshots, tier_reason

from ess_patch import EssLrConfig

HERE = Path(__file__).resolve().parent
# run in the fresh interpreter: the probe module from this folder, its report emitted
PROBE = """
import sys
sys.path.insert(0, {here!r})
from launch_probe import report
emit(report({fw!r}, {folder!r}, {cases!r}))
"""

FLAGS = EssLrConfig(
    floor=0.2,
    weight_mode="product",
    rule="linear",
    base_ratio=0.5,
    nonfinite="floor",
    granularity="step",
    weight_clip=3.0,
    calibrate_rollouts=3,
    warn_threshold=0.5,
    warn_patience=2,
)
FLAG_ARGV = [
    "--ess-lr-floor",
    "0.2",
    "--ess-lr-weight-mode",
    "product",
    "--ess-lr-rule",
    "linear",
    "--ess-lr-base-ratio",
    "0.5",
    "--ess-lr-nonfinite",
    "floor",
    "--ess-lr-granularity",
    "step",
    "--ess-lr-weight-clip",
    "3",
    "--ess-lr-calibrate-rollouts",
    "3",
    "--ess-lr-warn-threshold",
    "0.5",
    "--ess-lr-warn-patience",
    "2",
]
ENV = {
    "ESS_LR_FLOOR": "0.3",
    "ESS_LR_WEIGHT_MODE": "product",
    "ESS_LR_RULE": "linear",
    "ESS_LR_BASE_RATIO": "0.25",
    "ESS_LR_NONFINITE": "floor",
    "ESS_LR_GRANULARITY": "step",
    "ESS_LR_WEIGHT_CLIP": "5",
    "ESS_LR_CALIBRATE_ROLLOUTS": "2",
    "ESS_LR_WARN_THRESHOLD": "0.4",
    "ESS_LR_WARN_PATIENCE": "4",
}
FROM_ENV = EssLrConfig(
    floor=0.3,
    weight_mode="product",
    rule="linear",
    base_ratio=0.25,
    nonfinite="floor",
    granularity="step",
    weight_clip=5.0,
    calibrate_rollouts=2,
    warn_threshold=0.4,
    warn_patience=4,
)
DISABLE = "--disable-compute-advantages-and-returns"
CASES = {
    "env": {  # install() read ENV
        "env_only": ["--use-ess-lr"],
        "both": ["--use-ess-lr", *FLAG_ARGV],
        "one_flag": ["--use-ess-lr", "--ess-lr-floor", "0.7", "--ess-lr-weight-clip", "none"],
    },
    "plain": {  # no ESS_LR_* at all
        "flags_only": ["--use-ess-lr", *FLAG_ARGV],
        "neither": ["--use-ess-lr"],
        "off": [],
        "disabled_advantages": ["--use-ess-lr", DISABLE],
        "disabled_advantages_shadow": ["--ess-lr-shadow", DISABLE],
        "sft": [DISABLE],
    },
    "critic": ["--use-ess-lr"],
    "actors_env": {"ESS_LR_FLOOR": "0.3", "ESS_LR_RULE": "linear"},
}


def _params():
    found = snapshots()
    if not found:
        return [no_snapshot_param()]
    return [
        pytest.param(
            fw,
            folder,
            id=folder.name,
            marks=pytest.mark.skipif(
                tier_reason(fw, "full") is not None, reason=tier_reason(fw, "full") or ""
            ),
        )
        for fw, folder in found
    ]


@pytest.fixture(scope="module")
def reports(fresh_python):
    """One probe run per snapshot, on demand (cached for the module)."""
    cache: dict[Path, dict] = {}

    def get(fw: str, folder: Path) -> dict:
        if folder not in cache:
            env = {k: v for k, v in os.environ.items() if not k.startswith("ESS_")}
            env.update(ENV, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
            code = PROBE.format(here=str(HERE), fw=fw, folder=str(folder), cases=CASES)
            cache[folder] = fresh_python(code, env, timeout=300).result
        return cache[folder]

    return get


def _config(result: dict) -> dict:
    assert "error" not in result, result["error"]
    return result["config"]


@pytest.mark.parametrize(("fw", "folder"), _params())
def test_the_settings_reach_the_hook_with_one_precedence(fw, folder, reports):
    report = reports(fw, folder)
    # the documented install(): every integration, Megatron-RL's included, and none rolled back
    assert "megatron_rl" in report["integrations"] and fw in report["integrations"]
    assert report["failed"] == {}
    env, plain = report["env"], report["plain"]
    assert _config(plain["flags_only"]) == asdict(FLAGS)  # (a)
    assert _config(env["env_only"]) == asdict(FROM_ENV)  # (b)
    assert _config(env["both"]) == asdict(FLAGS)  # (c): a flag given wins
    one = _config(env["one_flag"])
    assert one == asdict(EssLrConfig(**{**asdict(FROM_ENV), "floor": 0.7, "weight_clip": None}))
    assert _config(plain["neither"]) == asdict(EssLrConfig())
    assert plain["off"]["use"] is False and plain["flags_only"]["use"] is True


@pytest.mark.parametrize(("fw", "folder"), _params())
def test_disabled_advantages_are_refused_at_parse_time(fw, folder, reports):
    plain = reports(fw, folder)["plain"]
    for case, flag in (
        ("disabled_advantages", "--use-ess-lr"),
        ("disabled_advantages_shadow", "--ess-lr-shadow"),
    ):
        error = plain[case].get("error", "")
        assert error.startswith(f"EssPatchValueError: {flag} cannot act with {DISABLE}"), plain[
            case
        ]
        assert f"({fw})" in error and f"Drop {flag} or {DISABLE}" in error
    assert _config(plain["sft"]) == asdict(EssLrConfig())  # without ESS-LR: SFT parses


@pytest.mark.parametrize(("fw", "folder"), _params())
def test_the_critic_is_the_critic_from_rollout_zero(fw, folder, reports):
    critic = reports(fw, folder)["critic"]
    assert critic["wrapped"] is True
    # the real train_critic: its advantage call comes before it sets loss_type
    assert critic["seen"] == {"role": "critic", "loss_type": "policy_loss"}
    assert critic["warnings"] == [] and critic["role_after"] == "critic"
    logged = critic["logged"]
    assert logged and not any(
        key.endswith(("lr_scale", "rho_ess", "ess", "ess_lr_measured")) for key in logged
    ), logged


@pytest.mark.parametrize(("fw", "folder"), _params())
def test_the_driver_and_its_actors_agree_or_the_run_stops(fw, folder, reports):
    import site

    out = reports(fw, folder)["actors"]
    error = out["unpatched_actors"].get("error", "")
    assert error.startswith(f"EssLrNotAppliedError: ess-patch ({fw}): ESS-LR was requested"), out
    assert "nothing patches the Ray train actors" in error
    assert "--train-env-vars" in error and "ess_patch.autoinstall.megatron_init" in error
    pth = any(
        (Path(d) / "ess_patch-autoinstall.pth").exists()
        for d in [*site.getsitepackages(), site.getusersitepackages()]
    )
    if pth:  # the wheel: the variable in --train-env-vars is enough
        assert "value" in out["env_vars"], out["env_vars"]
    else:  # an editable install: the variable alone patches nothing
        assert "is not in site-packages (an editable install" in out["env_vars"]["error"]
    # settings given to the driver only reach the actor through args
    assert out["driver_env"] == CASES["actors_env"]
    assert out["resolved"] == asdict(EssLrConfig(floor=0.3, rule="linear"))
    disagree = out["disagree"]["error"]
    assert disagree.startswith(f"EssPatchValueError: ess-patch ({fw}): this train actor's ESS_LR_*")
    assert "ESS_LR_FLOOR='0.2' here, '0.3' in the driver" in disagree


UNPATCHED = """
import sys
sys.path.insert(0, {here!r})
from launch_probe import unpatched_driver
emit(unpatched_driver({fw!r}, {folder!r}))
"""


@pytest.mark.slow
@pytest.mark.parametrize(("fw", "folder"), _params())
def test_an_unpatched_driver_is_caught_in_the_actor(fw, folder, fresh_python):
    """slime >= v0.3.0 parses with ignore_unknown_args: without ess-patch in the driver,
    --use-ess-lr is dropped without a word. An actor started with the auto-install stops at
    its first advantage hook; a parser that refuses the flag fails loudly by itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ESS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    code = UNPATCHED.format(here=str(HERE), fw=fw, folder=str(folder))
    out = fresh_python(code, env, timeout=300).result
    if out["parse"] == {"has_use_ess_lr": False}:  # dropped without a word
        stopped = out["actor"].get("error", "")
        assert stopped.startswith(f"EssLrNotAppliedError: ess-patch ({fw})"), out
        assert "the driver's parse_args was not patched" in stopped
        assert "--use-ess-lr and every --ess-lr-* were dropped" in stopped
    else:
        assert out["parse"].startswith("SystemExit"), out  # argparse's own "unrecognized"
