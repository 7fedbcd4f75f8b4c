"""ess-patch inside the REAL Megatron-RL code (``MEGATRON_RL_SRC``: a Megatron-LM tree with
``megatron/rl``; test_megatron_lm_snapshots.py runs this file on every snapshot, each with the
megatron-core of its own version).

- the real ``megatron.training.arguments.parse_args`` accepts the flags after install(),
  composed with a user's ``extra_args_provider``, and, for a Megatron-RL run
  (``--perform-rl-step``), rejects a run without inference log-probs and a bad floor; a
  miles/slime-like parse whose provider declares ``--use-ess-lr`` is left to that framework,
  and ``--use-ess-lr`` on a plain Megatron parse is refused;
- the real ``align_unpacked_inference_logprobs`` (unpacked) and the real packing path
  (``pack_all_trajectories`` -> ``pack_inference_logprobs`` ->
  ``compute_packed_inference_logprobs_stats``) in a gloo world (DP2 x CP2, and DP2 x PP2)
  arm on every rank the float64 reference scale of all ranks' trajectories, over the positions
  the inference engine scored (never the appended eod), all-pad rows left out; every optimizer
  step of a real megatron-core optimizer in that collection is scaled by it, and the LRs are
  restored before the scheduler; the next collection drops it; disabled, nothing changes;
  ``--ess-lr-shadow`` computes and logs the same result and arms nothing;
- the real ``maybe_log_training_metrics`` hands the metrics to a real tensorboard writer and
  wandb's tables, beside Megatron-RL's own, at its step (the writers it is given up to
  core_v0.16, Megatron's global writers after);
- bad input (no inference log-probs, mismatched shapes, unpacked and packed) is an error on
  every rank, nothing armed; ``ess-patch doctor`` lists the megatron_rl targets.

With ``ESS_PATCH_TEST_MODE=vendored`` the same tests run against a copy of the tree patched
with ``patches/megatron_rl`` (``MEGATRON_RL_SRC`` pointing at it) and never call ``install()``:
where a test would install, it checks that every target it can see carries the diff's call
site instead (the optimizers still get ``install("megatron")``: that diff does not cover
them). tests/frameworks/test_vendored_frameworks.py runs it that way.

Nothing is stubbed at import: on CPU, ``megatron.rl.rl_utils`` imports with the packages of
``requirements-full.txt`` (tensorboard included); ``.cuda()`` goes through the demo's CPU shim;
the packed path's timers and NVTX ranges (CUDA-only, they only time) are no-ops at run time.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared helpers
from harness import layout, run_ranks
from reference import reference_ess

from ess_patch.errors import EssPatchValueError

SRC = os.environ.get("MEGATRON_RL_SRC")


def _skip_reason() -> str | None:
    if not SRC:
        return "MEGATRON_RL_SRC is not set (a Megatron-LM core_v0.16.1 checkout; see tox.ini)"
    if not (Path(SRC) / "megatron" / "rl" / "rl_utils.py").is_file():
        return f"MEGATRON_RL_SRC={SRC} has no megatron/rl/rl_utils.py"
    loaded = sys.modules.get("megatron.training")
    if loaded is not None and not str(loaded.__path__[0]).startswith(str(Path(SRC).resolve())):
        return f"megatron.training is already imported from {loaded.__path__[0]} (run separately)"
    return None


SKIP = _skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
if SKIP is None and SRC not in sys.path:
    sys.path.append(SRC)  # beside the installed megatron-core (megatron is a namespace package)

B, S = 8, 24  # trajectories in the whole batch, sequence length
DP = 2
EOD, PAD = 1, 0  # the test tokenizer's

# The tree on the path is patched with patches/megatron_rl (see the module docstring).
VENDORED = os.environ.get("ESS_PATCH_TEST_MODE") == "vendored"


def _install() -> None:
    """``install(["megatron", "megatron_rl"])``; in vendored mode, a check instead that every
    target whose module is imported already calls ess-patch through the diff (and nothing is
    installed)."""
    import importlib

    import ess_patch

    if not VENDORED:
        ess_patch.install(["megatron", "megatron_rl"])
        return
    from ess_patch.install import INTEGRATIONS
    from ess_patch.vendored import is_vendored

    seen = 0
    for target in INTEGRATIONS["megatron_rl"].targets:
        if target.module not in sys.modules or not target.vendored:  # install()-only targets
            continue
        value = vars(importlib.import_module(target.module)).get(target.attribute)
        assert is_vendored(value), f"{target.path} is not patched (vendored mode)"
        seen += 1
    assert seen, "vendored mode: no megatron_rl target is imported yet"
    assert not ess_patch.is_installed()


def _global_batch(seed: int = 0) -> list[dict]:
    """B trajectories: prompt, generated tokens, train and inference log-probs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(B):
        prompt = 3 + i % 4
        gen = 4 + (5 * i) % 11
        tokens = torch.randint(5, 50, (prompt + gen,), generator=g)
        tokens[-1] = EOD  # appended by the train side: the engine never scored it
        gen_mask = torch.zeros(S, dtype=torch.bool)
        gen_mask[prompt : prompt + gen] = True
        old = -torch.rand(S - 1, generator=g, dtype=torch.float32) * 2
        # inference log-probs: the generated tokens minus the eod, which reuses old's value
        inf = old[prompt - 1 : prompt - 1 + gen - 1] + 0.4 * torch.randn(gen - 1, generator=g)
        out.append(dict(tokens=tokens, gen_mask=gen_mask, old=old, inf=inf, prompt=prompt))
    return out


def _reference(batch: list[dict], *, with_eod: bool = False, **kw) -> dict:
    """float64 ESS over the positions the engine scored (``with_eod``: also the appended eod,
    at log-ratio 0, as upstream's unpacked alignment fills it)."""
    lps, rlps, masks = [], [], []
    for t in batch:
        mask = t["gen_mask"][1:].clone()
        rlp = t["old"].clone().double()
        start = t["prompt"] - 1
        rlp[start : start + len(t["inf"])] = t["inf"].double()
        if not with_eod:
            mask[start + len(t["inf"]) :] = False
        lps.append(t["old"].double())
        rlps.append(rlp)
        masks.append(mask)
    return reference_ess(lps, rlps, masks, **kw)


def _set_host_args(mode: str = "product", **extra) -> None:
    from megatron.training import global_vars

    args = argparse.Namespace(
        use_ess_lr=True,
        ess_lr_floor=0.1,
        ess_lr_weight_mode=mode,
        ess_lr_rule="sqrt",
        ess_lr_base_ratio=1.0,
        ess_lr_nonfinite="raise",
        rl_inference_logprobs_is_correction=True,
    )
    for k, v in extra.items():
        setattr(args, k, v)
    global_vars._GLOBAL_ARGS = args


def _my_trajectories(batch: list[dict]) -> list[dict]:
    lay = layout()
    per = len(batch) // lay.dp_size
    return batch[lay.dp_rank * per : (lay.dp_rank + 1) * per]


def rank_unpacked(bad: str = "", mode: str = "product") -> dict:
    import ess_patch
    from ess_patch.demo.cpu import megatron_on_cpu

    if bad == "shadow":  # --ess-lr-shadow instead of --use-ess-lr
        _set_host_args(mode, use_ess_lr=False, ess_lr_shadow=True)
    elif bad == "split-calibrating":
        _set_host_args(mode, ess_lr_calibrate_rollouts=2)
    else:
        _set_host_args(mode)
    from megatron.rl import rl_utils

    from ess_patch.state import STATE

    _install()
    mine = _my_trajectories(_global_batch())
    # and a row without generated tokens (and so no inference log-prob): not a trajectory
    old = torch.stack([t["old"] for t in mine] + [-torch.rand(S - 1)])
    gen_masks = torch.stack([t["gen_mask"] for t in mine] + [torch.zeros(S, dtype=torch.bool)])
    inference = [t["inf"] for t in mine] + [torch.empty(0)]
    lay = layout()
    if bad == "short" and lay.dp_rank == 1 and lay.cp_rank == 0:
        inference = inference[:-1]  # one trajectory fewer than old has rows
    if bad == "missing" and lay.dp_rank == 1:
        inference = None
    if bad.startswith("split") and lay.cp_rank == 1:  # CP peers whose rows differ (not whole rows)
        inference = [t + 0.25 for t in inference[:-1]] + inference[-1:]
    stats = SimpleNamespace()
    with megatron_on_cpu():
        try:
            padded = rl_utils.align_unpacked_inference_logprobs(
                inference_logprobs=inference,
                old_logprobs_for_data=old,
                generation_masks=gen_masks,
                group_stats=stats,
            )
        except Exception as exc:
            return {
                "error": f"{type(exc).__name__}: {exc}",
                "armed": ess_patch.armed(),
                "calibration": STATE.calibration,
            }
    plain = rl_utils.align_unpacked_inference_logprobs.__wrapped__(
        inference, old, gen_masks, SimpleNamespace()
    )
    if bad == "shadow":
        tb = _Writer()
        _log_training_metrics(rl_utils, 5, None, tb)
        r = STATE.shadow
        return {
            "result": (r.scale, r.rho, r.status, r.num_trajectories),
            "armed": ess_patch.armed(),
            "logged": {k: v for k, v, _ in tb.scalars},
            "same_output": torch.equal(padded, plain),
        }
    r = ess_patch.armed()
    return {
        "result": (r.scale, r.rho, r.status, r.num_trajectories),
        "same_output": torch.equal(padded, plain),
        "upstream_stat": stats.mean_piold_to_inf_prob,
    }


class _Writer:
    """A tensorboard writer's ``add_scalar``, kept in memory (inside gloo ranks)."""

    def __init__(self):
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, key, value, step):
        self.scalars.append((key, value, step))


def _check_reference(results: list[dict], mode: str = "product") -> None:
    ref = _reference(_global_batch(), mode=mode)
    assert ref["rho"] < 0.99  # a real check, not rho = 1
    if mode == "geometric":  # the appended eod (log-ratio 0) would dilute each mean
        assert _reference(_global_batch(), mode=mode, with_eod=True)["rho"] != pytest.approx(
            ref["rho"], rel=1e-6
        )
    got = {r["result"] for r in results}
    assert len(got) == 1, got  # every rank armed the same result
    scale, rho, status, n = got.pop()
    assert status == "ok" and n == B
    assert rho == pytest.approx(ref["rho"], rel=1e-6)
    assert scale == pytest.approx(ref["scale"], rel=1e-6)


# geometric (the default) is where the appended eod would change the answer; product as VCPO
LAYOUTS = pytest.mark.parametrize(
    "cp,pp,mode", [(2, 1, "geometric"), (1, 2, "product")], ids=["dp2xcp2", "dp2xpp2"]
)


@pytest.mark.dist
@LAYOUTS
def test_unpacked_arms_the_reference_scale_on_every_rank(cp, pp, mode, tmp_path):
    results = run_ranks(
        rank_unpacked, dp=DP, cp=cp, pp=pp, args=("", mode), tmp_path=tmp_path, timeout=120
    )
    _check_reference(results, mode)
    assert all(r["same_output"] for r in results)  # upstream's own output untouched
    assert all(r["upstream_stat"] is not None for r in results)


def rank_steps() -> dict:
    """One collection (the real align arms its ESS), then two optimizer steps of a real
    megatron-core optimizer with Megatron's scheduler after each, as ``train_step`` does; then
    the next collection starts. The LRs the torch optimizer sees inside each step are kept."""
    from megatron_cpu import batch, build_megatron_optimizer, forward_backward, inner_optimizers

    import ess_patch
    from ess_patch.demo.cpu import megatron_on_cpu
    from ess_patch.integrations import megatron_rl

    _set_host_args()
    from megatron.rl import rl_utils

    if VENDORED:  # the megatron_rl diff does not cover the optimizers: install("megatron")
        _install()
        ess_patch.install("megatron")
    else:
        ess_patch.install(["megatron", "megatron_rl"])
    mine = _my_trajectories(_global_batch())
    with megatron_on_cpu():
        rl_utils.align_unpacked_inference_logprobs(
            [t["inf"] for t in mine],
            torch.stack([t["old"] for t in mine]),
            torch.stack([t["gen_mask"] for t in mine]),
            SimpleNamespace(),
        )
        scale = ess_patch.armed().scale
        setup = build_megatron_optimizer("fp32", optimizer="adam")
        seen: list[list[float]] = []
        for child in inner_optimizers(setup.optimizer):
            child.optimizer.register_step_pre_hook(
                lambda opt, *_: seen.append([g["lr"] for g in opt.param_groups])
            )
        steps = []
        for i in range(2):  # two optimizer steps in one collection
            scheduled = [g["lr"] for g in setup.optimizer.param_groups]
            forward_backward(setup, *batch(0, i))
            setup.optimizer.step()
            after_step = [g["lr"] for g in setup.optimizer.param_groups]
            setup.scheduler.step(increment=1)
            steps.append((scheduled, seen[-1], after_step))
    # the next collection: nothing carried over, even before it arms its own (this one arms
    # none, which stops the run)
    seen_next: list = []
    stopped = None
    try:
        megatron_rl.prepare_wrapper(lambda: seen_next.append(ess_patch.armed()), None, (), {})
    except ess_patch.EssLrNotAppliedError as exc:
        stopped = str(exc)
    return {"scale": scale, "steps": steps, "armed_after": seen_next, "stopped": stopped}


@pytest.mark.dist
def test_every_optimizer_step_of_the_collection_is_scaled_and_restored(tmp_path):
    results = run_ranks(rank_steps, dp=DP, tmp_path=tmp_path, timeout=120)
    ref = _reference(_global_batch(), mode="product")
    for r in results:
        assert r["scale"] == pytest.approx(ref["scale"], rel=1e-6) and r["scale"] < 0.95
        for scheduled, inside, after in r["steps"]:
            assert inside == pytest.approx([lr * r["scale"] for lr in scheduled], rel=1e-12)
            assert after == scheduled  # restored before the scheduler runs
        assert r["steps"][0][0] != r["steps"][1][0]  # the scheduler moved the LR in between
        assert r["armed_after"] == [None] and "had no inference log-probs" in r["stopped"]


@pytest.mark.dist
def test_shadow_mode_computes_and_logs_the_reference_but_arms_nothing(tmp_path):
    results = run_ranks(
        rank_unpacked, dp=DP, cp=2, args=("shadow",), tmp_path=tmp_path, timeout=120
    )
    _check_reference(results)  # the same ESS, the same collectives as --use-ess-lr
    ref = _reference(_global_batch(), mode="product")
    for r in results:
        assert r["armed"] is None and r["same_output"]  # never an LR change
        assert "lr_scale" not in r["logged"]
        assert r["logged"]["ess_lr_shadow_scale"] == pytest.approx(ref["scale"], rel=1e-6)
        assert r["logged"]["rho_ess"] == pytest.approx(ref["rho"], rel=1e-6)


@pytest.mark.dist
@pytest.mark.parametrize("bad", ["short", "missing"])
def test_bad_unpacked_input_is_an_error_on_every_rank(bad, tmp_path):
    results = run_ranks(rank_unpacked, dp=DP, cp=2, args=(bad,), tmp_path=tmp_path, timeout=120)
    assert all("error" in r for r in results), results
    assert all(r["armed"] is None for r in results)  # nothing armed anywhere
    errors = [r["error"] for r in results]
    culprits = [e for e in errors if not e.startswith("InvalidInputsElsewhereError")]
    # the bad ranks say what is wrong (one for "short", both CP peers of DP rank 1 "missing")
    assert len(culprits) == {"short": 1, "missing": 2}[bad], errors
    assert all(e.startswith("EssPatchValueError: ess-patch (megatron_rl)") for e in culprits), (
        errors
    )
    text = " ".join(culprits)
    assert ("inference log-prob tensors" in text) or ("no inference log-probs" in text)


@pytest.mark.dist
def test_cp_peers_with_different_rows_are_an_error_on_every_rank(tmp_path):
    """Megatron-RL gives every CP peer the same whole rows; a tree that splits them otherwise
    gives the peers different results, and every rank stops instead of training with two
    scales."""
    results = run_ranks(rank_unpacked, dp=DP, cp=2, args=("split",), tmp_path=tmp_path, timeout=120)
    assert all(r["armed"] is None for r in results), results
    assert all("the CP ranks computed different ESS results" in r["error"] for r in results)


@pytest.mark.dist
def test_a_collection_the_stages_disagree_on_counts_nothing_towards_calibration(tmp_path):
    """Each rank calibrates before the CP / PP agreement check; when the check fails, the
    count it saved is undone on every rank (else a caller that survives the error would
    continue from a calibration counted on a result nobody trained with)."""
    results = run_ranks(
        rank_unpacked, dp=DP, cp=2, args=("split-calibrating",), tmp_path=tmp_path, timeout=120
    )
    assert all("the CP ranks computed different ESS results" in r["error"] for r in results)
    assert [r["calibration"] for r in results] == [(0.0, 0.0)] * len(results)


def rank_packed(bad: str = "", mode: str = "product") -> dict:
    import ess_patch
    from ess_patch.demo.cpu import megatron_on_cpu

    _set_host_args(mode, rl_use_sequence_packing=True)
    from megatron.core import parallel_state as mpu
    from megatron.rl import rl_utils
    from megatron.rl import sequence_packing_utils as spu
    from megatron.training import global_vars
    from megatron.training.utils import get_nvtx_range  # noqa: F401  (real, imported by spu)

    _install()

    global_vars._GLOBAL_TOKENIZER = SimpleNamespace(pad=0, eod=1)
    # Timers only time the nvtx ranges (and need CUDA to synchronize): a no-op stand-in.
    noop = SimpleNamespace(start=lambda *a, **k: None, stop=lambda *a, **k: None)
    global_vars._GLOBAL_TIMERS = lambda *_a, **_k: noop
    torch.cuda.nvtx.range_push = torch.cuda.nvtx.range_pop = lambda *_a, **_k: None  # no NVTX
    batch = _global_batch()
    mine = _my_trajectories(batch)
    trajs = torch.zeros(len(mine), S, dtype=torch.long)
    for i, t in enumerate(mine):
        trajs[i, : len(t["tokens"])] = t["tokens"]
    gen_masks = torch.stack([t["gen_mask"] for t in mine])
    # upstream pads the inference log-probs to seq_length before packing
    inf = torch.zeros(len(mine), S)
    for i, t in enumerate(mine):
        inf[i, : len(t["inf"])] = t["inf"]
    with megatron_on_cpu():
        ctx = spu.pack_all_trajectories(trajs, gen_masks, inf, torch.zeros(B), S, 4, "fifo")
        rl_utils.get_rl_runtime_state().packing_context = ctx
        info = ctx.packing_info
        # the packed train log-probs, placed where the model would put them
        old = torch.zeros(len(ctx.packed_trajs), S - 1)
        for b, seqs in enumerate(info.bin_seq_indices):
            for j, seq in enumerate(seqs):
                start, n = info.seq_starts[b][j], info.seq_lengths[seq]
                old[b, start : start + n - 1] = batch[seq]["old"][: n - 1]
        packed_inf = spu.pack_inference_logprobs(
            inference_logprobs=ctx.original_inference_logprobs,
            packing_info=info,
            generation_masks=ctx.original_generation_masks,
            bin_size=S,
        )
        filled = {}
        if isinstance(packed_inf, tuple):  # core_v0.19 on: (packed, filled_mask), passed on
            packed_inf, filled["filled_mask"] = packed_inf
        lay = layout()
        if bad == "width" and lay.dp_rank == 1 and lay.cp_rank == 0:
            # one column short: upstream's own stats skip such a batch without a word
            old = old[:, :-1]
        stats = SimpleNamespace()
        try:
            rl_utils.compute_packed_inference_logprobs_stats(
                old_logprobs=old,
                packed_inference_logprobs=packed_inf,
                packed_loss_mask=ctx.packed_loss_mask,
                group_stats=stats,
                **filled,
            )
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "armed": ess_patch.armed()}
    r = ess_patch.armed()
    return {
        "result": (r.scale, r.rho, r.status, r.num_trajectories),
        "bins": len(ctx.packed_trajs),
        "dp": mpu.get_data_parallel_rank(),
        "upstream_stat": stats.mean_piold_to_inf_prob,
    }


@pytest.mark.dist
@LAYOUTS
def test_packed_arms_the_reference_scale_on_every_rank(cp, pp, mode, tmp_path):
    results = run_ranks(
        rank_packed, dp=DP, cp=cp, pp=pp, args=("", mode), tmp_path=tmp_path, timeout=120
    )
    _check_reference(results, mode)
    assert all(r["upstream_stat"] is not None for r in results)


@pytest.mark.dist
def test_mismatched_packed_shapes_are_an_error_on_every_rank(tmp_path):
    results = run_ranks(rank_packed, dp=DP, cp=2, args=("width",), tmp_path=tmp_path, timeout=120)
    assert all("error" in r for r in results), results
    assert all(r["armed"] is None for r in results)  # nothing armed anywhere
    elsewhere = "InvalidInputsElsewhereError"
    bad = [r["error"] for r in results if not r["error"].startswith(elsewhere)]
    assert len(bad) == 1, results
    if "shape mismatch" not in bad[0]:  # main's own check raises first, naming the shapes
        assert ", 22), inference log-probs (" in bad[0] and ", 23) and loss mask" in bad[0]
    others = [r["error"] for r in results if r["error"].startswith(elsewhere)]
    # its DP and CP peers first, through them the last rank: each names the rank it heard from
    assert len(others) == 3, others
    assert all(e.startswith("InvalidInputsElsewhereError: ESS-LR failed on rank") for e in others)
    assert sum("failed on rank(s) 2 " in e for e in others) == 2, others


# --- single process: flags and metrics ---------------------------------------------------------


@pytest.fixture
def installed():
    import megatron.rl.rl_utils
    import megatron.training.arguments
    import megatron.training.initialize  # noqa: F401  (before install: its by-name copy)

    import ess_patch

    _install()
    try:
        yield ess_patch
    finally:
        ess_patch.uninstall()


def _parse(argv: list[str], provider=None, *, rl: bool = True):
    """Megatron's real ``parse_args``; ``rl``: as ``train_rl.py``'s recipes run it (they pass
    ``--perform-rl-step``)."""
    import megatron.rl.rl_utils  # noqa: F401  (as train_rl.py does before pretrain parses)
    from megatron.training import arguments

    old = sys.argv
    sys.argv = ["train_rl.py", *(["--perform-rl-step"] if rl else []), *argv]
    try:
        return arguments.parse_args(extra_args_provider=provider)
    finally:
        sys.argv = old


def test_flags_through_megatrons_parse_args_with_a_user_provider(installed):
    def user(parser):
        parser.add_argument("--my-flag", type=int, default=7)
        return parser

    args = _parse(
        ["--use-ess-lr", "--ess-lr-floor", "0.3", "--rl-inference-logprobs-is-correction"], user
    )
    assert args.use_ess_lr and args.ess_lr_floor == 0.3 and args.my_flag == 7
    from ess_patch import EssLrConfig
    from ess_patch.integrations.flags import config_from_args

    assert args.ess_lr_weight_mode is None  # not given: the installed config decides
    assert config_from_args(args) == EssLrConfig(floor=0.3)
    plain = _parse([])
    assert plain.use_ess_lr is False


def test_train_rl_entry_parses_through_the_hook(installed, monkeypatch):
    """Up to core_v0.17, ``initialize_megatron`` (what ``pretrain`` runs for ``train_rl.py``)
    calls the name it imported, positionally: ``parse_args(extra_args_provider,
    ignore_unknown_args)``. From core_v0.18 ``train_rl.py`` calls
    ``arguments.parse_and_validate_args(extra_args_provider=..., args_defaults={})``, which
    calls the module's ``parse_args`` (its validation and global setup, which need a full
    model config, are not what this test is about: replaced)."""
    import megatron.rl.rl_utils  # noqa: F401
    from megatron.training import arguments, initialize

    def user(parser):
        parser.add_argument("--my-flag", type=int, default=7)
        return parser

    argv = ["train_rl.py", "--perform-rl-step", "--use-ess-lr", "--rl-partial-rollouts"]
    monkeypatch.setattr(sys, "argv", [*argv, "--my-flag", "3"])
    if hasattr(initialize, "parse_args"):
        args = initialize.parse_args(user, False)
    else:
        seen = []
        monkeypatch.setattr(arguments, "validate_args", lambda a, d=None: seen.append(a))
        monkeypatch.setattr(arguments, "set_global_variables", lambda a, *_, **__: None)
        args = arguments.parse_and_validate_args(extra_args_provider=user, args_defaults={})
        assert seen == [args]
    assert args.use_ess_lr and args.my_flag == 3 and args.ess_lr_floor is None  # not given
    with pytest.raises(ValueError, match="--rl-inference-logprobs-is-correction"):
        monkeypatch.setattr(sys, "argv", argv[:3])
        if hasattr(initialize, "parse_args"):
            initialize.parse_args(user, False)
        else:
            arguments.parse_and_validate_args(extra_args_provider=user, args_defaults={})


def test_no_inference_logprobs_is_a_startup_error(installed):
    with pytest.raises(ValueError, match="--rl-inference-logprobs-is-correction"):
        _parse(["--use-ess-lr"])
    assert _parse(["--use-ess-lr", "--rl-partial-rollouts"]).use_ess_lr


def test_shadow_flag_is_parsed_and_checked_like_use_ess_lr(installed):
    args = _parse(["--ess-lr-shadow", "--rl-inference-logprobs-is-correction"])
    assert args.ess_lr_shadow is True and args.use_ess_lr is False
    with pytest.raises(ValueError, match=r"--ess-lr-shadow cannot measure.*inference-logprobs"):
        _parse(["--ess-lr-shadow"])
    with pytest.raises(ValueError, match="are both on"):
        _parse(["--use-ess-lr", "--ess-lr-shadow", "--rl-inference-logprobs-is-correction"])


def test_a_host_without_a_hooked_symbol_fails_at_startup(installed, monkeypatch):
    from megatron.rl import rl_utils

    monkeypatch.delattr(rl_utils, "get_rl_runtime_state")
    with pytest.raises(installed.MissingTargetError, match=r"get_rl_runtime_state.*Supported"):
        _parse(["--use-ess-lr", "--rl-inference-logprobs-is-correction"])


def test_bad_floor_is_rejected_by_the_parser(installed, capsys):
    with pytest.raises(SystemExit):
        _parse(["--use-ess-lr", "--rl-inference-logprobs-is-correction", "--ess-lr-floor", "2"])
    assert "must be in (0, 1]" in capsys.readouterr().err


def test_a_miles_or_slime_parse_on_a_tree_with_megatron_rl_is_theirs_to_validate(installed):
    """miles and slime call the same Megatron ``parse_args`` (``megatron.rl.rl_utils`` is
    imported: ``megatron.training.training`` imports it) with a provider that declares
    ``--use-ess-lr`` itself; without ``--perform-rl-step`` no Megatron-RL rule applies."""
    import megatron.rl.rl_utils  # noqa: F401

    def framework(parser):  # what miles' / slime's own parse composes in
        parser.add_argument("--use-ess-lr", action="store_true", default=False)
        parser.add_argument("--rollout-batch-size", type=int, default=4)
        return parser

    # Megatron-RL would refuse this (no inference log-probs kept): not applied here
    args = _parse(["--use-ess-lr", "--rollout-batch-size", "8"], framework, rl=False)
    assert args.use_ess_lr and args.rollout_batch_size == 8 and args.ess_lr_floor is None
    with pytest.raises(ValueError, match="--rl-inference-logprobs-is-correction"):
        _parse(["--use-ess-lr"], framework)  # the same parse with --perform-rl-step: ours


def test_use_ess_lr_on_a_plain_megatron_parse_is_refused(installed):
    """No ``--perform-rl-step`` and no framework that declared the flag: nothing would measure
    the ESS, so the run must not start believing it is on."""
    with pytest.raises(ValueError, match=r"not a Megatron-RL run \(no --perform-rl-step\)"):
        _parse(["--use-ess-lr", "--rl-inference-logprobs-is-correction"], rl=False)
    with pytest.raises(ValueError, match="--perform-rl-step"):
        _parse(["--ess-lr-shadow"], rl=False)
    plain = _parse([], rl=False)  # off: a plain pretraining parse is untouched
    assert plain.use_ess_lr is False and not plain.perform_rl_step


def _no_baseline_env(monkeypatch) -> None:
    for key in ("ESS_LR_BASELINE", "ESS_LR_BASELINE_SHADOW", "ESS_LR_BASELINE_PATH"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize(
    ("argv", "env", "setting"),
    [
        (["--use-ess-baseline"], {}, "--use-ess-baseline"),
        (["--ess-baseline-shadow"], {}, "--ess-baseline-shadow"),
        ([], {"ESS_LR_BASELINE": "1"}, "ESS_LR_BASELINE"),
        ([], {"ESS_LR_BASELINE_SHADOW": "yes"}, "ESS_LR_BASELINE_SHADOW"),
        (["--use-ess-lr", "--use-ess-baseline"], {}, "--use-ess-baseline"),
    ],
)
def test_the_baseline_is_parsed_or_refused_by_name(installed, monkeypatch, argv, env, setting):
    """Asked for by flag or variable, with or without ESS-LR: a tree with Megatron-RL's
    advantage routine parses it; the fork (advantages inline) stops at parse time, naming
    Megatron-RL, the setting, the tree and what is supported. A plain Megatron parse (no
    --perform-rl-step, no framework declaring it) is refused either way."""
    import megatron.rl.rl_utils as rl_utils

    from ess_patch.integrations.baseline_flags import baseline_mode

    # the tree actually imported decides (an earlier test module may have put another
    # Megatron-LM tree, e.g. the fork, first on the path: megatron is a namespace package)
    baseline_tree = hasattr(rl_utils, "calculate_grpo_advantages")
    _no_baseline_env(monkeypatch)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    full = [*argv, "--rl-inference-logprobs-is-correction", "--grpo-group-size", "4"]
    if baseline_tree and VENDORED:  # the series carries no baseline call site: install() does
        with pytest.raises(EssPatchValueError, match=r"calculate_grpo_advantages not patched"):
            _parse(full)
    elif baseline_tree:
        args = _parse(full)
        assert baseline_mode(args) == ("shadow" if "SHADOW" in setting.upper() else "on")
    else:
        with pytest.raises(EssPatchValueError) as info:
            _parse(full)
        message = str(info.value)
        assert "megatron_rl" in message and "Megatron-RL" in message
        assert setting in message and "calculate_grpo_advantages" in message
        assert "Supported: Megatron-LM core_v0.16.1 to core_v0.18.2" in message
    with pytest.raises(EssPatchValueError, match=r"not a Megatron-RL run"):
        _parse(argv, rl=False)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--context-parallel-size", "2"], "--context-parallel-size 2"),
        (["--grpo-group-size", "1"], "--grpo-group-size 1"),
        (["--ess-baseline-path", "exact", "--ess-baseline-shadow"], "both on"),
    ],
)
def test_the_baseline_refuses_what_it_cannot_serve_at_parse_time(
    installed, monkeypatch, argv, match
):
    _no_baseline_env(monkeypatch)
    base = ["--use-ess-baseline", "--rl-inference-logprobs-is-correction", "--grpo-group-size", "4"]
    with pytest.raises(EssPatchValueError, match=match) as info:
        _parse([*base, *argv])
    assert match == "both on" or "ess-patch (megatron_rl)" in str(info.value)


def test_the_baseline_off_parses_as_before(installed, monkeypatch):
    """Off (not given, ``--no-use-ess-baseline``, ``ESS_LR_BASELINE=0``) nothing is refused
    and ESS-LR parses as it did."""
    _no_baseline_env(monkeypatch)
    monkeypatch.setenv("ESS_LR_BASELINE", "0")
    args = _parse(["--use-ess-lr", "--rl-inference-logprobs-is-correction"])
    assert args.use_ess_lr and args.use_ess_baseline is None
    off = _parse(["--no-use-ess-baseline", "--rl-inference-logprobs-is-correction"])
    assert off.use_ess_baseline is False and off.use_ess_lr is False
    monkeypatch.setenv("ESS_LR_BASELINE", "maybe")  # malformed: refused by name, not ignored
    with pytest.raises(EssPatchValueError, match=r"ESS_LR_BASELINE='maybe'"):
        _parse([])


@pytest.mark.skipif(VENDORED, reason="a patched tree always has the flags (vendored mode)")
def test_installed_parse_without_the_baseline_equals_the_uninstalled_one(monkeypatch):
    """Installed, a Megatron-RL parse that does not ask for the baseline holds the same values
    as the unpatched parser's, plus ess-patch's own settings left unset."""
    import ess_patch

    _no_baseline_env(monkeypatch)
    argv = ["--rl-inference-logprobs-is-correction"]
    plain = _parse(argv)
    _install()
    try:
        patched = _parse(argv)
    finally:
        ess_patch.uninstall()
    ours = {k for k in vars(patched) if k == "use_ess_lr" or k.startswith("ess_lr_")}
    baseline = {"use_ess_baseline", "ess_baseline_shadow", "ess_baseline_path"}
    assert {k: getattr(patched, k) for k in baseline} == dict.fromkeys(baseline)
    after = {k: repr(v) for k, v in vars(patched).items() if k not in ours | baseline}
    assert after == {k: repr(v) for k, v in vars(plain).items()}


@pytest.mark.skipif(VENDORED, reason="a patched tree always has the flags (vendored mode)")
def test_uninstalled_parser_has_no_flags():
    from megatron.training import arguments

    assert not hasattr(arguments.parse_args, "__wrapped__") or "ess" not in repr(
        arguments.parse_args
    )
    with pytest.raises(SystemExit):
        _parse(["--use-ess-lr"])


def _group_stats(grouped: bool, per_token: bool = False) -> SimpleNamespace:
    """What ``maybe_log_training_metrics`` reads of a collection's ``RolloutStats``: flat up to
    core_v0.16, grouped per prompt (with turn and staleness fields) from core_v0.17, the
    staleness per token (``per_token``) from core_v0.18."""
    if grouped:
        epochs = [[[1, 2], [1, 2]]] if per_token else [[1, 2]]
        stats = dict(
            rewards=[[0.5, 0.5]],
            env_ids=["env"],
            turn_lens=[[12, 11]],
            traj_lens=[[12, 11]],
            num_turns=[[1, 1]],
            advantages=[0.3, -0.3],
            policy_epoch=epochs,
            kv_cache_epoch=epochs,
            completed_epochs=[[2, 2]],
            num_evictions=[[0, 0]],
        )
    else:
        stats = dict(
            reward_means=[0.5, 0.25],
            reward_stds=[0.1, 0.2],
            rewards=[0.5, 0.25],
            advantages=[0.3, -0.3],
            mean_length=12.0,
            mean_length_std=1.0,
            max_length=13,
            min_length=11,
            mean_reward=0.5,
            mean_sim=0.0,  # read by the miles-main fork (2e64d788b), not by core_v0.16.1
        )
    for kind in ("piold_to_inf_prob", "inf_train_prob_abs_diff", "inf_prob"):
        stats.update({f"{m}_{kind}": 1.0 for m in ("min", "max", "mean")})
    return SimpleNamespace(**stats)


def _log_training_metrics(rl_utils, step: int, wandb_run, writer) -> None:
    """The real ``maybe_log_training_metrics`` with these writers, as the release takes them:
    as arguments (up to core_v0.16), else as Megatron's global writers."""
    import inspect

    from megatron.training import global_vars

    if "wandb_writer" in inspect.signature(rl_utils.maybe_log_training_metrics).parameters:
        rl_utils.maybe_log_training_metrics(_group_stats(False), step, None, [], wandb_run, writer)
        return
    per_token = "per_token" in inspect.getsource(rl_utils.prep_wandb_metrics)
    global_vars._GLOBAL_WANDB_WRITER, global_vars._GLOBAL_TENSORBOARD_WRITER = wandb_run, writer
    try:
        stats = _group_stats(True, per_token)
        if hasattr(rl_utils, "EpochSegment"):  # main: run-length epoch segments, statuses
            segment = [rl_utils.EpochSegment(epoch=1, token_count=1)] * 2
            stats.policy_epoch_segments = stats.kv_cache_epoch_segments = [[segment, segment]]
            stats.rollout_statuses, stats.failure_reasons = [["ok", "ok"]], [[None, None]]
        rl_utils.maybe_log_training_metrics(stats, step, None, {"env": []})
    finally:
        global_vars._GLOBAL_WANDB_WRITER = global_vars._GLOBAL_TENSORBOARD_WRITER = None


class _WandbRun:
    """wandb as Megatron hands it to the function (the module after ``wandb.init``): its real
    ``Table`` and ``plot``, and a ``log`` that keeps what it gets (no wandb service)."""

    def __init__(self):
        import wandb

        self.Table, self.plot = wandb.Table, wandb.plot
        self.logged: list[tuple[dict, int]] = []

    def log(self, metrics, step=None):
        self.logged.append((metrics, step))


def _tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """What a tensorboard reader sees in ``log_dir``: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def rank_writers() -> dict:
    """The writer test's body, in a fresh process: the pytest process may already hold another
    Megatron-LM's ``megatron.rl`` (the miles tests import theirs)."""
    import tempfile

    # this process may have inherited another Megatron-LM snapshot ahead on sys.path (the
    # launcher's forkserver starts with the path of the session): ours first
    sys.path[:] = [SRC, *(p for p in sys.path if p != SRC)]
    import megatron.training.arguments
    import megatron.training.initialize  # noqa: F401  (before install: its by-name copy)
    from megatron.rl import rl_utils
    from torch.utils.tensorboard import SummaryWriter

    import ess_patch
    from ess_patch.result import EssLrResult

    _install()
    log_dir = Path(tempfile.mkdtemp()) / "tb"
    writer, wandb_run = SummaryWriter(log_dir=str(log_dir)), _WandbRun()
    _log_training_metrics(rl_utils, 3, wandb_run, writer)
    result = EssLrResult(
        scale=0.5, rho=0.25, ess=2.0, num_trajectories=8, num_empty=0, num_nonfinite=0, status="ok"
    )
    ess_patch.arm(result)
    try:
        _log_training_metrics(rl_utils, 4, wandb_run, writer)
    finally:
        ess_patch.disarm()
        ess_patch.uninstall()
    writer.close()
    numbers = [
        ({k: v for k, v in m.items() if isinstance(v, (int, float))}, step)
        for m, step in wandb_run.logged
    ]
    return {
        "rl_utils": rl_utils.__file__,
        "scalars": _tensorboard_scalars(log_dir),
        "logged": numbers,
        "metrics": result.metrics(),
    }


def test_metrics_reach_megatron_rls_writers(tmp_path):
    """The real ``maybe_log_training_metrics`` with a real tensorboard ``SummaryWriter`` and
    wandb's own tables: the ESS metrics land beside Megatron-RL's, at the same step, under
    its flat naming (``mean_reward``, ``rho_ess``...). Megatron-RL logs a collection before
    training on it: no step has applied its scale yet, so it is ``ess_lr_armed_scale`` and
    there is no ``lr_scale`` (which only a step's read-back gives)."""
    (r,) = run_ranks(rank_writers, dp=1, tmp_path=tmp_path, timeout=120)
    assert r["rl_utils"].startswith(str(Path(SRC).resolve())) or r["rl_utils"].startswith(SRC)
    scalars = r["scalars"]
    assert scalars["mean_reward"] == [(3, 0.5), (4, 0.5)]  # upstream's own, untouched
    assert scalars["ess_lr_armed_scale"] == [(4, 0.5)]  # nothing armed at step 3
    assert "lr_scale" not in scalars
    assert scalars["rho_ess"] == [(4, 0.25)] and scalars["ess"] == [(4, 2.0)]
    assert scalars["ess_num_trajectories"] == [(4, 8.0)]
    logged = r["logged"]
    steps = [step for _, step in logged]
    assert steps == [3, 4, 4]  # upstream's record, then upstream's and ours at step 4
    ours = logged[2][0]
    expected = {k: v for k, v in r["metrics"].items() if k != "lr_scale"}
    assert ours == {**expected, "ess_lr_armed_scale": 0.5} and ours["rho_ess"] == 0.25
    assert "mean_reward" in logged[1][0] and "ess_lr_armed_scale" not in logged[0][0]


def test_a_new_collection_drops_the_last_ones_scale(installed, caplog, monkeypatch):
    """``prepare_data_for_update`` starts a collection: the previous one's scale is never
    carried over, and a collection that arms none (an inference backend that returns no
    log-probs) stops the run before its first step, unless opted out (then said once)."""
    from ess_patch.integrations import megatron_rl
    from ess_patch.result import EssLrResult

    _set_host_args()
    installed.arm(EssLrResult.from_scale(0.3))
    # the real prepare_data_for_update needs a model and rollouts: the hook's own wrapper
    # around a collection that arms nothing (no inference log-probs)
    seen = []
    with pytest.raises(installed.EssLrNotAppliedError, match="had no inference log-probs"):
        megatron_rl.prepare_wrapper(lambda: seen.append(installed.armed()), None, (), {})
    assert seen == [None]  # the old scale was dropped before the collection ran
    assert installed.armed() is None
    monkeypatch.setenv("ESS_PATCH_ALLOW_UNSCALED", "1")
    with caplog.at_level("WARNING", logger="ess_patch"):
        megatron_rl.prepare_wrapper(lambda: None, None, (), {})
    assert "(opt-out): going on unscaled" in caplog.text
    assert "had no inference log-probs" in caplog.text


def test_disabled_the_real_align_arms_nothing_and_changes_nothing(installed):
    from megatron.rl import rl_utils

    from ess_patch.demo.cpu import megatron_on_cpu

    _set_host_args(use_ess_lr=False)
    batch = _global_batch()
    old = torch.stack([t["old"] for t in batch])
    gen_masks = torch.stack([t["gen_mask"] for t in batch])
    inference = [t["inf"] for t in batch]
    with megatron_on_cpu():
        padded = rl_utils.align_unpacked_inference_logprobs(
            inference, old, gen_masks, SimpleNamespace()
        )
        plain = rl_utils.align_unpacked_inference_logprobs.__wrapped__(
            inference, old, gen_masks, SimpleNamespace()
        )
    assert installed.armed() is None
    assert torch.equal(padded, plain)


def test_doctor_knows_megatron_rl(installed, monkeypatch):
    """doctor lists the targets and the shape this tree has (which writers the metrics go to),
    and names a missing hooked function with the supported range."""
    import inspect

    from megatron.rl import rl_utils

    from ess_patch.doctor import collect
    from ess_patch.install import INTEGRATIONS

    report = collect()
    versions = report.sections["versions"]
    assert any(line.startswith("megatron.rl") and "importable from" in line for line in versions)
    [section] = [k for k in report.sections if k.startswith("targets: megatron_rl (")]
    lines = report.sections[section]
    state = "vendored diff applied" if VENDORED else "wrapped by install() in this process"
    for target in INTEGRATIONS["megatron_rl"].targets:
        if not target.required and any(line.startswith(f"-- {target.path}:") for line in lines):
            continue  # an optional site this release lacks (initialize.parse_args from 0.18)
        if VENDORED and not target.vendored:
            continue  # install()-only (VCPO's baseline): not installed in vendored mode
        assert any(line.startswith(f"ok {target.path}: {state}") for line in lines), target.path
    shape = next(line for line in lines if line.startswith("shape: megatron_rl: "))
    writers = "maybe_log_training_metrics(wandb_writer" in shape
    params = inspect.signature(rl_utils.maybe_log_training_metrics).parameters
    assert writers == ("wandb_writer" in params)  # else Megatron's global writers
    assert not [p for p in report.problems if "megatron.rl" in p or "megatron.training" in p]
    # a host without a hooked function is a problem naming it and the supported range
    monkeypatch.delattr(rl_utils, "maybe_log_training_metrics")
    problems = collect().problems
    assert "megatron.rl.rl_utils.maybe_log_training_metrics is missing; supported: " in (
        " ".join(problems)
    )
    assert "core_v0.16" in " ".join(problems)


def test_megatron_core_is_the_trees_own():
    """The tree runs beside the megatron-core of its own release (its megatron/rl imports what
    older cores lack; test_megatron_lm_snapshots.py puts that one first on PYTHONPATH)."""
    from megatron.core import package_info
    from megatron_versions import ENV_VERSION, core_version_for, installed_core
    from packaging.version import Version

    expected = os.environ.get(ENV_VERSION)
    if expected is None:
        try:
            expected = core_version_for(Path(SRC))
        except ValueError:  # a copy under another name (vendored mode): the environment's own
            expected = installed_core()
    # a release's package_info appends the git commit of the folder it sits in ("+<sha>")
    assert Version(package_info.__version__).public == expected


def test_scored_positions_by_hand():
    """Which log-prob positions count, hand-computed: the i-th inference log-prob scores the
    i-th generated token (log-prob one position earlier), across main's multi-region rows; a
    padded packed row loses only a final eod that reads as padding."""
    from ess_patch.integrations.megatron_rl import _padded_count, _scored

    #            positions: 0  1  2  3  4  5  6  7
    gen = torch.tensor([0, 1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)  # two turns, eod at 7
    assert _scored(gen, 4, 0, 7).tolist() == [0, 1, 4, 5]  # the eod (7 -> 6) unscored
    assert _scored(gen, 5, 0, 7).tolist() == [0, 1, 4, 5, 6]
    assert _scored(gen, 4, 10, 17).tolist() == [10, 11, 14, 15]  # in a packed bin at 10
    assert _scored(gen, 0, 0, 7).tolist() == []
    tokens = torch.tensor([3, 7, 8, 4, 4, 9, 9, EOD])
    padded = torch.tensor([-0.5, -0.25, -1.0, -2.0, 0.0, 0.0, 0.0, 0.0])
    assert _padded_count(gen, tokens, padded, EOD) == 4  # the final eod reads as padding
    reported = padded.clone()
    reported[4] = -0.125  # the engine scored the eod: it counts
    assert _padded_count(gen, tokens, reported, EOD) == 5
    assert _padded_count(gen, torch.tensor([3, 7, 8, 4, 4, 9, 9, 9]), padded, EOD) == 5
    assert _padded_count(gen, tokens, torch.zeros(8), EOD) == 0  # an all-pad row
    assert _padded_count(torch.zeros(8, dtype=torch.bool), tokens, padded, EOD) == 0
