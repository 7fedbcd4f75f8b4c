"""A forward-only proxy of per-trajectory squared gradient norms (verl's Optimal Token Baseline).

verl PR #4678 (``core_algos.py``) estimates each token's squared gradient norm from the logits
alone: the gradient of ``log p(y_t)`` with respect to the logits is ``onehot(y_t) - p``, whose
squared norm is ``1 - 2*p(y_t) + sum_v p_v^2``. The proxy of a trajectory is the sum of that over
its tokens (cross-token terms and everything below the logits ignored), times the squared IS
weight of each token when there is one. It costs a softmax over logits the loss has already
computed: no backward, no hooks.

:func:`proxy_sq_norms` is pure tensor math. Its only collective is for vocabulary-parallel
logits (megatron's output layer: each TP rank holds ``V / tp`` columns): the softmax's max and
sum, the sampled token's probability and ``sum_v p_v^2`` are all-reduced over ``tp_group``.

Packed rows (THD: several trajectories in one row) are handled by ``segments``: a per-token
trajectory id (``-1``: no trajectory, e.g. padding or prompt); padded rows are the case of one
id per row (``segments=None``: row ``i`` is trajectory ``i``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from .baseline import BaselineResult, min_variance_baseline
from .errors import EssPatchValueError

__all__ = ["proxy_baseline", "proxy_sq_norms", "segments_from_cu_seqlens"]

logger = logging.getLogger(__name__)

_ACC = torch.float32


def segments_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """``[T]`` trajectory id of each token of a packed row from megatron's ``cu_seqlens``.

    ``cu_seqlens``: ``[N + 1]`` cumulative lengths starting at 0. Tokens past
    ``cu_seqlens[-1]`` (padding up to ``total``) get ``-1``.
    """
    cu = torch.as_tensor(cu_seqlens).long()
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or bool((cu.diff() < 0).any()):
        raise EssPatchValueError(
            f"segments_from_cu_seqlens: cu_seqlens must be 1-D, start at 0 and not decrease; got "
            f"{cu.tolist()}"
        )
    t = int(cu[-1]) if total is None else total
    lengths = cu.diff()
    ids = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    out = torch.full((t,), -1, dtype=torch.long)
    out[: ids.numel()] = ids[:t]
    return out


def _group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def proxy_sq_norms(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    segments: torch.Tensor | None = None,
    num_trajectories: int | None = None,
    token_weights: torch.Tensor | None = None,
    tp_group: Any = None,
    vocab_start: int = 0,
) -> torch.Tensor:
    """``[N]`` forward-only proxy of each trajectory's squared gradient norm.

    Args:
        logits: ``[..., V_local]`` logits predicting ``tokens`` (this TP rank's vocabulary
            shard ``[vocab_start, vocab_start + V_local)`` when ``tp_group`` has several ranks).
            Detached; taken in float32.
        tokens: ``[...]`` the sampled token at each position (global vocabulary ids).
        mask: ``[...]`` 1 for the tokens the loss counts (response tokens), else 0; ``None``: all.
        segments: ``[...]`` integer trajectory id per token (``-1``: none), for packed rows;
            ``None``: the first dimension indexes the trajectories (one per row).
        num_trajectories: ``N`` (default: the largest id + 1, or the number of rows).
        token_weights: ``[...]`` each token's IS weight ``w_t`` (its term is multiplied by
            ``w_t^2``) or per-token loss coefficient; ``None``: 1.
        tp_group: the TP group over which the vocabulary is sharded (``None``: whole vocabulary).
        vocab_start: the first vocabulary id of this rank's shard.

    Raises:
        ValueError: shapes disagree, or a token id lies outside the vocabulary.
    """
    z = logits.detach().to(_ACC)
    tok = torch.as_tensor(tokens, device=z.device).long()
    if tok.shape != z.shape[:-1]:
        raise EssPatchValueError(
            f"proxy_sq_norms: tokens have shape {tuple(tok.shape)}, logits {tuple(z.shape)}; "
            "give one token per logits row"
        )
    group = tp_group if _group_size(tp_group) > 1 else None
    v_local = z.shape[-1]
    # softmax over the whole (sharded) vocabulary: megatron's vocab-parallel cross-entropy steps
    top = z.max(-1, keepdim=True).values
    if group is not None:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - top)
    denom = e.sum(-1, keepdim=True)
    local = tok - vocab_start
    held = (local >= 0) & (local < v_local)
    e_tok = e.gather(-1, torch.where(held, local, 0)[..., None]) * held[..., None]
    sq = e.square().sum(-1, keepdim=True)
    stats = torch.cat([denom, e_tok, sq], -1)
    if group is not None:
        dist.all_reduce(stats, group=group)
    elif not bool(held.all()):
        raise EssPatchValueError(
            f"proxy_sq_norms: a token id outside [0, {v_local}) of the logits' vocabulary; pass "
            "tp_group and vocab_start for vocabulary-parallel logits"
        )
    denom, e_tok, sq = stats.unbind(-1)
    p_tok, sum_p2 = e_tok / denom, sq / denom.square()
    per_token = (1.0 - 2.0 * p_tok + sum_p2).clamp(min=0)  # >= 0 up to rounding
    if token_weights is not None:
        per_token = per_token * torch.as_tensor(token_weights, device=z.device).to(_ACC).square()
    if mask is not None:
        per_token = per_token * torch.as_tensor(mask, device=z.device).to(_ACC)
    if segments is None:
        return per_token.reshape(per_token.shape[0], -1).sum(1)
    seg = torch.as_tensor(segments, device=z.device).long()
    if seg.shape != per_token.shape:
        raise EssPatchValueError(
            f"proxy_sq_norms: segments have shape {tuple(seg.shape)}, tokens {tuple(tok.shape)}"
        )
    n = int(seg.max()) + 1 if num_trajectories is None and seg.numel() else num_trajectories or 0
    keep = seg >= 0
    out = torch.zeros(n, dtype=_ACC, device=z.device)
    return out.index_add_(0, seg[keep], per_token[keep])


def proxy_baseline(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    log_weights: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    **proxy: Any,
) -> BaselineResult:
    """:func:`~ess_patch.baseline.min_variance_baseline` with the proxy's norms.

    ``log_weights`` / ``lengths`` go to the baseline (sequence IS weights, ``1/L^2``);
    the other keyword arguments to :func:`proxy_sq_norms` (``segments``, ``token_weights``,
    ``tp_group``, ...). Don't give a weight both ways: it would count twice.
    """
    sq = proxy_sq_norms(logits, tokens, mask, **proxy)
    return min_variance_baseline(log_weights, rewards, sq, group_ids, lengths=lengths)
