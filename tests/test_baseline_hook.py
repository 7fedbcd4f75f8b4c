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


def test_pipeline_parallelism_is_served_and_virtual_pipelines_still_refused():
    validate_baseline("miles", _args(pipeline_model_parallel_size=2))
    with pytest.raises(ValueError, match="virtual-pipeline"):
        validate_baseline(
            "slime", _args(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
        )


class _Wrapper(torch.nn.Module):
    """What megatron's DDP and Float16Module are to the model: a module holding it as
    ``.module`` and forwarding to it, without its attributes."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


@pytest.mark.parametrize("path", ["rules", "exact"])
def test_a_wrapped_tied_model_gives_the_norms_of_one_backward_per_sample(path):
    """The train actor lends megatron's wrapped chunk (DDP(Float16Module(GPTModel))); the
    wrapper does not say the embeddings are tied, and the rules must still count the output
    layer's share of the one weight (its cross term with the embedding's)."""
    pytest.importorskip("megatron.core")
    from test_per_trajectory_rules import MODERN, _gpt

    from ess_patch.demo.cpu import megatron_on_cpu
    from ess_patch.demo.policy import single_process
    from ess_patch.integrations.baseline_hook import _norms
    from ess_patch.state import STATE

    gen = torch.Generator().manual_seed(0)
    lengths = [(5, 4), (3, 6), (6, 3)]
    data = {"tokens": [], "response_lengths": [], "loss_masks": [], "rewards": [0.0] * 3}
    for prompt, response in lengths:
        data["tokens"].append(torch.randint(0, 16, (prompt + response,), generator=gen))
        data["response_lengths"].append(response)
        data["loss_masks"].append((torch.rand(response, generator=gen) > 0.3).float())
    host = Namespace(micro_batch_size=2, use_tis=False, ess_baseline_path=path)
    with single_process():
        model = _gpt(**{**MODERN, "tied": True})
        params = [p for p in model.parameters() if p.requires_grad]
        want = []
        for i, tokens in enumerate(data["tokens"]):
            total, resp = tokens.numel(), data["response_lengths"][i]
            with megatron_on_cpu():
                logits = model(tokens[None], torch.arange(total)[None], None)[0]
            logp = torch.log_softmax(logits[total - resp - 1 : total - 1].float(), -1)
            lp = logp.gather(1, tokens[total - resp :, None]).squeeze(1)
            term = (data["loss_masks"][i] * lp).sum()
            want.append(sum(g.double().square().sum() for g in torch.autograd.grad(term, params)))
        STATE.baseline_model = [_Wrapper(_Wrapper(model))]
        try:
            with megatron_on_cpu():
                got, _ = _norms("miles", host, data)
        finally:
            STATE.baseline_model = None
    assert torch.allclose(got, torch.stack(want), rtol=2e-5), (got, want)
