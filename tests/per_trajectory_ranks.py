"""Rank-side helper: the rules in TP2 against one autograd.grad per trajectory on the same ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


def tp2_modern(tied: bool = False) -> dict[str, Any]:
    """TP2 GPTModel (RMSNorm, no bias, SwiGLU, GQA, rope; ``tied``: the output layer uses the
    vocabulary-parallel embedding's weight): the rules' norms and rewritten gradient against
    brute force (norm over TP: sharded parameters from both ranks, replicated ones once)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from ess_patch.demo.cpu import megatron_on_cpu
    from ess_patch.per_trajectory import PerTrajectoryGrads

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    tp = ps.get_tensor_model_parallel_group()
    vocab, prompt, response, n = 16, 5, 4, 4
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=48,
        normalization="RMSNorm",
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        tensor_model_parallel_size=2,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    with megatron_on_cpu():
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=vocab,
            max_sequence_length=prompt + response,
            share_embeddings_and_output_weights=tied,
            position_embedding_type="rope",
        )
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, prompt + response - 1), generator=gen)
    tokens = torch.randint(0, vocab, (n, response), generator=gen)
    coeffs = torch.randn(n, generator=gen)

    def terms(rows: slice) -> torch.Tensor:
        pos = torch.arange(ids.shape[1])[None].expand(ids[rows].shape[0], -1)
        with megatron_on_cpu():
            logits = model(ids[rows], pos, None, runtime_gather_output=True)[:, -response:]
        lp = torch.log_softmax(logits, -1).gather(2, tokens[rows][..., None]).squeeze(-1)
        return -lp.sum(1)

    params = [p for p in model.parameters() if p.requires_grad]
    rank = dist.get_rank(tp)
    counted = [rank == 0 or getattr(p, "tensor_model_parallel", False) for p in params]
    brute, want_sq = [], torch.zeros(n, dtype=torch.float64)
    for i in range(n):
        g = torch.autograd.grad(terms(slice(i, i + 1))[0], params)
        brute.append(g)
        want_sq[i] = sum(x.double().square().sum() for x, c in zip(g, counted) if c)
    dist.all_reduce(want_sq, group=tp)
    pg = PerTrajectoryGrads(model, tp_group=tp)
    pg.start()
    for rows in (slice(0, 2), slice(2, n)):
        terms(rows).sum().backward()
    pg.stop()
    sq = pg.sq_norms().double()
    pg.apply(coeffs)
    err_g = 0.0
    for k, p in enumerate(params):
        want = sum(coeffs[i] * brute[i][k] for i in range(n))
        err_g = max(err_g, float((p.grad - want).abs().max() / want.abs().max().clamp(min=1e-12)))
    pg.remove()
    return {"err_sq": float(((sq - want_sq) / want_sq).abs().max()), "err_g": err_g}
