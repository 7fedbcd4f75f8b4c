"""``ess_patch.integrations.verl.config``: how ESS_LR_* and VCPO's ``actor.ess_scaling``
combine (no verl needed; the config node is a plain mapping or an OmegaConf DictConfig)."""

from __future__ import annotations

import pytest

from ess_patch import EssLrConfig
from ess_patch.integrations.verl import config_wrapper, settings
from ess_patch.state import STATE


@pytest.fixture(autouse=True)
def _no_installed_config(monkeypatch):
    monkeypatch.setattr(STATE, "config", None)


def test_off_without_enable_or_shadow():
    assert settings({}, environ={}) is None
    assert settings({"ess_scaling": {"enable": False}}, environ={}) is None


def test_env_enable_defaults_to_per_step_geometric():
    chosen = settings(None, environ={"ESS_LR_ENABLE": "1"})
    assert chosen.enabled
    assert chosen.config == EssLrConfig(granularity="step")


def test_env_granularity_and_weight_mode_are_kept():
    env = {
        "ESS_LR_ENABLE": "true",
        "ESS_LR_GRANULARITY": "rollout",
        "ESS_LR_WEIGHT_MODE": "geometric",
    }
    chosen = settings({"ess_scaling": {"scaling_rule": "linear"}}, environ=env)
    assert chosen.config == EssLrConfig(granularity="rollout", rule="linear")


def test_vcpo_keys_win_for_their_fields_and_choose_product_weights():
    env = {"ESS_LR_RULE": "sqrt", "ESS_LR_FLOOR": "0.3", "ESS_LR_BASE_RATIO": "2"}
    node = {"ess_scaling": {"enable": "true", "scaling_rule": "linear", "base_ess_ratio": 0.5}}
    chosen = settings(node, environ=env)
    assert chosen.config == EssLrConfig(
        floor=0.3, rule="linear", base_ratio=0.5, weight_mode="product", granularity="step"
    )


def test_use_clipped_needs_a_threshold():
    node = {"ess_scaling": {"enable": True, "use_clipped": True}}
    with pytest.raises(ValueError, match="ESS_LR_WEIGHT_CLIP"):
        settings(node, environ={})
    chosen = settings(node, environ={"ESS_LR_WEIGHT_CLIP": "3"})
    assert chosen.config.weight_clip == 3.0
    node["ess_scaling"]["use_clipped"] = False
    assert settings(node, environ={"ESS_LR_WEIGHT_CLIP": "3"}).config.weight_clip is None


@pytest.mark.parametrize(
    ("node", "env", "message"),
    [
        ({"ess_scaling": {"enabled": True}}, {}, "unknown key\\(s\\) enabled"),
        ({"ess_scaling": 3}, {}, "must be a mapping"),
        ({"ess_scaling": {"enable": "maybe"}}, {}, "actor.ess_scaling.enable='maybe'"),
        ({}, {"ESS_LR_ENABLE": "2"}, "ESS_LR_ENABLE='2'"),
        ({}, {"ESS_LR_ENABLE": "1", "ESS_LR_SHADOW": "1"}, "Keep one of them"),
        ({"ess_scaling": {"enable": True, "scaling_rule": "cube"}}, {}, "rule='cube'"),
        ({"ess_scaling": {"enable": True, "base_ess_ratio": 0}}, {}, "base_ratio=0"),
    ],
)
def test_bad_settings_name_the_key(node, env, message):
    with pytest.raises(ValueError, match=message):
        settings(node, environ=env)


def test_shadow_mode_computes_but_never_enables():
    chosen = settings({}, environ={"ESS_LR_SHADOW": "1"})
    assert not chosen.enabled and chosen.config.shadow


def test_config_wrapper_strips_the_node_from_a_plain_dict_and_leaves_others_alone():
    seen = []

    class Built:
        pass

    def build(config, dataclass_type=None):
        seen.append(dict(config))
        return Built()

    node = {"a": 1, "ess_scaling": {"enable": True}}
    out = config_wrapper(build, None, (node,), {})
    assert seen == [{"a": 1}] and node == {"a": 1, "ess_scaling": {"enable": True}}
    assert out.ess_scaling == {"enable": True}
    config_wrapper(build, None, ({"a": 2},), {})
    assert seen[-1] == {"a": 2}


def test_older_batches_without_response_mask_use_the_attention_mask_of_the_responses():
    """verl before response_mask was in the batch derived it from attention_mask; one process,
    against the float64 reference over the same tokens."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from reference import reference_ess

    from ess_patch.integrations.rl_hooks import Groups
    from ess_patch.integrations.verl import compute_batch

    gen = torch.Generator().manual_seed(1)
    rollout = -torch.rand(4, 5, generator=gen)
    old = rollout + torch.linspace(-0.5, 0.5, 4).unsqueeze(1)
    attention = torch.ones(4, 8, dtype=torch.long)
    attention[1, -2:] = 0  # a shorter response
    data = {
        "old_log_probs": old,
        "rollout_log_probs": rollout,
        "attention_mask": attention,
        "responses": torch.ones(4, 5, dtype=torch.long),
    }
    one = Groups(None, 0, 1, None, None, True)
    config = EssLrConfig(floor=0.01)
    got = compute_batch(data, config, one)
    masks = list(attention[:, -5:])
    want = reference_ess(
        [o.double() for o in old], [r.double() for r in rollout], masks, floor=0.01
    )
    assert got.scale == pytest.approx(want["scale"], rel=1e-9) and got.scale < 1
    del data["attention_mask"]
    with pytest.raises(ValueError, match="neither response_mask nor attention_mask"):
        compute_batch(data, config, one)
