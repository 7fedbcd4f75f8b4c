"""Benchmark 3: ``optimizer.step()`` of a real Megatron optimizer, unpatched vs ess-patch
installed with nothing armed ("disabled") vs armed with scale 0.5 ("enabled").

One process, gloo world of 1, megatron-core optimizers on CPU through ``tests/megatron_cpu``'s
shim. Models: the test suite's tiny MLP and a wider MLP (several million parameters), both
wrapped in Megatron's DDP and given to ``get_megatron_optimizer`` exactly as the test helper
does. The variants run on the same optimizer, interleaved block by block (the order
rotates every round) so that drift hits them alike. Every block starts from the same state
change (uninstall, then install / arm for the patched variants), runs a few untimed steps
(the first calls after patching or unpatching a class run cold), then times its steps.
Gradients stay in the DDP buffers, so each timed call is a full step (grad copy, grad norm +
clip, Adam update, param copy-back).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import tempfile
import time
import timeit

import torch

import ess_patch
from ess_patch.demo.cpu import megatron_on_cpu

from .common import OpCounter, fmt_ms, min_med, table, use_test_helpers, verdict

use_test_helpers()

from megatron_cpu import D_IN, batch, forward_backward, megatron_world  # noqa: E402

# "control" is unpatched again: its ratio to "unpatched" is the noise floor of the method.
VARIANTS = ("unpatched", "control", "disabled", "enabled")


class WideNet(torch.nn.Module):
    """``D_IN -> hidden -> hidden -> 1`` MLP: ~hidden**2 parameters."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(D_IN, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.fc3 = torch.nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def build(kind: str, hidden: int, device: str | torch.device = "cpu"):
    """Megatron DDP + ``get_megatron_optimizer`` (Adam, clip_grad 1.0), as
    ``megatron_cpu.build_megatron_optimizer`` builds them, for a ``WideNet(hidden)``.

    ``kind``: ``fp32`` (Chained[FP32Optimizer]) or ``dist_bf16`` (Chained[DistributedOptimizer],
    bf16 params, fp32 main params). ``device``: where the model is built (``cuda`` on a GPU,
    without the CPU shim; benchmarks/gpu.py).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, ParamKey, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig
    from megatron_cpu import MegatronSetup

    bf16 = kind == "dist_bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    lr = 1e-3
    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=lr / 10,
        clip_grad=1.0,
        bf16=bf16,
        params_dtype=dtype,
        use_distributed_optimizer=bf16,
        loss_scale=1.0 if bf16 else None,
    )
    tconfig = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=1, bf16=bf16, params_dtype=dtype
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=bf16, overlap_grad_reduce=False
    )
    torch.manual_seed(0)
    model = DistributedDataParallel(
        tconfig, ddp_config, WideNet(hidden).to(device=device, dtype=dtype)
    )
    overrides = {ParamKey(name="*.bias"): {"max_lr": lr / 2, "min_lr": lr / 20, "wd_mult": 0.0}}
    opt = get_megatron_optimizer(
        config, [model], config_overrides=overrides, use_gloo_process_groups=False
    )
    sched = OptimizerParamScheduler(
        opt,
        init_lr=lr / 10,
        max_lr=lr,
        min_lr=lr / 10,
        lr_warmup_steps=2,
        lr_decay_steps=1000,
        lr_decay_style="cosine",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=1000,
        wd_incr_style="constant",
    )
    return MegatronSetup([model], opt, sched, config)


def set_variant(variant: str) -> None:
    """Put ess-patch in the state of ``variant`` (one of ``VARIANTS``)."""
    if variant in ("unpatched", "control"):
        if ess_patch.is_installed():
            ess_patch.uninstall()
        return
    if not ess_patch.is_installed():
        ess_patch.install("megatron")
    if variant == "enabled":
        ess_patch.arm(0.5)
    else:
        ess_patch.disarm()


def measure(kind: str, hidden: int, repeats: int, steps: int) -> dict:
    setup = build(kind, hidden)
    params = sum(p.numel() for p in setup.models[0].parameters())
    x, y = batch(0, 0, size=64)
    forward_backward(setup, x, y)
    for _ in range(3):  # warm-up: optimizer state, first-step paths
        setup.optimizer.step()
    ops = {}
    for variant in VARIANTS:
        set_variant(variant)
        with OpCounter() as counter:
            setup.optimizer.step()
        ops[variant] = counter.total
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    warm = max(2, steps // 5)
    gc.collect()
    gc.disable()
    try:
        for rnd in range(repeats):
            k = rnd % len(VARIANTS)
            for variant in VARIANTS[k:] + VARIANTS[:k]:
                # every block starts from the same state change (uninstall, then install if
                # patched), so no variant alone pays for following one
                set_variant("unpatched")
                set_variant(variant)
                for _ in range(warm):  # untimed: the first calls after (un)installing
                    setup.optimizer.step()
                start = time.perf_counter()
                for _ in range(steps):
                    setup.optimizer.step()
                times[variant].append((time.perf_counter() - start) / steps)
    finally:
        gc.enable()
        set_variant("unpatched")
    cost = wrapper_cost_us(setup.optimizer)
    return {"params": params, "ops": ops, "times": times, "cost": cost}


def wrapper_cost_us(optimizer, number: int = 20000) -> dict[str, float]:
    """The wrapper's own cost per ``step()`` (us), around a no-op instead of the real step:
    the outer wrapped call plus one pass-through per child's wrapped ``step_with_ready_grads``.
    Deterministic where the end-to-end ratios are at the mercy of the machine's noise."""
    from ess_patch.lr import step_wrapper
    from ess_patch.state import STATE

    children = list(getattr(optimizer, "chained_optimizers", []))

    def noop():
        return None

    def nested():
        STATE.local.in_step = True
        try:
            for child in children:
                step_wrapper(noop, child, (), {})
        finally:
            STATE.local.in_step = False

    def bare():
        STATE.local.in_step = True
        STATE.local.in_step = False

    out = {}
    for variant in ("disabled", "enabled"):
        set_variant(variant)
        outer = timeit.timeit(lambda: step_wrapper(noop, optimizer, (), {}), number=number)
        inner = timeit.timeit(nested, number=number) - timeit.timeit(bare, number=number)
        out[variant] = (outer + max(inner, 0.0)) / number * 1e6
    set_variant("unpatched")
    return out


def _paired(times: dict[str, list[float]], variant: str) -> float:
    """Median over rounds of (variant time / unpatched time in the same round)."""
    return statistics.median(v / u for v, u in zip(times[variant], times["unpatched"], strict=True))


def run(repeats: dict[str, tuple[int, int]]) -> tuple[str, dict[str, bool]]:
    """``repeats``: per model label (tiny, wide), (rounds, timed steps per variant and round)."""
    cases = [("fp32", 8, "tiny"), ("fp32", 2048, "wide"), ("dist_bf16", 2048, "wide")]
    rows, ok_ops = [], True
    ok = {"disabled e2e": True, "enabled e2e": True, "disabled own": True, "enabled own": True}
    limit = {"disabled": 1.01, "enabled": 1.02}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="ess-bench-"))
        stack.enter_context(megatron_on_cpu())
        stack.enter_context(megatron_world(tmp))
        for kind, hidden, label in cases:
            rounds, steps = repeats[label]
            r = measure(kind, hidden, rounds, steps)
            u_min, u_med = min_med(r["times"]["unpatched"])
            size = f"{r['params'] / 1e6:.2f}M" if r["params"] >= 10**5 else str(r["params"])
            row = [
                f"{label} ({kind}, {size} params)",
                f"{rounds}x{steps}",
                f"{fmt_ms(u_min)} / {fmt_ms(u_med)}",
            ]
            for variant in ("control", "disabled", "enabled"):
                v_min, v_med = min_med(r["times"][variant])
                paired = _paired(r["times"], variant)
                row.append(f"{v_min / u_min:.3f} / {v_med / u_med:.3f} / {paired:.3f}")
                if variant in limit:
                    ok[f"{variant} e2e"] &= paired <= limit[variant]
            for variant in ("disabled", "enabled"):
                own = r["cost"][variant]
                share = own * 1e-6 / u_med
                ok[f"{variant} own"] &= 1 + share <= limit[variant]
                row.append(f"{own:.2f} ({share:.2%})")
            ok_ops &= len({r["ops"][v] for v in VARIANTS}) == 1
            row.append("/".join(str(r["ops"][v]) for v in VARIANTS[1:]))
            rows.append(row)
    text = table(
        [
            "model",
            "rounds x steps",
            "unpatched ms (min / med)",
            "control / unpatched",
            "disabled / unpatched",
            "enabled / unpatched",
            "wrapper us/step disabled",
            "wrapper us/step enabled",
            "aten ops (unp/dis/en)",
        ],
        rows,
        title="## 3. Megatron optimizer.step(): unpatched vs installed-disabled vs enabled (0.5)",
    )
    text += (
        "\n\nratios: min / median / paired (median over rounds of the per-round ratio of the "
        "block means); control = unpatched again, i.e. the noise floor of the comparison. "
        "wrapper us/step: the wrapper's own cost around a no-op step (and its share of the "
        "unpatched median step)\n"
        "- disabled within 1% of unpatched: end-to-end (paired) "
        f"{verdict(ok['disabled e2e'])}; wrapper's own cost {verdict(ok['disabled own'])}\n"
        "- enabled within 2% of unpatched: end-to-end (paired) "
        f"{verdict(ok['enabled e2e'])}; wrapper's own cost {verdict(ok['enabled own'])}\n"
        "- the wrapper dispatches no tensor op (same aten op count in every variant, so it "
        f"cannot add a host-device sync): {verdict(ok_ops)}"
    )
    return text, {
        "step disabled <= 1% (end-to-end)": ok["disabled e2e"],
        "step disabled <= 1% (wrapper cost)": ok["disabled own"],
        "step enabled <= 2% (end-to-end)": ok["enabled e2e"],
        "step enabled <= 2% (wrapper cost)": ok["enabled own"],
        "step adds no tensor op": ok_ops,
    }
