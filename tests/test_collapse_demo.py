"""The collapse scenario's pieces: the warm start and its cache, fixed staleness, VCPO's
sequence-level truncated IS loss, every layout loading the same warm-started weights, the
non-TTY progress lines, and a ``--quick`` run of ``ess-patch demo --scenario collapse``.

Real ranks, a real megatron GPTModel and optimizer (gloo ranks from a forkserver).
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

import torch

from ess_patch import cli, cli_demo
from ess_patch.demo.scenarios import collapse
from ess_patch.demo.warm_start import WarmStart, ensure

pytestmark = pytest.mark.dist

TINY = {"task": "sort", "response_len": 4, "num_layers": 2, "hidden": 16, "seed": 3}


def test_warm_start_is_cached_by_its_settings(tmp_path):
    ws = WarmStart(**TINY, steps=30, lr=3e-3)
    path, meta = ensure(ws, tmp_path)
    assert meta["trained"] and path.parent == tmp_path
    # 30 steps of cross-entropy on 4-digit sorting beat the untrained policy
    assert meta["reward"] > meta["start_reward"]
    stamp = path.stat().st_mtime_ns
    again, meta2 = ensure(ws, tmp_path)
    assert again == path and not meta2["trained"] and path.stat().st_mtime_ns == stamp
    assert meta2["reward"] == meta["reward"]
    # the file is a plain state dict of tensors: loadable with weights_only=True
    weights = torch.load(path, weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in weights.values())
    assert "output_layer.weight" in weights and "decoder.layers.1.mlp.linear_fc1.weight" in weights
    # another setting, another file; the same settings give the same key in a new object
    other, _ = ensure(WarmStart(**{**TINY, "seed": 4}, steps=30, lr=3e-3), tmp_path)
    assert other != path
    assert WarmStart(**TINY, steps=30, lr=3e-3).key() == ws.key()
    with pytest.raises(ValueError, match="steps >= 0"):
        WarmStart(**TINY, steps=-1)


def test_fixed_staleness_hand_values():
    from ess_patch.demo.train import DemoConfig, rollout_lags

    cfg = DemoConfig(staleness="fixed", lag=3, rollout_workers=2)
    assert [rollout_lags(cfg, step, 3) for step in (0, 1, 2, 3, 10)] == [
        [0, 0],
        [1, 1],
        [2, 2],
        [3, 3],
        [3, 3],
    ]
    assert rollout_lags(cfg, 10, 0) == [0, 0]  # the sync arm
    mixed = DemoConfig(staleness="mixed", lag=3, rollout_workers=2)
    assert rollout_lags(mixed, 10, 3) == [0, 3]  # worker_lags: periods 1, 4; (10 + 1) % 4 = 3


def test_varying_staleness_hand_values():
    from ess_patch.demo.staleness import DRIFT_PERIOD, step_lag
    from ess_patch.demo.train import DemoConfig, rollout_lags

    assert DRIFT_PERIOD == 100
    # a triangle: 0 at step 0 (and 100, 200), 16 at step 50, 8 at 25 and 75; never staler
    # than the step itself
    drift = [step_lag("drift", s, 16, 0) for s in (0, 3, 25, 50, 75, 100, 150)]
    assert drift == [0, 1, 8, 16, 8, 0, 16]
    cfg = DemoConfig(staleness="drift", lag=16, rollout_workers=2)
    assert rollout_lags(cfg, 50, 16) == [16, 16] and rollout_lags(cfg, 50, 0) == [0, 0]
    # the long tail: P(k) ~ (k + 1)^-2 on 0..16: P(0) = 1 / sum = 0.62, P(k >= 8) = 0.068
    lags = [step_lag("longtail", s, 16, 7) for s in range(20, 4020)]
    assert all(0 <= k <= 16 for k in lags)
    total = sum(1 / (k + 1) ** 2 for k in range(17))
    assert lags.count(0) / len(lags) == pytest.approx(1 / total, abs=0.03)
    tail = sum(1 / (k + 1) ** 2 for k in range(8, 17)) / total
    assert sum(k >= 8 for k in lags) / len(lags) == pytest.approx(tail, abs=0.015)
    # the same seed and step: the same lag in every arm; another seed: another sequence
    assert lags == [step_lag("longtail", s, 16, 7) for s in range(20, 4020)]
    assert lags != [step_lag("longtail", s, 16, 8) for s in range(20, 4020)]
    with pytest.raises(ValueError, match="give one of"):
        step_lag("sometimes", 3, 4, 0)


def test_seq_tis_loss_against_a_float64_reference():
    from ess_patch.demo.train import DemoConfig, _loss

    gen = torch.Generator().manual_seed(0)
    rows, t, vocab, p = 3, 4, 16, 5
    logits = torch.randn(rows, p + t - 1, vocab, generator=gen, requires_grad=True)
    tokens = torch.randint(0, vocab, (rows, t), generator=gen)
    lsm = torch.log_softmax(logits.detach()[:, -t:].double(), -1)
    logp = lsm.gather(2, tokens[..., None]).squeeze(-1)
    # row 0: ratio exp(1.0) per sequence; row 1: exp(5) > 8, truncated; row 2: exp(-2)
    shift = torch.tensor([1.0, 5.0, -2.0], dtype=torch.float64)
    rollout = (logp - (shift / t)[:, None]).float()
    adv = torch.tensor([0.5, -1.0, 2.0])
    batch = {"tokens": tokens, "rollout_logp": rollout, "advantages": adv}
    cfg = DemoConfig(loss="seq-tis", is_threshold=8.0)
    loss, extra = _loss(cfg, batch, [], logits)
    seq = (logp - rollout.double()).sum(1)
    w = torch.minimum(seq.exp(), torch.tensor(8.0, dtype=torch.float64))
    assert w.tolist() == pytest.approx([math.e, 8.0, math.exp(-2)], rel=1e-5)
    expect = -(adv.double()[:, None] * w[:, None] * logp).mean()
    assert float(loss.detach()) == pytest.approx(float(expect), rel=1e-5)
    assert int(extra["clamped"]) == 1  # one sequence truncated
    ent = -(lsm.exp() * lsm).sum(-1).sum()
    assert float(extra["entropy"]) == pytest.approx(float(ent), rel=1e-5)
    # the weight carries no gradient: d loss / d logp = -adv * w / (rows * t)
    loss.backward()
    assert logits.grad is not None


def test_bad_collapse_settings_name_the_field():
    from ess_patch.demo.train import DemoConfig, DemoConfigError

    for field, value in (
        ("staleness", "sometimes"),
        ("is_threshold", 0.0),
        ("constant_scale", 1.5),
        ("calibration_rollouts", 0),
    ):
        with pytest.raises(DemoConfigError) as info:
            DemoConfig(**{field: value})
        assert info.value.field == field


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    cache = tmp_path_factory.mktemp("warm")
    cfg = collapse.collapse_config(task="sort", steps=3, warmup=1, lag=1)
    path, _ = ensure(collapse.warm_start_of(cfg), cache)
    return cfg, path


@pytest.mark.layouts
@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}])
def test_every_layout_loads_the_same_warm_start(warm, layout, tmp_path):
    """The warm-started run at tp=2 / pp=2 is the tp=1 run on the same tokens (replayed from
    the tp=1 run's tape, teacher-forced): the same log-probs up to float32 rounding at the
    first step, so the same weights loaded. Sampling is not compared: at the warm start's
    sharp policy, TP's bf16 rounding can flip a sampled token on some CPUs' kernels."""
    import dataclasses

    from ess_patch.demo.launch import launch

    cfg, path = warm
    tape = str(tmp_path / "tape")
    base = dataclasses.replace(cfg, arms=("off",), init_weights=str(path), rollout_tape=tape)
    one = launch(base, tmp_path / "one")
    other = launch(dataclasses.replace(base, tape_mode="replay", **layout), tmp_path / "other")
    assert one[0]["reward"] == other[0]["reward"]  # the same tokens: exact by construction
    # the fp32 trainer's entropy and rho to float32 rounding; the bf16 engine's side of the
    # mismatch rounds differently when its matmuls are split (about 3% of the 3e-3 nats / token)
    assert other[0]["entropy"] == pytest.approx(one[0]["entropy"], rel=1e-4)
    assert other[0]["rho"] == pytest.approx(one[0]["rho"], rel=2e-3)
    for key in ("mismatch", "kl"):
        assert other[0][key] == pytest.approx(one[0][key], abs=5e-4), key
    # and the warm start is what loaded: its reward is far above a fresh policy's 0.1
    assert one[0]["reward"] > 0.25


def test_progress_is_lines_when_not_a_terminal(capsys):
    bar = cli_demo._Lines(200, "step")
    for _ in range(200):
        bar.update(1)
    lines = capsys.readouterr().err.splitlines()
    # one line per 5 percent, plus the first: 21, never a carriage return
    assert len(lines) == 21 and "100% 200/200 steps" in lines[-1]
    assert all("\r" not in line for line in lines)


@pytest.mark.slow  # 8 launches: about 40 s on an idle core, minutes under load
def test_quick_collapse_run_through_the_cli(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["demo", "--scenario", "collapse", "--quick", "--arms", "sync,off,product,constant"]
    argv += ["--steps", "10", "--out", str(out), "--cache-dir", str(tmp_path / "cache")]
    assert cli.main(argv) == 0
    printed = capsys.readouterr()
    assert "| sync |" in printed.out and "| product - constant |" in printed.out
    assert "\r" not in printed.err  # pytest's capture is not a terminal: progress lines
    summary = json.loads((out / "collapse_summary.json").read_text())
    assert summary["seeds"] == [0, 1] and set(summary["arms"]) == {
        "sync",
        "off",
        "product",
        "constant",
    }
    assert (out / "collapse.png").read_bytes()[:4] == b"\x89PNG"
    runs = sorted((out / "runs").glob("*.jsonl"))
    assert len(runs) == 8
    recs = {p.name.split("-seed")[0] + p.name.split("-")[1]: p for p in runs}
    sync = [json.loads(x) for x in recs["syncseed0"].read_text().splitlines()]
    off = [json.loads(x) for x in recs["offseed0"].read_text().splitlines()]
    const = [json.loads(x) for x in recs["constantseed0"].read_text().splitlines()]
    prod = [json.loads(x) for x in recs["productseed0"].read_text().splitlines()]
    assert all(r["mean_lag"] == 0 for r in sync)
    # quick: lag 2, fixed: every rollout min(step, 2) updates old
    assert [r["mean_lag"] for r in off] == [min(r["step"], 2) for r in off]
    # the constant arm copies the product run's mean scale, every step
    mean = sum(r["lr_scale"] for r in prod) / len(prod)
    assert all(r["lr_scale"] == pytest.approx(mean) for r in const)
    for r in off:
        assert r["entropy"] > 0 and r["kl"] >= 0 and math.isfinite(r["grad_norm"])
    # a second call reuses every run (the cache): no launch, the same table
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.split("finished")[0] == printed.out.split("finished")[0]
