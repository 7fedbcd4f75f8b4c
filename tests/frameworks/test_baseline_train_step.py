"""VCPO's baseline (``--use-ess-baseline``) through the REAL slime and miles train path.

``tests/frameworks/ledger_run.py`` drives each framework's real ``parse_args`` (ess-patch
installed), its actor's ``train_actor`` (which lends the model to the advantage hook), its
advantage routine, ``train`` / ``train_one_step``, the loss (``loss_function`` ->
``policy_loss_function``, PPO-clipped at the framework's default eps 0.2; miles packs the
micro-batches as THD with ``--qkv-format thd``), megatron-core's schedule, DDP and optimizer.
The loss function the train loop calls is wrapped to record what each sample's policy-gradient
term was handed; the loss itself runs unchanged.

Independent expectation: each sample's squared gradient norm of ``sum_t m_t w_t log p(y_t)``
in float64 from the actor's weights at the hook (``w_t = exp(log_probs - rollout_log_probs)``,
the log-probs the hook saw), then ``b*`` per prompt group: every token of every sample must be
trained with ``r_i - b*`` (float32 tolerance), and the run must differ from the group mean.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared helpers
from upstream import skip_reason

import ess_patch

N_PER_PROMPT = 2  # ledger_run's argv: --n-samples-per-prompt 2


def _expected(rollouts: list[dict], n: int = N_PER_PROMPT) -> dict[tuple, float]:
    """tokens -> the advantage ``r - b*`` that sample must train with, over the samples of
    every DP rank's share of one rollout (``rollouts``: that rollout as each rank saw it)."""
    from ledger_run import reference_log_probs

    from ess_patch.baseline import min_variance_baseline

    sq, rewards, ids, keys = [], [], [], []
    for rollout in rollouts:
        weights = {k: v.double().requires_grad_() for k, v in rollout["weights"].items()}
        hook = rollout["hook_log_probs"]
        for k, i in enumerate(rollout["local"]):
            s = rollout["samples"][i]
            lp = reference_log_probs(weights, s["tokens"], s["response_length"])
            w = (
                1.0
                if hook is None
                else torch.exp(hook[k].double() - s["rollout_log_probs"].double())
            )
            term = (s["loss_mask"].double() * w * lp).sum()
            grads = torch.autograd.grad(term, list(weights.values()))
            sq.append(sum(g.square().sum() for g in grads))
            rewards.append(s["reward"])
            ids.append(i // n)
            keys.append(tuple(s["tokens"].tolist()))
    order = torch.tensor(ids).argsort(stable=True)
    res = min_variance_baseline(
        None, torch.tensor(rewards, dtype=torch.float64), torch.stack(sq), torch.tensor(ids)
    )
    plain = torch.tensor(rewards, dtype=torch.float64)[order].reshape(-1, n)
    moved = (res.advantages[order] - (plain - plain.mean(1, keepdim=True)).flatten()).abs().max()
    assert moved > 1e-3  # b* is not the group mean here: the check can tell them apart
    return dict(zip(keys, res.advantages.tolist(), strict=True))


def _check(runs: list[dict], n: int = N_PER_PROMPT, *, tp: int = 1) -> None:
    """Every rank trained each of its samples on ``r - b*`` of the whole rollout. ``tp``: the
    ranks are one TP group (each holds every sample and its shard of the head, the reference
    takes the whole head)."""
    for run in runs:
        assert run["records"], "no optimizer step ran"
    for index in range(len(runs[0]["rollouts"])):
        shares = [run["rollouts"][index] for run in runs]
        if tp > 1:  # one share: every sample, the whole model's weights (ledger_run gathers)
            shares = shares[:1]
        want = _expected(shares, n)
        for run in runs:
            rollout = run["rollouts"][index]
            seen = rollout["loss_saw"]
            local = {tuple(rollout["samples"][i]["tokens"].tolist()) for i in rollout["local"]}
            assert {tuple(t) for t, _ in seen} == local  # every sample of the rank trained
            for tokens, adv in seen:
                target = want[tuple(tokens)]
                assert adv == pytest.approx([target] * len(adv), rel=1e-5, abs=1e-6), (tokens, adv)


@pytest.fixture
def world(tmp_path, clean_ess):
    from ledger_run import megatron_groups

    from ess_patch.demo.cpu import megatron_on_cpu

    with megatron_on_cpu(), megatron_groups(tmp_path):
        yield


@pytest.mark.skipif(skip_reason("slime", "full") is not None, reason="slime snapshot")
@pytest.mark.parametrize("path", ["rules", "exact"])
def test_slime_trains_on_r_minus_b_star(world, path):
    from ledger_run import slime_train

    ess_patch.install()  # the README's call: every integration it finds
    flags = ["--use-ess-baseline", "--ess-baseline-path", path, "--global-batch-size", "8"]
    _check([slime_train(flags, rollouts=1, steps=1, spy=True)])


@pytest.mark.skipif(skip_reason("miles", "full") is not None, reason="miles snapshot")
@pytest.mark.parametrize("qkv", ["thd", "bshd"], ids=["packed", "padded"])
@pytest.mark.parametrize("path", ["rules", "exact"])
def test_miles_trains_on_r_minus_b_star(world, path, qkv):
    """miles' two layouts: packed micro-batches (``--qkv-format thd``, its default) and padded
    ones (``bshd``)."""
    from ledger_run import miles_train

    ess_patch.install()  # the README's call: every integration it finds
    flags = ["--use-ess-baseline", "--ess-baseline-path", path, "--global-batch-size", "8"]
    _check([miles_train([*flags, "--qkv-format", qkv], rollouts=1, spy=True)])


# --- several processes ----------------------------------------------------------------------------


def _rank_train(fw: str, flags: list[str], tp: int = 1, pp: int = 1) -> dict:
    from ledger_run import miles_train, slime_train
    from megatron.core import parallel_state as ps

    from ess_patch.demo.cpu import megatron_on_cpu

    if tp > 1:  # the launch's two DP ranks become one TP group
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=True)
        flags = [*flags, "--tensor-model-parallel-size", str(tp)]
    if pp > 1:  # run_ranks set the stages up
        flags = [*flags, "--pipeline-model-parallel-size", str(pp)]
        # megatron's p2p synchronizes CUDA around its shape exchange: nothing to wait for here
        torch.cuda.synchronize = lambda *_a: None
    with megatron_on_cpu():
        ess_patch.install()  # the README's call, as in every rank of a job
        if fw == "slime":
            run = slime_train(flags, rollouts=1, steps=1, spy=True)
        else:
            run = miles_train(flags, rollouts=1, spy=True)
    run["records"] = [
        {"lr": r["lr"], "head": r["weights"].get("head.weight")} for r in run["records"]
    ]
    run["last_stage"] = ps.is_pipeline_last_stage()
    return run


#: (framework, its micro-batch layout flags): slime always packs (THD); miles packs by
#: default (``--qkv-format thd``) and pads with ``bshd``
FRAMEWORKS = [
    pytest.param(
        fw,
        qkv,
        id=f"{fw}-{'padded' if 'bshd' in qkv else 'packed'}",
        marks=pytest.mark.skipif(
            skip_reason(fw, "full") is not None, reason=skip_reason(fw, "full") or ""
        ),
    )
    for fw, qkv in (
        ("slime", []),
        ("miles", ["--qkv-format", "thd"]),
        ("miles", ["--qkv-format", "bshd"]),
    )
]


@pytest.mark.dist
@pytest.mark.parametrize(("fw", "qkv"), FRAMEWORKS)
@pytest.mark.parametrize(("n", "path"), [(2, "rules"), (8, "exact")], ids=["whole", "split"])
def test_dp2_every_rank_trains_on_r_minus_b_star_of_the_whole_rollout(fw, qkv, n, path, tmp_path):
    """DP2 through the real train path: each rank trains on its half of the 8 samples. With
    2 samples per prompt every group is on one rank; with 8 every group is split over the two
    ranks and ``b*`` is reduced over DP (the float64 reference sees all 8 samples)."""
    from harness import run_ranks

    flags = ["--use-ess-baseline", "--ess-baseline-path", path, "--global-batch-size", "8", *qkv]
    flags += ["--n-samples-per-prompt", str(n), "--rollout-batch-size", str(8 // n)]
    runs = run_ranks(
        _rank_train, dp=2, args=(fw, flags), tmp_path=tmp_path, timeout=300, gloo_groups=True
    )
    assert [run["dp_rank"] for run in runs] == [0, 1]
    _check(runs, n)


@pytest.mark.dist
@pytest.mark.parametrize(("fw", "qkv"), FRAMEWORKS)
@pytest.mark.parametrize("path", ["rules", "exact"])
def test_tp2_the_sharded_head_trains_every_sample_on_r_minus_b_star(fw, qkv, path, tmp_path):
    """TP2 through the real train path: the two ranks are one TP group, each with every sample
    and its half of a vocabulary-parallel head (the framework's loss takes vocabulary-parallel
    log-probs). The norms are summed over TP (the replicated embedding counted once) and both
    ranks train every token on ``r - b*`` of the float64 reference on the whole head."""
    from harness import run_ranks
    from ledger_run import VOCAB_TP

    flags = ["--use-ess-baseline", "--ess-baseline-path", path, "--global-batch-size", "8", *qkv]
    runs = run_ranks(
        _rank_train, dp=2, args=(fw, flags, 2), tmp_path=tmp_path, timeout=300, gloo_groups=True
    )
    assert [run["dp_size"] for run in runs] == [1, 1]
    assert runs[0]["rollouts"][0]["weights"]["head.weight"].shape[0] == VOCAB_TP
    shards = [run["records"][0]["head"] for run in runs]  # what each rank's step started from
    assert [s.shape[0] for s in shards] == [VOCAB_TP // 2] * 2 and not torch.equal(*shards)
    _check(runs, tp=2)


@pytest.mark.dist
@pytest.mark.parametrize(("fw", "qkv"), FRAMEWORKS)
@pytest.mark.parametrize("path", ["rules", "exact"])
def test_pp2_the_last_stage_trains_every_sample_on_r_minus_b_star(fw, qkv, path, tmp_path):
    """PP2 through the real train path and megatron's pipeline schedule: the first stage
    holds the embedding, the second the head; both run the norm pass together and step their
    optimizers; the loss, on the last stage, trains every token on ``r - b*`` of the float64
    reference on the whole model."""
    from harness import run_ranks

    flags = ["--use-ess-baseline", "--ess-baseline-path", path, "--global-batch-size", "8", *qkv]
    runs = run_ranks(
        _rank_train,
        pp=2,
        args=(fw, flags),
        kwargs={"pp": 2},
        tmp_path=tmp_path,
        timeout=300,
        gloo_groups=True,
    )
    first, last = runs
    assert not first["last_stage"] and last["last_stage"]
    assert first["records"] and not first["rollouts"][0]["loss_saw"]  # stepped; no loss there
    _check([last])
