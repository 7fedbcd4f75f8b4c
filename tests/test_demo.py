"""``ess-patch demo``: real ranks, a real megatron GPTModel and optimizer; outputs exist and agree.

Multi-process (gloo ranks from a forkserver), so marked ``dist``. Needs the ``demo`` extra
(matplotlib, tqdm) besides megatron-core.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from ess_patch import cli
from ess_patch.demo import report

pytestmark = pytest.mark.dist

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
QUICK_STEPS = 12
#: (loss, max lag, lr, clip_grad, steps) that benchmarks/stress_select.py chose.
STRESS_CHOICE = ("sequence", 32, 1e-2, 1.0, 60)


def _rel_close(a: float, b: float, rel: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One ``ess-patch demo --scenario mixed --quick`` through the CLI (dp=2; off, product)."""
    out = tmp_path_factory.mktemp("demo") / "out"
    code = cli.main(["demo", "--scenario", "mixed", "--quick", "--no-progress", "--out", str(out)])
    records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return code, out, records


def test_quick_run_writes_outputs(quick_run):
    code, out, _ = quick_run
    assert code == 0
    for name in ("steps.jsonl", "summary.json", "ess_demo.png", "config.json"):
        assert (out / name).is_file(), name
    assert (out / "ranks" / "rank0.log").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert [a["arm"] for a in summary["arms"]] == ["off", "product"]
    assert summary["config"]["dp"] == 2 and summary["config"]["tp"] == 1
    # where the time went, per arm: every part measured, ess-patch a part of the step
    for arm in ("off", "product"):
        t = summary["time_s"][arm]
        assert t["steps"] == QUICK_STEPS
        assert t["sample"] > 0 and t["train"] > 0 and t["ess"] > 0
        assert 0 < t["ess_share_of_step"] < 1 and 0 < t["cpu_ess_share_of_step"] < 1


def test_quick_run_prints_the_table_and_the_time(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["demo", "--scenario", "mixed", "--quick", "--no-progress", "--steps", "2"]
    assert cli.main([*argv, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ESS-LR off" in text and "ESS-LR product" in text
    assert "where the time went" in text and "ess-patch" in text and "ms step" in text


def test_tensorboard_events_have_the_framework_metric_names(quick_run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out, records = quick_run
    events = EventAccumulator(str(out / "tb" / "product"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/lr_scale", "train/rho_ess", "reward"} <= tags
    product = [r for r in records if r["arm"] == "product"]
    logged = [e.value for e in events.Scalars("train/lr_scale")]
    assert logged == pytest.approx([r["lr_scale"] for r in product], rel=1e-6)


def test_figure_is_a_png(quick_run):
    _, out, _ = quick_run
    data = (out / "ess_demo.png").read_bytes()
    assert data[:8] == PNG_MAGIC
    import matplotlib.image

    image = matplotlib.image.imread(out / "ess_demo.png")
    assert image.shape[0] > 300 and image.shape[1] > 300


def test_both_arms_have_the_same_steps(quick_run):
    _, _, records = quick_run
    off = [r["step"] for r in records if r["arm"] == "off"]
    on = [r["step"] for r in records if r["arm"] == "product"]
    assert off == on == list(range(QUICK_STEPS))
    # same seeds: the first rollout (same weights, same sampling seed) is the same
    assert records[0]["reward"] == next(r for r in records if r["arm"] == "product")["reward"]


def _check_applied_lr(records: list[dict], floor: float) -> None:
    """applied LR == scheduled LR x scale at every step of every arm, and the scale is the
    arm's rule of the recorded rho (independently recomputed here)."""
    assert records
    by_arm: dict[str, list[dict]] = {}
    for r in records:
        by_arm.setdefault(r["arm"], []).append(r)
        assert r["update_successful"], r
        assert r["applied_lrs"] and len(r["applied_lrs"]) == len(r["scheduled_lrs"])
        for applied, scheduled in zip(r["applied_lrs"], r["scheduled_lrs"]):
            assert _rel_close(applied, scheduled * r["lr_scale"]), (r["arm"], r["step"])
        if r["arm"] == "off":
            assert r["lr_scale"] == 1.0 and r["applied_lrs"] == r["scheduled_lrs"]
        elif r["arm"] in ("product", "geometric", "on"):  # default rule sqrt, floor 0.1
            assert _rel_close(r["lr_scale"], max(floor, min(1.0, math.sqrt(r["rho"]))), 1e-9)
        elif r["arm"] == "vcpo":  # sqrt, no floor
            assert _rel_close(r["lr_scale"], min(1.0, math.sqrt(r["rho"])), 1e-9)
    for arm, rows in by_arm.items():
        assert [r["step"] for r in rows] == list(range(len(rows))), arm
    if "constant" in by_arm:
        product = [r["lr_scale"] for r in by_arm["product"]]
        mean = sum(product) / len(product)
        assert all(_rel_close(r["lr_scale"], mean) for r in by_arm["constant"])


def test_dp_layout_applies_scheduled_times_scale(quick_run):
    _, _, records = quick_run
    _check_applied_lr(records, floor=0.1)
    product = [r for r in records if r["arm"] == "product"]
    # stale and bf16 rollouts moved rho: the product arm braked at least once
    assert any(r["lr_scale"] < 1.0 for r in product)
    assert product[0]["mean_lag"] == 0.0  # step 0: every worker holds the initial weights
    assert 0 < product[0]["mismatch"] < 0.05  # bf16 engine vs fp32 trainer, at lag 0
    # the scheduler ran: warmup, so the scheduled LR changes over the run
    assert len({r["scheduled_lr"] for r in product}) > 1


def test_records_are_finite_and_consistent(quick_run):
    _, _, records = quick_run
    for r in records:
        for key in ("reward", "rho", "ess", "grad_norm", "mismatch", "mean_lag", "loss"):
            assert math.isfinite(r[key]), (key, r)
        assert 0.0 <= r["reward"] <= 1.0
        assert r["num_trajectories"] == 64  # 2 DP ranks x 8 prompts x 4 samples
        assert r["ess"] == pytest.approx(r["rho"] * r["num_trajectories"])
        assert 0 <= r["mean_lag"] <= 4  # --quick: max lag 4


LAYOUTS = {
    "dp1": {"dp": 1},
    "tp2": {"dp": 1, "tp": 2},  # megatron's tensor-parallel layers
    "pp2-1f1b": {"dp": 1, "pp": 2, "microbatches": 2},  # megatron's 1F1B schedule over gloo
}
LAYOUT_ARMS = ("off", "product", "vcpo", "constant")


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """The same 4-step run (one data-parallel rank's batch) in each layout. dp1 samples and
    records its tokens; tp2 and pp2 replay them teacher-forced (tests: the rollout tape), so
    the layouts are compared on the same tokens, whatever the CPU's kernels round."""
    from ess_patch.demo import quick_config, run

    out = tmp_path_factory.mktemp("layouts")
    tape = str(out / "tape")
    runs = {}
    for name, layout in LAYOUTS.items():
        mode = "record" if name == "dp1" else "replay"
        cfg = quick_config(
            steps=4, lag=2, arms=LAYOUT_ARMS, rollout_tape=tape, tape_mode=mode, **layout
        )
        runs[name] = run(cfg, out / name).records
    return runs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_applies_scheduled_times_scale(layout_runs, layout):
    records = layout_runs[layout]
    _check_applied_lr(records, floor=0.1)
    assert {r["arm"] for r in records} == set(LAYOUT_ARMS)
    assert all(r["num_trajectories"] == 32 for r in records)


#: Relative tolerance of a float32 quantity across layouts: TP splits a matmul's sum and PP
#: the batch, so each float32 sum rounds differently (about 1e-6 relative per op); rho, the
#: scale and the clipped gradient norm go through a few hundred of them and an exp().
LAYOUT_RTOL = 2e-3
#: The bf16 engine's side of the mismatch rounds at bf16 (8 bits): TP changes that rounding.
MISMATCH_ATOL = 1e-4


@pytest.mark.layouts
@pytest.mark.parametrize("layout", ["tp2", "pp2-1f1b"])
def test_layouts_give_the_same_run_up_to_rounding(layout_runs, layout):
    """TP splits the matmuls and PP the model and the batch (2 micro-batches): the same
    weights (a pipeline stage is cut from the whole model's init), the same tokens (replayed
    from dp1's tape), the same numbers up to float32 rounding, for the first two steps (later,
    Adam's normalised update amplifies rounding in near-zero gradients)."""
    base, other = layout_runs["dp1"], layout_runs[layout]
    assert [(r["arm"], r["step"]) for r in other] == [(r["arm"], r["step"]) for r in base]
    for a, b in zip(base, other):
        # the same tokens at every step, so the same rewards: exact by construction
        assert a["reward"] == b["reward"], (a["arm"], a["step"])
        if a["step"] > 1:
            continue
        for key in ("rho", "lr_scale", "grad_norm", "applied_lr"):
            assert a[key] == pytest.approx(b[key], rel=LAYOUT_RTOL), (key, a["arm"], a["step"])
        assert a["mismatch"] == pytest.approx(b["mismatch"], abs=MISMATCH_ATOL)


def test_a_replayed_run_in_its_own_layout_is_the_recorded_run(tmp_path):
    """Replaying a tape in the layout that recorded it scores the same tokens through the
    same KV-cache pass: the same run, bit for bit (teacher forcing changes no number)."""
    from ess_patch.demo import quick_config
    from ess_patch.demo.launch import launch

    tape = str(tmp_path / "tape")
    base = quick_config(steps=2, lag=1, arms=("off", "product"), dp=1, rollout_tape=tape)
    recorded = launch(base, tmp_path / "rec")
    replayed = launch(dataclasses.replace(base, tape_mode="replay"), tmp_path / "rep")
    keys = ("reward", "rho", "lr_scale", "grad_norm", "mismatch", "weights_sha256")
    assert [[r.get(k) for k in keys] for r in replayed] == [
        [r.get(k) for k in keys] for r in recorded
    ]


def test_a_tape_that_lacks_a_step_is_a_clear_error(tmp_path):
    from ess_patch.demo import quick_config
    from ess_patch.demo.launch import DemoError, launch
    from ess_patch.demo.train import DemoConfigError

    tape = tmp_path / "tape"
    short = quick_config(steps=1, lag=1, arms=("off",), dp=1, rollout_tape=str(tape))
    launch(short, tmp_path / "rec")
    longer = dataclasses.replace(short, steps=2, tape_mode="replay")
    with pytest.raises(DemoError, match=r"no off-1-dp0\.pt.*same arms, steps and dp"):
        launch(longer, tmp_path / "rep")
    with pytest.raises(DemoConfigError, match="tape_mode"):
        dataclasses.replace(short, tape_mode="rewind")
    with pytest.raises(DemoConfigError, match="needs the tape's directory"):
        dataclasses.replace(short, rollout_tape=None, tape_mode="replay")


def test_off_arm_is_bit_identical_to_a_run_without_ess_patch(tmp_path):
    """ess_patch.install() + compute_ess_lr every step, never armed == ess-patch absent."""
    from ess_patch.demo import quick_config
    from ess_patch.demo.launch import launch

    runs = {}
    for installed in (True, False):
        cfg = quick_config(steps=4, lag=2, arms=("off",), install_ess=installed)
        runs[installed] = launch(cfg, tmp_path / str(installed))
    keys = ("reward", "mismatch", "loss", "grad_norm", "applied_lrs", "scheduled_lrs")
    for a, b in zip(runs[True], runs[False], strict=True):
        assert [a[k] for k in keys] == [b[k] for k in keys], a["step"]
    assert runs[True][-1]["weights_sha256"] == runs[False][-1]["weights_sha256"]
    assert math.isfinite(runs[True][0]["rho"]) and math.isnan(runs[False][0]["rho"])


def test_worker_lags_hand_values():
    from ess_patch.demo.train import worker_lags

    # 4 workers, max lag 6: pull every 1, 3, 5, 7 steps, phase w
    assert worker_lags(0, 4, 6) == [0, 0, 0, 0]  # nothing older than the start
    assert worker_lags(1, 4, 6) == [0, 1, 1, 1]
    assert worker_lags(10, 4, 6) == [0, 2, 2, 6]
    assert max(max(worker_lags(s, 4, 6)) for s in range(100)) == 6
    assert worker_lags(5, 1, 3) == [1]  # one worker: pulls every 4 steps
    assert worker_lags(7, 3, 0) == [0, 0, 0]  # max lag 0: on-policy


def test_task_answers_and_partial_credit():
    import torch

    from ess_patch.demo import task

    prompts = torch.tensor([[11, 3, 1, 2, 10]])
    assert task.targets("sort", prompts, 3).tolist() == [[1, 2, 3]]
    assert task.targets("reverse", torch.tensor([[12, 3, 1, 2, 10]]), 3).tolist() == [[2, 1, 3]]
    # add, least significant digit first: 95 + 17 = 112 -> mod 100 = 12 -> digits [2, 1]
    add = torch.tensor([[13, 5, 9, 7, 1, 10]])
    assert task.targets("add", add, 2).tolist() == [[2, 1]]
    assert task.rewards(torch.tensor([[1, 2, 0]]), torch.tensor([[1, 2, 3]])).tolist() == [
        pytest.approx(2 / 3)
    ]
    gen = torch.Generator().manual_seed(0)
    p = task.make_prompts("add", 16, 5, gen)
    assert p.shape == (5, task.prompt_length("add", 16)) == (5, 34)
    assert int(p[:, 1:-1].max()) < task.DIGITS and int(p.max()) < task.VOCAB
    with pytest.raises(ValueError, match="task='copy'"):
        task.make_prompts("copy", 4, 1, gen)


def test_policy_engine_matches_the_trainer_up_to_bf16(tmp_path):
    """The KV-cache engine's log-probs equal the trainer's teacher-forced ones in fp32, and
    differ by bf16 rounding only in bf16: the lag-0 mismatch the demo has."""
    import torch

    from ess_patch.demo import task
    from ess_patch.demo.policy import (
        PolicySpec,
        RolloutEngine,
        build_policy,
        single_process,
        train_logprobs,
    )

    n = 12
    spec = PolicySpec(max_len=task.prompt_length("sort", n) + n)
    with single_process(str(tmp_path)):
        torch.manual_seed(0)
        model = build_policy(spec)
        prompts = task.make_prompts("sort", n, 6, torch.Generator().manual_seed(1))
        diffs = {}
        for dtype in (torch.float32, torch.bfloat16):
            engine = RolloutEngine(spec, dtype=dtype)
            engine.load(model.state_dict())
            out = engine.sample(prompts, n, torch.Generator().manual_seed(2))
            assert out.tokens.shape == out.logp.shape == (6, n)
            logp = train_logprobs(model, prompts, out.tokens)
            assert logp.requires_grad
            diffs[dtype] = (logp.detach() - out.logp).abs().max().item()
        with pytest.raises(ValueError, match="exceed the model's max_len"):
            engine.sample(prompts, n + 1, torch.Generator())
    assert diffs[torch.float32] < 1e-5
    assert 1e-5 < diffs[torch.bfloat16] < 0.1


def test_collapse_criterion():
    rising = [0.1 + 0.01 * i for i in range(100)]
    assert not report.collapsed(rising)
    assert report.collapsed(rising + [0.1] * 40)  # gave back all its gain
    assert not report.collapsed([0.1] * 100)  # never learned: nothing to collapse
    assert report.collapsed([0.1, float("nan")])


# --- stress scenario (issue 15) ---------------------------------------------------------------


def test_stress_config_is_the_selected_scenario():
    from ess_patch.demo.scenarios.stress import STRESS_ARMS, stress_config

    cfg = stress_config()
    # What benchmarks/stress_select.py chose from the off arm alone, and the four arms.
    assert (cfg.loss, cfg.lag, cfg.lr, cfg.clip_grad, cfg.steps) == STRESS_CHOICE
    assert (cfg.dp, cfg.tp, cfg.pp) == (2, 1, 1)
    assert cfg.arms == STRESS_ARMS == ("off", "geometric", "product", "constant", "vcpo")
    assert cfg.control_of == "product"
    assert stress_config(steps=7).steps == 7


def test_bad_configs_name_the_field():
    from ess_patch.demo import DemoConfig
    from ess_patch.demo.train import DemoConfigError

    cases = [
        ({"arms": ("off", "constant", "product")}, "arms", "which must come before it"),
        ({"loss": "tokens"}, "loss", "give one of ('tis', 'sequence', 'seq-tis')"),
        ({"cp": 2}, "cp", "Transformer Engine"),
        ({"response_len": 0}, "response_len", "[1, 256]"),
        ({"tp": 3}, "tp", "vocabulary"),
        ({"microbatches": 3}, "microbatches", "rollouts per rank (32)"),
        ({"device": "tpu"}, "device", "('cpu', 'cuda')"),
    ]
    for kwargs, field, problem in cases:
        with pytest.raises(DemoConfigError) as info:
            DemoConfig(**kwargs)
        assert info.value.field == field and problem in info.value.problem, kwargs


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(),
    reason="a CUDA device is visible: runs on CPU-only machines (CI, this project's)",
)
def test_cuda_on_a_cpu_only_machine_fails_clearly(capsys, tmp_path):
    assert cli.main(["demo", "--device", "cuda", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ess-patch demo: --device no CUDA device is available"), err
    assert "--device cpu" in err
    assert not (tmp_path / "o").exists()


def test_bootstrap_ci_hand_values():
    from ess_patch.demo.stats import bootstrap_ci

    assert bootstrap_ci([0.3] * 5) == (0.3, 0.3)
    # Two values: resampled means are a, (a+b)/2, b with P = 1/4, 1/2, 1/4, so the 2.5% and
    # 97.5% points are a and b.
    assert bootstrap_ci([1.0, 3.0]) == (1.0, 3.0)
    # [0, 0, 0, 0, 1]: the resampled mean is Binomial(5, 0.2) / 5. P(0) = 0.328 > 2.5%, so
    # the low end is 0; P(k <= 2) = 0.942 < 97.5% <= P(k <= 3) = 0.993, so the high end is 0.6.
    assert bootstrap_ci([0.0, 0.0, 0.0, 0.0, 1.0]) == (0.0, 0.6)
    # 80%: P(k <= 1) = 0.737 < 90% <= P(k <= 2) = 0.942, so 0.4.
    assert bootstrap_ci([0.0, 0.0, 0.0, 0.0, 1.0], level=0.8) == (0.0, 0.4)
    with pytest.raises(ValueError, match="at least one value"):
        bootstrap_ci([])


def test_paired_differences_hand_values():
    from ess_patch.demo.stats import paired

    p = paired("product", [0.5, 0.7, 0.2, 0.9], "off", [0.25, 0.7, 0.5, 0.4])
    assert p.diffs == (0.25, 0.0, -0.3, 0.5)
    assert p.mean == pytest.approx(0.1125)
    assert p.wins == 2 and p.n == 4  # a tie is not a win
    assert -0.3 <= p.ci_low <= p.mean <= p.ci_high <= 0.5
    with pytest.raises(ValueError, match="paired\\('product', 'off'\\): need the same"):
        paired("product", [0.1, 0.2], "off", [0.1])


def test_stress_flags_need_the_stress_scenario(capsys):
    assert cli.main(["demo", "--scenario", "mixed", "--seeds", "3", "--no-progress"]) == 2
    assert "--seeds and --lags need --scenario stress" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["demo", "--scenario", "stress", "--lags", "4,x"])


def test_short_stress_run_pairs_arms(tmp_path):
    from ess_patch.demo.scenarios.stress import run_stress, stress_config

    cfg = stress_config(steps=4, lag=2)
    result = run_stress(cfg, tmp_path, seeds=2)
    rows = [json.loads(line) for line in result.steps_path.read_text().splitlines()]
    for seed in (0, 1):
        by_arm = {
            arm: sorted(
                (r for r in rows if r["seed"] == seed and r["arm"] == arm), key=lambda r: r["step"]
            )
            for arm in cfg.arms
        }
        # Same seed per arm: the first rollout (same weights, same sampling seed) is identical,
        # and so is its rho under the same weights (the scenario's, product, in off/constant)
        first = {arm: (rs[0]["reward"], rs[0]["rho"]) for arm, rs in by_arm.items()}
        assert len({reward for reward, _ in first.values()}) == 1, first
        assert len({first[a] for a in ("off", "product", "constant", "vcpo")}) == 1, first
        # The control's multiplier is the mean scale of the same seed's product run.
        product_scales = [r["lr_scale"] for r in by_arm["product"]]
        mean_scale = sum(product_scales) / len(product_scales)
        assert product_scales != [1.0] * len(product_scales)  # it did brake
        for r in by_arm["constant"]:
            assert _rel_close(r["lr_scale"], mean_scale)
            assert _rel_close(r["applied_lr"], r["scheduled_lr"] * mean_scale, rel=1e-5)
        assert all(r["lr_scale"] == 1.0 for r in by_arm["off"])
    main = result.summary["by_lag"]["2"]
    off = [main["runs"][str(s)]["off"]["final_reward"] for s in (0, 1)]
    prod = [main["runs"][str(s)]["product"]["final_reward"] for s in (0, 1)]
    pair = next(p for p in main["paired"] if p["arm"] == "product" and p["base"] == "off")
    assert pair["diffs"] == pytest.approx([p - o for p, o in zip(prod, off)])
    assert "| product - constant |" in result.table
    assert result.figure.read_bytes()[:8] == PNG_MAGIC


def _rows(arm: str, scales: list[float]) -> list[dict]:
    return [
        {"arm": arm, "step": i, "reward": 0.5, "rho": s * s, "lr_scale": s,
         "scheduled_lr": 1e-2, "applied_lr": 1e-2 * s, "mismatch": 0.1}
        for i, s in enumerate(scales)
    ]  # fmt: skip


def test_table_counts_scaled_steps():
    """399 of 400 steps scaled reads 399/400, not a rounded "100%"."""
    records = _rows("off", [1.0] * 400) + _rows("on", [1.0] + [0.99] * 399)
    summaries = report.summarize(records, ("off", "on"))
    assert [(s.scaled_steps, s.steps) for s in summaries] == [(0, 400), (399, 400)]
    table = report.format_table(summaries)
    assert "0/400 steps" in table and "399/400 steps" in table
    assert "%" not in table


def test_rho_and_scale_axes_follow_the_data():
    """rho in [0.95, 1]: the axis spans about that range (not 0-1) and keeps a line at 1.0."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    try:
        report._scale_to_data(ax, [0.95, 0.97, 1.0])
        low, high = ax.get_ylim()
        assert 0.9 < low < 0.95 and 1.0 < high < 1.01
        assert any(list(line.get_ydata()) == [1.0, 1.0] for line in ax.get_lines())
    finally:
        plt.close(fig)


def test_megatron_on_cpu_sends_a_positional_cuda_ordinal_to_the_cpu():
    """Inside megatron_on_cpu, torch.cuda.current_device() is 0 (megatron asks for it), so
    host code moves tensors with ``.to(0)``: Tensor.to and the parser behind TensorDict.to
    (``torch._C._nn._parse_to``, what verl's engine calls with ``get_device_id()``) land on
    the CPU instead of failing for want of an accelerator."""
    import torch

    from ess_patch.demo.cpu import megatron_on_cpu

    with megatron_on_cpu():
        device, *_ = torch._C._nn._parse_to(torch.cuda.current_device())
        moved = torch.ones(2).to(0)
    assert device == torch.device("cpu") and moved.device.type == "cpu"
