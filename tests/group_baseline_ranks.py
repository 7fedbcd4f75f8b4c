"""Rank-side helpers: the DP baseline and the TP2 norm pass (inside ``harness.run_ranks``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ess_patch.group_baseline import dp_min_variance_baseline


def my_rows(n: int) -> torch.Tensor:
    """This rank's rows of a rollout of ``n``: interleaved, so every group is split."""
    return torch.arange(dist.get_rank(), n, dist.get_world_size())


def split_rollout(rewards, ids, sq, lw) -> dict[str, Any]:
    rows = my_rows(rewards.numel())
    res = dp_min_variance_baseline(
        rewards[rows], ids[rows], sq[rows], log_weights=lw[rows], dp_group=dist.group.WORLD
    )
    return {"rows": rows, "result": res}


def bad_on_rank_one(rewards, ids, sq, lw, fault: str) -> str:
    """Rank 1 gets the fault; every rank returns the error it raised (type: message)."""
    rows = my_rows(rewards.numel())
    r, i, s, w = rewards[rows].clone(), ids[rows].clone(), sq[rows].clone(), lw[rows].clone()
    if dist.get_rank() == 1:
        if fault == "length":
            s = s[:-1]
        elif fault == "nan":
            r[0] = float("nan")
        elif fault == "float-ids":
            i = i.double()
    kwargs = {"log_weights": w}
    if fault == "weights-on-one-rank" and dist.get_rank() == 1:
        kwargs = {}
    try:
        dp_min_variance_baseline(r, i, s, dp_group=dist.group.WORLD, **kwargs)
    except Exception as exc:  # the test reads which error each rank raised
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def tp2_norm_pass() -> dict[str, float]:
    """TP2 GPTModel (RMSNorm, no bias, SwiGLU, GQA, rope): the norm pass against brute force."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from ess_patch.demo.cpu import megatron_on_cpu
    from ess_patch.norm_pass import norm_pass

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
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
        )
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, prompt + response - 1), generator=gen)
    tokens = torch.randint(0, vocab, (n, response), generator=gen)
    w = torch.rand(n, response, generator=gen) + 0.5

    def terms(rows: slice = slice(None)) -> torch.Tensor:
        pos = torch.arange(ids.shape[1])[None].expand(ids[rows].shape[0], -1)
        with megatron_on_cpu():
            logits = model(ids[rows], pos, None, runtime_gather_output=True)[:, -response:]
        lp = torch.log_softmax(logits, -1).gather(2, tokens[rows][..., None]).squeeze(-1)
        return -(w[rows] * lp).sum(1)

    params = [p for p in model.parameters() if p.requires_grad]
    rank = dist.get_rank(tp)
    counted = [rank == 0 or getattr(p, "tensor_model_parallel", False) for p in params]
    want = torch.zeros(n, dtype=torch.float64)
    for i in range(n):
        g = torch.autograd.grad(terms(slice(i, i + 1))[0], params)
        want[i] = sum(x.double().square().sum() for x, c in zip(g, counted, strict=True) if c)
    dist.all_reduce(want, group=tp)
    out = {}
    for path in ("rules", "exact"):
        got = norm_pass(model, terms, tp_group=tp, path=path).sq_norms
        out[path] = float(((got - want) / want).abs().max())
    return out


def tp2_replicated_below_the_head() -> dict[str, float]:
    """TP2, a replicated embedding under a vocabulary-parallel head (megatron's own mappings):
    on TP rank 1 no parameter that counts lies below the head, yet the backward must still
    reach the embedding there, or rank 0's all-reduce of the head's input gradient waits for
    a peer that never comes. The norm pass against brute force, both paths."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_tensor_model_parallel_region,
    )

    from ess_patch.demo.cpu import megatron_on_cpu
    from ess_patch.norm_pass import norm_pass

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    tp = ps.get_tensor_model_parallel_group()
    rank = dist.get_rank(tp)
    vocab, hidden, length, n = 8, 5, 6, 3
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(vocab, hidden)
    full = torch.randn(vocab, hidden)
    head = torch.nn.Parameter(full[rank * vocab // 2 : (rank + 1) * vocab // 2].clone())
    set_tensor_model_parallel_attributes(head, True, 0, 1)
    model = torch.nn.Module()
    model.embedding, model.head = embedding, torch.nn.Linear(hidden, vocab // 2, bias=False)
    model.head.weight = head
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (n, length), generator=gen)
    targets = torch.randint(0, vocab, (n, length), generator=gen)

    def terms(rows: slice = slice(None)) -> torch.Tensor:
        with megatron_on_cpu():
            h = copy_to_tensor_model_parallel_region(torch.tanh(model.embedding(ids[rows])))
            logits = gather_from_tensor_model_parallel_region(model.head(h))
        lp = torch.log_softmax(logits, -1).gather(2, targets[rows][..., None]).squeeze(-1)
        return lp.sum(1)

    params = list(model.parameters())
    counted = [rank == 0 or getattr(p, "tensor_model_parallel", False) for p in params]
    want = torch.zeros(n, dtype=torch.float64)
    with megatron_on_cpu():
        for i in range(n):
            g = torch.autograd.grad(terms(slice(i, i + 1))[0], params)
            want[i] = sum(x.double().square().sum() for x, c in zip(g, counted, strict=True) if c)
    dist.all_reduce(want, group=tp)
    with megatron_on_cpu():  # the backward's mappings too
        got = {
            path: norm_pass(model, terms, tp_group=tp, path=path).sq_norms
            for path in ("rules", "exact")
        }
    return {path: float(((sq - want) / want).abs().max()) for path, sq in got.items()}
