"""The norm pass's cost beside one training step (forward + backward), on CPU.

    python -m benchmarks.norm_pass_cost [--hidden 128] [--layers 4] [--n 16] [--len 64] [--packed]

Model: megatron-core GPTModel, local spec (RMSNorm, no bias, SwiGLU, GQA, rope). The step is
the forward and backward of a PPO-clipped loss over the same ``n`` rows; the norm pass is
``ess_patch.norm_pass`` on ``sum_t w_t log p`` (path "rules": one backward with no weight
gradient; "exact": one backward per row). Median of ``--repeat`` runs each. ``--packed``: the
same ``n`` trajectories packed in one THD row (``n * len`` tokens, a block-diagonal causal mask
standing in for THD attention, which megatron-core's local spec lacks), the step and the pass
(rules given ``cu_seqlens``) both on it; the mask makes attention quadratic in the row on CPU,
so compare the ratio, not the seconds, with the padded run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--packed", action="store_true", help="one packed (THD) row")
    args = parser.parse_args()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from ess_patch.demo.cpu import megatron_on_cpu
    from ess_patch.demo.policy import single_process
    from ess_patch.norm_pass import norm_pass

    with single_process(), megatron_on_cpu():
        config = TransformerConfig(
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=8,
            num_query_groups=2,
            ffn_hidden_size=4 * args.hidden,
            normalization="RMSNorm",
            add_bias_linear=False,
            gated_linear_unit=True,
            activation_func=F.silu,
            use_cpu_initialization=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        torch.manual_seed(0)
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=args.vocab,
            max_sequence_length=args.len,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
        )
        ids = torch.randint(0, args.vocab, (args.n, args.len))
        pos = torch.arange(args.len)[None].expand(args.n, -1)
        old = -torch.rand(args.n, args.len - 1)
        adv = torch.randn(args.n, 1)
        cu = None
        if args.packed:  # row i of the padded batch is trajectory i of the packed row
            total = args.n * args.len
            seg = torch.arange(total) // args.len
            causal = torch.ones(total, total).tril().bool()
            mask = ~(causal & (seg[:, None] == seg[None, :]))[None, None]
            cu = torch.arange(args.n + 1) * args.len

        def logp():
            if cu is None:
                logits = model(ids, pos, None)[:, :-1].float()
            else:
                flat = model(ids.reshape(1, -1), pos.reshape(1, -1), mask).float()
                logits = flat.view(args.n, args.len, -1)[:, :-1]
            return torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None]).squeeze(-1)

        def step():
            ratio = torch.exp(logp() - old)
            loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
            loss.backward()
            model.zero_grad(set_to_none=True)

        def terms():
            lp = logp()
            return (torch.exp(lp.detach() - old) * lp).sum(1)

        def timed(fn, repeat):
            fn()  # warm-up
            out = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
            return statistics.median(out)

        params = sum(p.numel() for p in model.parameters())
        t_step = timed(step, args.repeat)
        t_rules = timed(lambda: norm_pass(model, terms, cu_seqlens=cu), args.repeat)
        t_exact = timed(lambda: norm_pass(model, terms, path="exact"), max(1, args.repeat // 2))
        print(
            f"# GPT h{args.hidden} L{args.layers} V{args.vocab}, {params / 1e6:.2f} M params, "
            f"{args.n} {'trajectories packed in one row' if args.packed else 'rows'} x "
            f"{args.len} tokens, CPU, {torch.get_num_threads()} threads"
        )
        print("| form | seconds | of the training step |")
        print("|---|---|---|")
        print(f"| training step (fwd + bwd, PPO-clipped) | {t_step:.3f} | 1.00 |")
        print(f"| norm pass, rules | {t_rules:.3f} | {t_rules / t_step:.2f} |")
        print(f"| norm pass, exact | {t_exact:.3f} | {t_exact / t_step:.2f} |")


if __name__ == "__main__":
    main()
