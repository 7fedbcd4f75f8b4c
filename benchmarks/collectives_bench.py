"""Benchmark 2: collectives per rollout for every (dp, cp, pp) layout, over real gloo ranks.

Each layout runs in fresh processes (the tests' launcher, ``tests/gloo_ranks.py``: real Megatron
``parallel_state``).
Every rank holds its DP shard of a 256-trajectory batch, CP-sliced as miles slices it; the
last pipeline stage computes ``compute_ess_lr`` and ``broadcast_from_last_stage`` gives the
result to every stage. The minimum: CP two (an all-gather of the envelopes -- failed flag,
trajectory count, settings -- before the all-reduce of the per-trajectory table, so that a
count disagreement is an error, not a gloo abort), DP one (all-gather of the 10-float summary
with its envelope), PP one (all-gather of the result with every stage's envelope); a rank off
the last stage joins only the PP exchange.

Disabled: a real Megatron optimizer step (dp=2) issues the same collectives unpatched,
installed with nothing armed, and armed (the wrapper adds none: it only writes LRs).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from .common import table, use_test_helpers, verdict

use_test_helpers()

from dist_helpers import cp_local, dp_shard, make_batch  # noqa: E402
from gloo_ranks import launch_ranks, layout  # noqa: E402

import ess_patch  # noqa: E402

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)]
NUM = 256

_NAMES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "reduce",
    "barrier",
    "all_gather_object",
    "broadcast_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "_all_gather_base",
    "_reduce_scatter_base",
)


def _nbytes(name, args, kwargs) -> int:
    """Payload this rank contributes: the input tensor (all_gather: the second argument)."""
    arg = (
        args[1]
        if name in ("all_gather", "all_gather_into_tensor", "_all_gather_base") and len(args) > 1
        else None
    )
    if arg is None:
        arg = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(arg, torch.Tensor):
        return arg.numel() * arg.element_size()
    if isinstance(arg, (list, tuple)):
        return sum(t.numel() * t.element_size() for t in arg if isinstance(t, torch.Tensor))
    return 0


class Collectives:
    """Records ``(name, bytes)`` of every torch.distributed collective issued in the block.

    Patches the ``torch.distributed`` attributes (what ess_patch calls) and any alias of
    them that an imported ``megatron`` module bound at import time (e.g.
    ``param_and_grad_buffer.dist_all_gather_func``), so Megatron's own are counted too.
    """

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self):
        originals = {}
        for name in _NAMES:
            original = getattr(dist, name, None)
            if original is not None:
                originals[id(original)] = name
        holders = [dist] + [
            mod
            for key, mod in list(sys.modules.items())
            if key.startswith("megatron.core") and mod is not None
        ]
        for holder in holders:
            for attr, value in list(vars(holder).items()):
                name = originals.get(id(value))
                if name is None or not callable(value):
                    continue

                def counted(*args, _name=name, _orig=value, **kwargs):
                    self.calls.append((_name, _nbytes(_name, args, kwargs)))
                    return _orig(*args, **kwargs)

                self._saved.append((holder, attr, value))
                setattr(holder, attr, counted)
        return self

    def __exit__(self, *exc):
        for holder, attr, original in reversed(self._saved):
            setattr(holder, attr, original)


def rank_rollout(seed: int) -> dict:
    """One rollout's ESS on this rank: the collectives it issued, and the result."""
    lay = layout()
    samples = dp_shard(make_batch(seed, NUM), lay.dp_rank, lay.dp_size)
    lp, rlp, masks = cp_local(samples, lay.cp_rank, lay.cp_size)
    with Collectives() as rec:
        result = None
        if lay.is_pp_last:
            result = ess_patch.compute_ess_lr(
                lp, rlp, masks, cp_group=lay.cp_group, dp_group=lay.dp_group
            )
        result = ess_patch.broadcast_from_last_stage(result, lay.pp_group)
    return {"last": lay.is_pp_last, "calls": rec.calls, "rho": result.rho}


def rank_step_collectives() -> dict:
    """Collectives of one real Megatron ``optimizer.step()``: unpatched / disabled / armed."""
    from megatron_cpu import batch, build_megatron_optimizer, forward_backward

    from ess_patch.demo.cpu import megatron_on_cpu

    lay = layout()
    out = {}
    with megatron_on_cpu():
        setup = build_megatron_optimizer("dist_fp32", optimizer="adam", clip_grad=1.0)
        x, y = batch(lay.dp_rank, 0)
        for variant in ("unpatched", "disabled", "armed"):
            if variant != "unpatched":
                ess_patch.install("megatron")
            if variant == "armed":
                ess_patch.arm(0.5)
            forward_backward(setup, x, y)
            with Collectives() as rec:
                setup.optimizer.step()
            out[variant] = rec.calls
            if ess_patch.is_installed():
                ess_patch.uninstall()
    return out


def run(layouts=LAYOUTS) -> tuple[str, dict[str, bool]]:
    rows, ok_min = [], True
    for dp, cp, pp in layouts:
        results = launch_ranks(rank_rollout, dp=dp, cp=cp, pp=pp, args=(7,), timeout=120)
        # CP: the envelope all-gather (counts, flags, settings) must precede the payload, so
        # that gloo never sees mismatched sizes; DP and PP carry their envelope in their row.
        minimum = (dp > 1) + 2 * (cp > 1) + (pp > 1)
        last = [r for r in results if r["last"]]
        other = [r for r in results if not r["last"]]
        counts_last = {len(r["calls"]) for r in last}
        counts_other = {len(r["calls"]) for r in other}
        names = sorted({name for r in last for name, _ in r["calls"]})
        bytes_last = max(sum(b for _, b in r["calls"]) for r in last)
        bytes_other = max((sum(b for _, b in r["calls"]) for r in other), default=0)
        rhos = {r["rho"] for r in results}
        ok = counts_last == {minimum} and counts_other <= {1} and len(rhos) == 1
        ok_min &= ok
        rows.append(
            [
                f"({dp},{cp},{pp})",
                len(results),
                "/".join(map(str, sorted(counts_last))),
                "/".join(map(str, sorted(counts_other))) or "-",
                minimum,
                ", ".join(names) or "none",
                bytes_last,
                bytes_other if other else "-",
                "yes" if len(rhos) == 1 else "NO",
                verdict(ok),
            ]
        )
    text = table(
        [
            "(dp,cp,pp)",
            "ranks",
            "colls last stage",
            "colls other stages",
            "minimum",
            "which (last stage)",
            "bytes/rank last",
            "bytes/rank other",
            "ranks agree",
            "target",
        ],
        rows,
        title=(
            f"## 2. Collectives per rollout (B = {NUM} trajectories, 1-29 response tokens "
            "each, gloo)"
        ),
    )
    step = launch_ranks(rank_step_collectives, dp=2, timeout=180)
    step_rows, ok_zero = [], True
    base = [sorted(n for n, _ in r["unpatched"]) for r in step]
    for variant in ("unpatched", "disabled", "armed"):
        per_rank = [sorted(n for n, _ in r[variant]) for r in step]
        extra = max(len(p) - len(b) for p, b in zip(per_rank, base))
        same = per_rank == base
        if variant != "unpatched":
            ok_zero &= same
        step_rows.append(
            [variant, len(per_rank[0]), ", ".join(sorted(set(per_rank[0]))), extra, same]
        )
    text += "\n\n" + table(
        ["optimizer.step() (dp=2, DistributedOptimizer)", "collectives", "which", "extra", "same"],
        step_rows,
    )
    text += (
        f"\n\n- exactly the minimum in every layout: {verdict(ok_min)}\n"
        f"- zero extra collectives in the step, disabled or armed: {verdict(ok_zero)}"
    )
    return text, {"collectives minimum": ok_min, "collectives zero when disabled": ok_zero}
