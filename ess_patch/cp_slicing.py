"""Which response tokens a context-parallel rank holds under the zigzag split.

miles and slime keep ``loss_masks`` at full response length while log-probs are CP-local.
Each sample of total length T is cut into ``2 * cp`` chunks of ``ceil(T / (2 * cp))``
positions (``ceil(max_seq_len / (2 * cp))`` for "bshd"); rank r holds chunks r and
``2 * cp - 1 - r``. Position p's logits score token p + 1, so a chunk ``[lo, hi)`` covers
response tokens ``[max(lo, P - 1), min(hi, T - 1)) + 1`` where P is the prompt length
(upstream: ``get_logits_and_tokens_offset_with_cp`` in miles' ``cp_utils.py``). The formula is
the same in every miles version since 2026-01-12 (where it read ``cp_rank``/``cp_size`` from the
``parallel_state`` argument) and every slime release from v0.2.0 (bshd only in v0.2.2 to
v0.3.0); tests/frameworks checks it against each snapshot's own ``slice_log_prob_with_cp``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import EssPatchValueError

__all__ = ["local_response_masks", "zigzag_response_ranges"]


def zigzag_response_ranges(
    total_length: int,
    response_length: int,
    cp_rank: int,
    cp_size: int,
    *,
    qkv_format: str = "thd",
    max_seq_len: int | None = None,
) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two ``[start, end)`` ranges of response-token indices held by ``cp_rank``.

    Indices are relative to the response start; an empty chunk is ``(0, 0)``.
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise EssPatchValueError(f"cp_rank={cp_rank} must be in [0, cp_size={cp_size})")
    if not 0 <= response_length <= total_length:
        raise EssPatchValueError(
            f"response_length={response_length} must be in [0, total_length={total_length}]"
        )
    if cp_size == 1:
        return (0, response_length), (0, 0)
    if qkv_format == "thd":
        span = total_length
    elif qkv_format == "bshd":
        if max_seq_len is None:
            raise EssPatchValueError(
                "qkv_format='bshd' needs max_seq_len (the padded sequence length)"
            )
        span = max_seq_len
    else:
        raise EssPatchValueError(f"qkv_format={qkv_format!r} is not one of 'thd', 'bshd'")
    chunk = -(-span // (2 * cp_size))
    prompt = total_length - response_length
    ranges = []
    for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
        lo = max(index * chunk, prompt - 1)
        hi = min((index + 1) * chunk, total_length - 1)
        # logits lo..hi-1 score tokens lo+1..hi, i.e. response indices lo+1-P .. hi-P
        ranges.append((lo + 1 - prompt, hi + 1 - prompt) if lo < hi else (0, 0))
    return ranges[0], ranges[1]


def local_response_masks(
    loss_masks: Sequence[torch.Tensor],
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    cp_rank: int,
    cp_size: int,
    *,
    qkv_format: str = "thd",
    max_seq_lens: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """Slice full-length response masks to the tokens ``cp_rank`` holds (zigzag order).

    Raises:
        ValueError: the lists differ in length, or a mask is not ``response_length`` long.
    """
    n = len(loss_masks)
    if not (len(total_lengths) == len(response_lengths) == n):
        raise EssPatchValueError(
            f"{n} loss_masks, {len(total_lengths)} total_lengths and {len(response_lengths)} "
            "response_lengths: give one of each per sample"
        )
    if cp_size == 1:
        return list(loss_masks)
    out = []
    for i, (mask, total, response) in enumerate(
        zip(loss_masks, total_lengths, response_lengths, strict=True)
    ):
        if mask.shape[0] != response:
            raise EssPatchValueError(
                f"sample {i}: loss_masks[{i}] has {mask.shape[0]} entries but response_length is "
                f"{response}; pass full-length (not CP-sliced) response masks"
            )
        max_len = None if max_seq_lens is None else max_seq_lens[i]
        (a0, a1), (b0, b1) = zigzag_response_ranges(
            total, response, cp_rank, cp_size, qkv_format=qkv_format, max_seq_len=max_len
        )
        out.append(torch.cat([mask[a0:a1], mask[b0:b1]]))
    return out
