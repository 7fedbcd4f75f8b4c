"""Independent single-process reference: the DESIGN.md formula, written the obvious way.

Plain Python floats (float64) and a per-trajectory loop, no log-space tricks, so it is a
check on the vectorised, shifted implementation. It overflows where exp(m) overflows:
callers use it only where that cannot happen, or pass ``shift=True``.
"""

from __future__ import annotations

import math


def reference_ess(
    log_probs,
    rollout_log_probs,
    loss_masks,
    *,
    mode="geometric",
    rule="sqrt",
    floor=0.1,
    base_ratio=1.0,
    shift=False,
    weight_clip=None,
):
    ms = []
    for lp, rlp, mask in zip(log_probs, rollout_log_probs, loss_masks, strict=True):
        d = [
            float(a) - float(b)
            for a, b, k in zip(lp.tolist(), rlp.tolist(), mask.tolist(), strict=True)
            if k != 0
        ]
        if not d:
            continue
        total = math.fsum(d)
        ms.append(total / len(d) if mode == "geometric" else total)
    if not ms:
        return {"scale": 1.0, "rho": 1.0, "num_trajectories": 0}
    c = max(ms) if shift else 0.0
    w = [math.exp(m - c) for m in ms]
    if weight_clip is not None:  # min(w_i, clip) on the true weights: shifted alike
        w = [min(x, weight_clip * math.exp(-c)) for x in w]
    ess = math.fsum(w) ** 2 / math.fsum(x * x for x in w)
    rho = ess / len(ms)
    r = rho / base_ratio
    r = math.sqrt(r) if rule == "sqrt" else r
    return {"scale": min(1.0, max(floor, r)), "rho": rho, "ess": ess, "num_trajectories": len(ms)}


def reference_steps(log_probs, rollout_log_probs, loss_masks, steps, **kwargs):
    """Granularity "step": :func:`reference_ess` over each step's trajectories on its own.

    ``steps[s]`` lists indices into the (global) lists; one result per step.
    """
    return [
        reference_ess(
            [log_probs[i] for i in indices],
            [rollout_log_probs[i] for i in indices],
            [loss_masks[i] for i in indices],
            **kwargs,
        )
        for indices in steps
    ]
