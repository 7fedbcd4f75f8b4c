"""``--use-ess-baseline``'s settings and its read-back, without a framework: the parse-time
refusals by name, the environment, and the check that the routine took ``r - b*``."""

from __future__ import annotations

from argparse import ArgumentParser, Namespace

import pytest
import torch

from ess_patch.integrations.baseline_flags import (
    PATHS,
    add_baseline_arguments,
    baseline_mode,
    validate_baseline,
)
from ess_patch.integrations.baseline_hook import _mismatch as mismatch
from ess_patch.norm_pass import PATHS as NORM_PASS_PATHS


def test_the_flag_offers_the_norm_pass_paths_and_the_proxy():
    assert (*NORM_PASS_PATHS, "proxy") == PATHS


def test_the_baseline_variables_are_known_to_the_esslr_environment_check():
    """``ESS_LR_BASELINE*`` sit beside the ``ESS_LR_*`` settings: install() and every reader of
    the environment must not refuse them as typos (a typo of theirs still is)."""
    from ess_patch import EssLrConfig
    from ess_patch.config import BASELINE_ENV_NAMES
    from ess_patch.integrations.baseline_flags import ENV_ON, ENV_PATH, ENV_SHADOW

    assert BASELINE_ENV_NAMES == (ENV_ON, ENV_SHADOW, ENV_PATH)
    env = {ENV_ON: "1", ENV_SHADOW: "0", ENV_PATH: "exact", "ESS_LR_FLOOR": "0.2"}
    assert EssLrConfig.from_env(env).floor == 0.2
    with pytest.raises(ValueError, match="ESS_LR_BASELIN is not an ESS-LR setting"):
        EssLrConfig.from_env({"ESS_LR_BASELIN": "1"})


def _args(**kw):
    base = dict(
        use_ess_baseline=True,
        ess_baseline_shadow=None,
        ess_baseline_path=None,
        advantage_estimator="grpo",
        rewards_normalization=True,
        n_samples_per_prompt=4,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        train_backend="megatron",
    )
    base.update(kw)
    return Namespace(**base)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"advantage_estimator": "reinforce_plus_plus"}, "advantage-estimator reinforce"),
        ({"rewards_normalization": False}, "disable-rewards-normalization"),
        ({"n_samples_per_prompt": 1}, "n-samples-per-prompt"),
        ({"context_parallel_size": 2}, "context-parallel-size 2"),
        ({"virtual_pipeline_model_parallel_size": 2}, "virtual-pipeline"),
        ({"train_backend": "fsdp"}, "train-backend fsdp"),
        ({"ess_baseline_path": "fast"}, "ESS_LR_BASELINE_PATH"),
    ],
)
def test_what_the_baseline_cannot_serve_is_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        validate_baseline("miles", _args(**kw))
    validate_baseline("miles", _args())  # the same run without that setting passes


def test_the_flags_win_over_the_environment_and_a_bad_value_is_named(monkeypatch):
    parser = ArgumentParser()
    add_baseline_arguments(parser)
    add_baseline_arguments(parser)  # a second call adds nothing (and does not fail)
    off = parser.parse_args([])
    assert baseline_mode(off) is None
    monkeypatch.setenv("ESS_LR_BASELINE", "1")
    assert baseline_mode(off) == "on"
    assert baseline_mode(parser.parse_args(["--no-use-ess-baseline"])) is None
    monkeypatch.setenv("ESS_LR_BASELINE", "maybe")
    with pytest.raises(ValueError, match="ESS_LR_BASELINE='maybe'"):
        baseline_mode(off)
    monkeypatch.delenv("ESS_LR_BASELINE")
    assert baseline_mode(parser.parse_args(["--ess-baseline-shadow"])) == "shadow"


def _advantages(values, lengths=(3, 2, 4)):
    return {
        "advantages": [torch.full((n,), float(v)) for v, n in zip(values, lengths, strict=True)]
    }


def test_the_read_back_accepts_r_minus_b_star_and_its_whitening_only():
    want = [0.5, -0.25, 1.0]
    plain = Namespace(normalize_advantages=False)
    whitened = Namespace(normalize_advantages=True)
    assert mismatch(plain, _advantages(want), want) == -1
    assert mismatch(whitened, _advantages([2 * v + 1 for v in want]), want) == -1
    assert mismatch(plain, _advantages([0.5, -0.25, 0.0]), want) == 2  # the group mean kept
    assert mismatch(whitened, _advantages([-v for v in want]), want) == 0  # a negative scale
    ragged = _advantages(want)
    ragged["advantages"][1][0] += 1.0  # not one value per sample
    assert mismatch(plain, ragged, want) == 1
