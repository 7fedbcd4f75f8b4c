"""Zigzag CP slicing of full-length response masks, against an independent slicing."""

from __future__ import annotations

import pytest
import torch

from ess_patch.cp_slicing import local_response_masks, zigzag_response_ranges


def _independent_local_tokens(total, response, rank, cp, span=None):
    """Walk every position of the sequence: which response tokens does ``rank`` score?"""
    span = total if span is None else span
    chunk = -(-span // (2 * cp))
    prompt = total - response
    held = []
    for index in (rank, 2 * cp - 1 - rank):
        for pos in range(index * chunk, (index + 1) * chunk):
            token = pos + 1  # logits at pos score token pos + 1
            if prompt <= token < total:
                held.append(token - prompt)
    return held


# a response needs a prompt of at least one token (the first logit scores token 1)
CASES = [(t, r) for t in range(1, 40) for r in range(0, t)] + [(1000, 7), (1001, 999)]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_matches_independent_slicing_and_covers_each_token_once(cp):
    for total, response in CASES:
        mask = torch.arange(response)  # each entry names its token
        seen = []
        for rank in range(cp):
            local = local_response_masks([mask], [total], [response], rank, cp)[0]
            expected = _independent_local_tokens(total, response, rank, cp)
            assert local.tolist() == expected, (total, response, rank)
            seen += local.tolist()
        assert sorted(seen) == list(range(response)), (total, response)


def test_bshd_uses_the_padded_length():
    total, response, cp, pad = 10, 6, 2, 16
    for rank in range(cp):
        local = local_response_masks(
            [torch.arange(response)],
            [total],
            [response],
            rank,
            cp,
            qkv_format="bshd",
            max_seq_lens=[pad],
        )[0]
        assert local.tolist() == _independent_local_tokens(total, response, rank, cp, span=pad)


def test_empty_chunks_are_zero_ranges():
    # response shorter than a chunk: rank 0's first chunk is all prompt
    assert zigzag_response_ranges(40, 3, 0, 2)[0] == (0, 0)
    assert zigzag_response_ranges(40, 3, 0, 2)[1] == (0, 3)


def test_cp_one_returns_the_masks_unchanged():
    masks = [torch.ones(3)]
    assert local_response_masks(masks, [5], [3], 0, 1)[0] is masks[0]


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (([torch.ones(3)], [5], [4], 0, 2), r"sample 0: loss_masks\[0\] has 3 entries"),
        (([torch.ones(3)], [5, 6], [3], 0, 2), r"1 loss_masks, 2 total_lengths"),
        (([torch.ones(3)], [5], [3], 2, 2), r"cp_rank=2"),
        (([torch.ones(6)], [5], [6], 0, 2), r"response_length=6"),
    ],
)
def test_bad_input(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        local_response_masks(*args)
