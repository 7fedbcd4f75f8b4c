"""Packed (THD) attention for megatron-core's local spec, on CPU, as TE serves verl.

verl's Megatron actor packs every micro-batch into one THD row (``use_remove_padding``, its
default): ``GPTModel`` then gets ``packed_seq_params`` with ``cu_seqlens``, and only TE's fused
attention takes them (the local spec's ``DotProductAttention`` asserts there are none). TE
cannot exist on CPU. :class:`ThdDotProductAttention` is megatron's own ``DotProductAttention``
given what TE's kernel computes for ``qkv_format='thd'``: each packed sequence attends causally
to itself alone (a block-diagonal causal mask over ``cu_seqlens_q_padded``). Every other layer,
the rotary embedding of THD rows (per sequence, from ``cu_seqlens``) included, is
megatron-core's own. Unpacked calls are the parent's, unchanged, but for the ``[b, s]``
padding mask of verl's padded form, which TE's causal kernel does not read either.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


def block_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[1, 1, total, total]``, megatron's convention (True = masked out): token ``t`` sees
    the tokens ``<= t`` of its own packed sequence only."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    if int(cu_seqlens[0]) != 0 or bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens {cu_seqlens.tolist()} must start at 0 and not decrease")
    if int(cu_seqlens[-1]) != total:
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])}, the packed row has {total}")
    segment = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    return ~(causal & (segment[:, None] == segment[None, :]))[None, None]


class ThdDotProductAttention(DotProductAttention):
    """``DotProductAttention`` that also serves THD rows (see the module docstring)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is None:
            if attention_mask is not None and attention_mask.dim() == 2:
                # verl's padded form hands the model its [b, s] padding mask (right-padded
                # rows); TE's causal kernel does not read it, and under a causal mask the
                # padding at a row's end changes none of the tokens before it
                attention_mask = None
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias
            )
        assert packed_seq_params.qkv_format == "thd", packed_seq_params.qkv_format
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        mask = block_causal_mask(cu.cpu(), query.shape[0]).to(query.device)
        # [t, heads, dim] -> the parent's [s, b=1, heads, dim]; its [s, 1, heads*dim] is what
        # Attention reshapes a THD output to
        return super().forward(
            query.unsqueeze(1),
            key.unsqueeze(1),
            value.unsqueeze(1),
            mask,
            attn_mask_type,
            attention_bias,
        )
