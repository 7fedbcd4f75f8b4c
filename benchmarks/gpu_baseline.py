"""Section 4 of ``benchmarks/gpu.py``: VCPO's baseline on Transformer Engine layers (issue 42).

On a GPU with Transformer Engine, a megatron-core ``GPTModel`` built from the TE layer spec
(the GPU default: ``TELayerNormColumnParallelLinear``, ``TERowParallelLinear``, TE's
attention), fp32 parameters, RMSNorm, SwiGLU, GQA, rope, no biases. Per trajectory, the
squared gradient norm of ``sum_t w_t log p(y_t)`` three ways:

* brute force: one ``autograd.grad`` per trajectory over every trainable parameter (the
  expectation);
* ``norm_pass(path="rules")``: the per-module rules where a module has one; TE's fused modules
  have none, so their parameters take the exact path (``unsupported="exact"``, never skipped);
* ``norm_pass(path="exact")``: one backward per trajectory through any module.

Reported: the largest relative error of each path against brute force (float32: it must stay
under 1e-4), the time of each, and which modules took the exact path inside the rules pass.
Without TE (or on CPU) the local spec stands in, and the table says that the TE check did not
run. tests/test_gpu_bench.py runs it on CPU with the local spec, where the check must pass.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import torch

TITLE = "## GPU 4. VCPO's baseline: the norm pass on Transformer Engine layers (issue 42)"
HEADERS = ["spec", "path", "ms", "max rel err vs brute force", "ok"]
TOLERANCE = 1e-4


def _model(te: bool, device: str, quick: bool) -> torch.nn.Module:
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer import TransformerConfig

    hidden, layers = (32, 2) if quick else (512, 4)
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
        params_dtype=torch.float32,
    )
    spec = (
        specs.get_gpt_layer_with_transformer_engine_spec()
        if te
        else specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    )
    torch.manual_seed(0)
    model = GPTModel(
        config,
        spec,
        vocab_size=128 if quick else 4096,
        max_sequence_length=64,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    return model.to(device)


def _terms(model: torch.nn.Module, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per row: ``sum_t w_t log p(y_t)`` over the row's next tokens."""
    pos = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
    logits = model(ids, pos, None)[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None]).squeeze(-1)
    return (w * lp).sum(1)


def _brute(model: torch.nn.Module, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(ids.shape[0]):
        grads = torch.autograd.grad(_terms(model, ids[i : i + 1], w[i : i + 1])[0], params)
        out.append(sum(g.double().square().sum() for g in grads))
    return torch.stack(out)


def _exact_modules(model: torch.nn.Module) -> list[str]:
    """The modules owning trainable parameters that no per-module rule covers."""
    from ess_patch.per_trajectory import rule_kind

    return sorted(
        {
            type(m).__name__
            for m in model.modules()
            if any(p.requires_grad for p in m.parameters(recurse=False)) and rule_kind(m) is None
        }
    )


def baseline_section(device: str, quick: bool) -> tuple[list[str], list[list[Any]], list[str]]:
    """Call inside ``benchmarks.gpu.one_rank_world``: (headers, rows, notes)."""
    from ess_patch.norm_pass import norm_pass

    te = device == "cuda" and importlib.util.find_spec("transformer_engine") is not None
    spec = "transformer_engine" if te else "local (TE check not run)"
    n, seq = (4, 16) if quick else (16, 64)
    model = _model(te, device, quick)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128 if quick else 4096, (n, seq), generator=gen).to(device)
    w = (0.5 + torch.rand(n, seq - 1, generator=gen)).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    with torch.enable_grad():
        t0 = time.perf_counter()
        want = _brute(model, ids, w)
        sync()
        rows.append([spec, "brute force", f"{(time.perf_counter() - t0) * 1e3:.1f}", "-", "-"])
        for path in ("rules", "exact"):
            sync()
            t0 = time.perf_counter()
            got = norm_pass(model, lambda: _terms(model, ids, w), path=path).sq_norms
            sync()
            ms = (time.perf_counter() - t0) * 1e3
            err = float(((got - want).abs() / want.abs().clamp_min(1e-30)).max())
            ok = "ok" if err < TOLERANCE else f"FAIL (> {TOLERANCE:g})"
            rows.append([spec, path, f"{ms:.1f}", f"{err:.1e}", ok])
    exact = _exact_modules(model)
    notes = [
        f"{n} trajectories of {seq} tokens, fp32 parameters; the rules pass sends the "
        f"parameters of modules without a rule to the exact path: {', '.join(exact) or 'none'}",
    ]
    if not te:
        notes.append(
            "Transformer Engine is not importable here (or the device is not CUDA): the local "
            "spec stands in, so this row checks the code path, not TE's layers"
        )
    return HEADERS, rows, notes
