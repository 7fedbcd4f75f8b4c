"""Rank-side helper: the norm pass over two pipeline stages against one process's brute force."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB, PROMPT, RESPONSE, N, LAYERS = 16, 5, 4, 4, 4


def config(pp: int, tp: int = 1):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=48,
        normalization="RMSNorm",
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pipeline_dtype=torch.float32,
    )


def gpt(pp: int = 1, first: bool = True, last: bool = True, tied: bool = False):
    """RMSNorm, no bias, SwiGLU, GQA, rope; a stage of it with ``pp`` > 1."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from ess_patch.demo.cpu import megatron_on_cpu

    torch.manual_seed(0)
    with megatron_on_cpu():
        return GPTModel(
            config(pp),
            get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=VOCAB,
            max_sequence_length=PROMPT + RESPONSE,
            pre_process=first,
            post_process=last,
            share_embeddings_and_output_weights=tied,
            position_embedding_type="rope",
        )


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (N, PROMPT + RESPONSE - 1), generator=gen)
    tokens = torch.randint(0, VOCAB, (N, RESPONSE), generator=gen)
    w = torch.rand(N, RESPONSE, generator=gen) + 0.5
    return ids, tokens, w


def terms_of(logits: torch.Tensor, tokens: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[b]`` terms ``sum_t w_t log p(y_t)`` from ``[b, s, V]`` logits."""
    logp = torch.log_softmax(logits[:, -RESPONSE:].float(), -1)
    return (w * logp.gather(2, tokens[..., None]).squeeze(-1)).sum(1)


def brute(model, ids, tokens, w) -> torch.Tensor:
    """One backward per trajectory over every parameter of the whole (one-stage) model."""
    from ess_patch.demo.cpu import megatron_on_cpu

    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(ids.shape[0]):
        pos = torch.arange(ids.shape[1])[None]
        with megatron_on_cpu():
            term = terms_of(model(ids[i : i + 1], pos, None), tokens[i : i + 1], w[i : i + 1])[0]
        out.append(sum(g.double().square().sum() for g in torch.autograd.grad(term, params)))
    return torch.stack(out)


def _owner(name: str, stages: int, layers: int) -> int | None:
    """The stage that holds the full model's parameter ``name`` (None: every stage)."""
    if name.startswith("decoder.layers."):
        return int(name.split(".")[2]) // (layers // stages)
    if name.startswith("embedding."):
        return 0
    if name.startswith(("output_layer.", "decoder.final_layernorm.")):
        return stages - 1
    return None


def stage_weights(full: dict, stage: int, stages: int, layers: int = LAYERS) -> dict:
    """The full model's state dict renamed to one stage's (its layers renumbered from 0)."""
    per = layers // stages
    out = {}
    for name, value in full.items():
        if _owner(name, stages, layers) not in (None, stage):
            continue
        if name.startswith("decoder.layers."):
            k = int(name.split(".")[2])
            name = ".".join(["decoder", "layers", str(k - stage * per), *name.split(".")[3:]])
        out[name] = value
    return out


def pp2_norm_pass(path: str, case: str = "normal") -> dict[str, Any]:
    """This stage's result of ``pipelined_norm_pass`` on the same weights and batch as one
    process's model; ``case``: "fail-last" (the last stage's loss raises), "fail-first" (the
    first stage's forward raises), "tied"."""
    from megatron.core import parallel_state as ps

    from ess_patch.demo.cpu import megatron_on_cpu
    from ess_patch.pipeline_pass import Stage, pipelined_norm_pass

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(create_gloo_process_groups=False)  # PP1 for the full model
    full = gpt().state_dict()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=2, create_gloo_process_groups=False)
    rank, stages = ps.get_pipeline_model_parallel_rank(), 2
    first, last = rank == 0, rank == stages - 1
    model = gpt(2, first, last, tied=case == "tied")
    if case != "tied":
        missing, unexpected = model.load_state_dict(stage_weights(full, rank, stages), strict=False)
        assert not unexpected and all(m.endswith("_extra_state") for m in missing), (
            missing,
            unexpected,
        )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids, tokens, w = batch()
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    stage = Stage(
        group=ps.get_pipeline_model_parallel_group(),
        prev=None if first else ps.get_pipeline_model_parallel_prev_rank(),
        next=None if last else ps.get_pipeline_model_parallel_next_rank(),
        shape=(ids.shape[1], ids.shape[0], 32),
        index=rank,
    )

    def forward(x):
        if case == "fail-first" and first:
            raise RuntimeError("the forward of the first stage failed on purpose")
        if x is not None:
            model.set_input_tensor(x)
        with megatron_on_cpu():
            return model(ids, pos, None)

    def loss_terms(logits):
        if case == "fail-last":
            raise ValueError("the loss of the last stage failed on purpose")
        return terms_of(logits, tokens, w)

    try:
        res = pipelined_norm_pass(model, forward, loss_terms, stage, path=path)
    except Exception as exc:  # the test reads each stage's error
        import traceback

        return {
            "error": f"{type(exc).__name__}: {exc}",
            "stage": rank,
            "trace": traceback.format_exc(),
        }
    finally:
        dist.barrier()
    unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    grads = [n for n, p in model.named_parameters() if p.grad is not None]
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    return {
        "sq": res.sq_norms.tolist(),
        "stage": rank,
        "unchanged": unchanged,
        "grads": grads,
        "frozen": frozen,
        "error": None,
    }
