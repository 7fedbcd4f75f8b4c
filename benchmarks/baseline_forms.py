"""Issue 42: VCPO's baseline in its four forms, side by side in one run, per step and per RL step.

    python -m benchmarks.baseline_forms [--quick] [--repeat 5]

Model: megatron-core ``GPTModel``, local spec (RMSNorm, no bias, SwiGLU, GQA, rope), the
models these frameworks build, at two sizes; one process, CPU, one torch thread. Every form
is a whole training step over the same ``n`` trajectories (forward, backward, Adam), so
``form / step - 1`` is what the baseline adds:

* **step**: the step without a baseline, with a PPO-clipped loss (eps 0.2), as miles and slime
  default to;
* **in-step**: the one-pass rewrite (``PerTrajectoryGrads``: linear weights frozen, the
  per-trajectory parts from the hooks, norms, ``b*``, ``apply(R - b*)``); exact only for a loss
  linear in each trajectory's coefficient, so its step is the linear (TIS) loss;
* **norm pass, rules / exact**: ``ess_patch.norm_pass`` before the unchanged PPO step;
* **proxy**: one forward without grad and ``proxy_sq_norms`` before the unchanged step (what
  ``--ess-baseline-path proxy`` runs); "proxy on the step's logits" is the proxy's own math
  alone, what it costs where the loss's logits can be reused (verl's way);
* **VCPO's way**: micro-batch 1 (one forward and backward per trajectory), its norm, two
  model-sized buffers (``sum R_i g_i``, ``sum g_i``) folded with ``-b*``, then Adam.

Times are the thread's CPU time (robust to other jobs on a shared machine), median of
``--repeat`` interleaved rounds. Memory: the tensors each form holds beyond the step, measured
on them (the rules' captures, ``NormPassResult.held_bytes``; the exact path's one set of
gradients; the proxy's logits; VCPO's two buffers). Per RL step: an RL step is
generation plus the training step, so a form's share of it is ``overhead * (1 - g)`` at a
generation share ``g`` (the demo's own, measured from its records, and a typical 70%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

MODELS = {
    "small (h64, L2, V16, 32 x T32)": dict(hidden=64, layers=2, vocab=16, n=32, seq=32),
    "wider (h256, L4, V512, 16 x T64)": dict(hidden=256, layers=4, vocab=512, n=16, seq=64),
}
GROUP = 4
FORMS = ("step", "in-step", "rules", "exact", "proxy", "proxy-math", "vcpo")
LABELS = {
    "step": "step (PPO-clipped, no baseline)",
    "in-step": "in-step rewrite (linear loss)",
    "rules": "norm pass, rules",
    "exact": "norm pass, exact",
    "proxy": "proxy (own forward)",
    "proxy-math": "proxy on the step's logits",
    "vcpo": "VCPO's way (mb 1, 2 buffers)",
}


class _Bench:
    """One model, optimizer and fixed batch; each form as a callable."""

    def __init__(self, hidden: int, layers: int, vocab: int, n: int, seq: int) -> None:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig

        config = TransformerConfig(
            num_layers=layers,
            hidden_size=hidden,
            num_attention_heads=8,
            num_query_groups=2,
            ffn_hidden_size=4 * hidden,
            normalization="RMSNorm",
            add_bias_linear=False,
            gated_linear_unit=True,
            activation_func=F.silu,
            use_cpu_initialization=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        torch.manual_seed(0)
        self.model = GPTModel(
            config,
            get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=vocab,
            max_sequence_length=seq,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
        )
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.0)  # lr 0: same weights
        gen = torch.Generator().manual_seed(0)
        self.n = n
        self.ids = torch.randint(0, vocab, (n, seq), generator=gen)
        self.pos = torch.arange(seq)[None].expand(n, -1)
        self.old = -torch.rand(n, seq - 1, generator=gen) * 2
        self.rewards = torch.rand(n, generator=gen).double()
        self.groups = torch.arange(n) // GROUP
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    def logits(self, rows: slice = slice(None)) -> torch.Tensor:
        return self.model(self.ids[rows], self.pos[rows], None)[:, :-1].float()

    def logp(self, rows: slice = slice(None)) -> torch.Tensor:
        lp = torch.log_softmax(self.logits(rows), -1)
        return lp.gather(2, self.ids[rows, 1:, None]).squeeze(-1)

    def weights(self, lp: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        return torch.exp(lp.detach() - self.old[rows]).clamp(max=2.0)

    def b_star(self, sq: torch.Tensor) -> torch.Tensor:
        from ess_patch.baseline import min_variance_baseline

        return min_variance_baseline(None, self.rewards, sq, self.groups).advantages

    def ppo_step(self, adv: torch.Tensor) -> None:
        ratio = torch.exp(self.logp() - self.old)
        a = adv.float()[:, None]
        loss = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def terms(self) -> torch.Tensor:
        lp = self.logp()
        return (self.weights(lp) * lp).sum(1)

    def grpo(self) -> torch.Tensor:
        r = self.rewards.view(-1, GROUP)
        return (r - r.mean(1, keepdim=True)).flatten()

    def param_bytes(self) -> int:
        return sum(p.numel() * 4 for p in self.params)  # fp32 gradients

    def form(self, name: str) -> Callable[[], int]:
        """The form's step; it returns the bytes it held beyond the step (measured tensors)."""
        from ess_patch.norm_pass import norm_pass
        from ess_patch.per_trajectory import PerTrajectoryGrads
        from ess_patch.proxy import proxy_sq_norms

        def step() -> int:
            self.ppo_step(self.grpo())
            return 0

        def in_step() -> int:
            grads = PerTrajectoryGrads(self.model)
            try:
                grads.start()
                terms = self.terms()
                (-terms.sum() / self.n).backward()  # advantage 1: linear in each coefficient
                grads.stop()
                held = grads.captured_bytes
                # the parts are of -term_i / n: coefficient R_i - b* gives the advantage's loss
                grads.apply(self.b_star(grads.sq_norms()).float())
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
            finally:
                grads.remove()
            return held

        def pass_then_step(path: str) -> int:
            res = norm_pass(self.model, self.terms, path=path)
            self.ppo_step(self.b_star(res.sq_norms))
            return res.held_bytes

        def proxy() -> int:
            with torch.no_grad():
                z = self.logits()
                lp = torch.log_softmax(z, -1).gather(2, self.ids[:, 1:, None]).squeeze(-1)
            sq = proxy_sq_norms(z, self.ids[:, 1:], token_weights=self.weights(lp)).double()
            self.ppo_step(self.b_star(sq))
            # its own logits and the softmax's exponentials (freed before the step)
            return 2 * z.numel() * z.element_size()

        with torch.no_grad():
            z0 = self.logits()
            w0 = self.weights(torch.log_softmax(z0, -1).gather(2, self.ids[:, 1:, None])[..., 0])

        def proxy_math() -> int:  # the step, plus the proxy on logits it already has
            self.b_star(proxy_sq_norms(z0, self.ids[:, 1:], token_weights=w0).double())
            step()
            return z0.numel() * z0.element_size()  # the softmax's exponentials

        def vcpo() -> int:
            accum = [torch.zeros_like(p) for p in self.params]
            score = [torch.zeros_like(p) for p in self.params]
            sq = torch.zeros(self.n, dtype=torch.float64)
            for i in range(self.n):
                rows = slice(i, i + 1)
                lp = self.logp(rows)
                ((self.weights(lp, rows) * lp).sum() / self.n).backward()
                grads = [p.grad for p in self.params]
                sq[i] = sum(g.double().square().sum() for g in grads)
                for a, s, g in zip(accum, score, grads, strict=True):
                    a.add_(g, alpha=float(self.rewards[i]))
                    s.add_(g)
                self.opt.zero_grad(set_to_none=True)
                if i + 1 == self.n or self.groups[i + 1] != self.groups[i]:
                    b = float(self.rewards[i] - self.b_star(sq)[i])  # this group's b*
                    for a, s in zip(accum, score, strict=True):
                        a.add_(s, alpha=-b)
                        s.zero_()
            for p, a in zip(self.params, accum, strict=True):
                p.grad = -a
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return sum(t.numel() * t.element_size() for t in accum + score)

        return {
            "step": step,
            "in-step": in_step,
            "rules": lambda: pass_then_step("rules"),
            "exact": lambda: pass_then_step("exact"),
            "proxy": proxy,
            "proxy-math": proxy_math,
            "vcpo": vcpo,
        }[name]


def _world():
    from ess_patch.demo.policy import single_process

    return single_process()


def _shim():
    from ess_patch.demo.cpu import megatron_on_cpu

    return megatron_on_cpu()


def _measure(spec: dict[str, int], repeat: int) -> tuple[dict[str, float], dict[str, int], int]:
    """Median CPU seconds and bytes held per form (interleaved rounds), and the param count."""
    clock = time.thread_time
    with _world(), _shim():
        bench = _Bench(**spec)
        fns = {f: bench.form(f) for f in FORMS}
        out: dict[str, list[float]] = {f: [] for f in FORMS}
        held: dict[str, int] = {}
        for rnd in range(1 + repeat):
            order = FORMS[rnd % len(FORMS) :] + FORMS[: rnd % len(FORMS)]
            for f in order:
                t0 = clock()
                held[f] = fns[f]()
                if rnd:  # round 0 warms up
                    out[f].append(clock() - t0)
        params = sum(p.numel() for p in bench.params)
    return {f: statistics.median(v) for f, v in out.items()}, held, params


def _generation_share(path: str | None) -> float | None:
    """The demo's generation share of an RL step, from a run's records (jsonl)."""
    if not path:
        return None
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line]
    rows = [r for r in rows if "time_sample_s" in r and "time_train_s" in r]
    sample = statistics.median(r["time_sample_s"] for r in rows)
    train = statistics.median(r["time_train_s"] for r in rows)
    return sample / (sample + train)


def _profile(spec: dict[str, int], form: str, rows: int) -> str:
    """torch.profiler's table of one call of ``form`` (after a warm-up call): where it spends."""
    from torch.profiler import ProfilerActivity, profile

    from ess_patch.norm_pass import norm_pass

    with _world(), _shim():
        bench = _Bench(**spec)
        fn = bench.form(form)
        if form in ("rules", "exact"):  # the pass alone, without the step after it

            def fn() -> None:
                norm_pass(bench.model, bench.terms, path=form)

        fn()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main(argv: list[str] | None = None) -> int:
    import warnings

    parser = argparse.ArgumentParser(prog="python -m benchmarks.baseline_forms")
    parser.add_argument("--quick", action="store_true", help="the small model only")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--demo-records", help="a demo run's records (jsonl): the demo's generation share"
    )
    parser.add_argument(
        "--profile",
        choices=FORMS,
        help="print torch.profiler's top ops of one call of this form (each model), then exit",
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if args.profile:
        for label, spec in (dict(list(MODELS.items())[:1]) if args.quick else MODELS).items():
            print(f"\n#### {label}: {LABELS[args.profile]}\n")
            print(_profile(spec, args.profile, rows=15))
        return 0
    g_demo = _generation_share(args.demo_records)
    shares = {"the demo's": g_demo} if g_demo is not None else {}
    shares["typical"] = 0.70
    models = dict(list(MODELS.items())[:1]) if args.quick else MODELS
    for label, spec in models.items():
        med, held, params = _measure(spec, args.repeat)
        print(f"\n#### {label}: {params / 1e6:.2f} M params, CPU time, median of {args.repeat}")
        cols = ["form", "ms per step", "added to the step"]
        cols += [f"added per RL step (generation {v:.0%}, {k})" for k, v in shares.items()]
        cols += ["memory held beyond the step"]
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for f in FORMS:
            over = med[f] / med["step"] - 1
            row = [LABELS[f], f"{med[f] * 1e3:.1f}", "-" if f == "step" else f"{over:+.0%}"]
            row += ["-" if f == "step" else f"{over * (1 - g):+.1%}" for g in shares.values()]
            row += ["-" if f == "step" else f"{held[f] / 2**20:.2f} MiB"]
            print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
