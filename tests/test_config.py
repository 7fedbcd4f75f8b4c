"""EssLrConfig validation: every bad field gets an error that names it and says what is valid."""

from __future__ import annotations

import pytest

from ess_patch import EssLrConfig


def test_defaults_match_the_seed():
    c = EssLrConfig()
    assert (c.floor, c.weight_mode, c.rule, c.base_ratio, c.nonfinite) == (
        0.1,
        "geometric",
        "sqrt",
        1.0,
        "raise",
    )


@pytest.mark.parametrize("floor", [0, 0.0, -0.1, 1.5, float("nan"), float("inf")])
def test_floor_outside_unit_interval(floor):
    with pytest.raises(ValueError, match=r"floor.*\(0, 1\]|floor is NaN"):
        EssLrConfig(floor=floor)


def test_floor_one_is_allowed():
    assert EssLrConfig(floor=1.0).floor == 1.0


@pytest.mark.parametrize("base", [0, -1.0, float("inf"), "abc", True])
def test_base_ratio_must_be_positive(base):
    with pytest.raises(ValueError, match="base_ratio"):
        EssLrConfig(base_ratio=base)


@pytest.mark.parametrize(
    ("field", "valid"),
    [
        ("weight_mode", "geometric, product"),
        ("rule", "sqrt, linear"),
        ("nonfinite", "raise, floor"),
    ],
)
def test_unknown_names_list_the_valid_ones(field, valid):
    with pytest.raises(ValueError, match=f"{field}='bogus'.*valid values: {valid}"):
        EssLrConfig(**{field: "bogus"})


def test_from_env_reads_and_overrides():
    env = {"ESS_LR_FLOOR": "0.25", "ESS_LR_WEIGHT_MODE": "product", "ESS_LR_RULE": ""}
    c = EssLrConfig.from_env(env, rule="linear")
    assert (c.floor, c.weight_mode, c.rule) == (0.25, "product", "linear")
    with pytest.raises(ValueError, match="floor"):
        EssLrConfig.from_env({"ESS_LR_FLOOR": "2"})
