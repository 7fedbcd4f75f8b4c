"""Benchmark: the forward-only proxy's b* (ess_patch.proxy, verl's OTB) against the exact one.

Exact: one forward and backward per trajectory of ``sum_t log p(y_t)`` (brute force), the
squared norm of the whole model's gradient. Proxy: ``sum_t (1 - 2 p(y_t) + sum_v p_v^2)`` from
the same forward's logits. Both feed :func:`ess_patch.baseline.min_variance_baseline` over the
same groups and rewards. Printed per model: Pearson and Spearman correlation of the norms, the
relative error of b* per group, and the advantage difference.

Models: the demo's (``PolicySpec()``: hidden 64, 2 layers, LayerNorm, learned positions, vocab
16) and a wider one (hidden 256, 4 layers, RMSNorm, SwiGLU, rope, GQA 8 heads / 2 groups, no
linear biases, vocab 512), both megatron-core local spec, CPU, at initialisation and after a
few SGD steps on the rollout (so the policy is not near-uniform).
Run: ``python -m benchmarks.baseline_proxy``.
"""

from __future__ import annotations

import torch

from ess_patch.baseline import min_variance_baseline
from ess_patch.demo.policy import PolicySpec, build_policy, single_process
from ess_patch.proxy import proxy_sq_norms

N, GROUP, PROMPT, RESPONSE = 16, 4, 8, 16


def wide_model(vocab: int = 512) -> torch.nn.Module:
    """hidden 256, 4 layers, RMSNorm, SwiGLU, rope, GQA, no bias, untied (local spec, CPU)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        num_query_groups=2,
        ffn_hidden_size=512,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=vocab,
        max_sequence_length=PROMPT + RESPONSE,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )


def _logits(model, ids):
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    return model(ids, pos, None)  # [b, s, V]


def measure(model: torch.nn.Module, vocab: int, seed: int, train_steps: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (N, PROMPT), generator=gen)
    responses = torch.randint(0, vocab, (N, RESPONSE), generator=gen)
    ids = torch.cat([prompts, responses[:, :-1]], 1)
    rewards = (torch.rand(N, generator=gen) > 0.5).double()
    groups = torch.arange(N // GROUP).repeat_interleave(GROUP)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.05)
    for _ in range(train_steps):  # move the policy off uniform: fit half of the responses
        opt.zero_grad()
        lp = torch.log_softmax(_logits(model, ids)[:, -RESPONSE:], -1)
        (-lp.gather(2, responses[..., None]).mean()).backward()
        opt.step()
    exact = torch.zeros(N, dtype=torch.float64)
    proxy = torch.zeros(N, dtype=torch.float64)
    for i in range(N):
        logits = _logits(model, ids[i : i + 1])[:, -RESPONSE:]
        lp = torch.log_softmax(logits, -1).gather(2, responses[i : i + 1, :, None]).sum()
        g = torch.autograd.grad(lp, params)
        exact[i] = sum(x.double().square().sum() for x in g)
        proxy[i] = proxy_sq_norms(logits, responses[i : i + 1])[0]
    be = min_variance_baseline(None, rewards, exact, groups)
    bp = min_variance_baseline(None, rewards, proxy, groups)
    mean = min_variance_baseline(None, rewards, torch.ones(N), groups)  # GRPO group mean

    def rank(x):
        return x.argsort().argsort().double()

    def corr(a, b):
        return float(torch.corrcoef(torch.stack([a, b]))[0, 1])

    rel = ((bp.baselines - be.baselines).abs() / be.baselines.abs().clamp(min=1e-12)).max()
    return {
        "pearson": corr(exact, proxy),
        "spearman": corr(rank(exact), rank(proxy)),
        "exact_cv": float(exact.std() / exact.mean()),
        "proxy_cv": float(proxy.std() / proxy.mean()),
        "b_rel_err_max": float(rel),
        "adv_diff_max": float((bp.advantages - be.advantages).abs().max()),
        "adv_diff_mean": float((bp.advantages - be.advantages).abs().mean()),
        "mean_shift_mean": float((mean.advantages - be.advantages).abs().mean()),
    }


def main() -> None:
    torch.set_num_threads(1)
    with single_process():
        for name, build, vocab in (
            ("demo", lambda: build_policy(PolicySpec(max_len=PROMPT + RESPONSE)), 16),
            ("wide", wide_model, 512),
        ):
            for steps in (0, 20):
                torch.manual_seed(0)
                r = measure(build(), vocab, seed=1, train_steps=steps)
                print(
                    f"{name:5s} sgd_steps={steps:2d} "
                    + " ".join(f"{k}={v:.4f}" for k, v in r.items()),
                    flush=True,
                )


if __name__ == "__main__":
    main()
