"""``thd_attention.ThdDotProductAttention``, the CPU counterpart of TE's THD attention that the
verl baseline tests train through: a packed row gives each sequence the logits of its own
forward alone (what TE computes for ``qkv_format='thd'``), padding between the sequences
included; verl's padded form (a ``[b, s]`` padding mask) gives the unpadded rows' logits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture
def model():
    from verl_baseline_rank import PROMPT_W, RESP_W, VOCAB, gpt_model

    from ess_patch.demo.cpu import megatron_on_cpu
    from ess_patch.demo.policy import single_process

    with single_process(), megatron_on_cpu():
        yield gpt_model(), VOCAB, PROMPT_W + RESP_W


def _alone(net, tokens):
    return net(tokens[None], torch.arange(tokens.numel())[None], None)[0]


def test_a_packed_row_with_padding_gives_each_sequence_its_own_logits(model):
    from megatron.core.packed_seq_params import PackedSeqParams

    net, vocab, _ = model
    gen = torch.Generator().manual_seed(3)
    lengths, padded = [5, 3, 6], [6, 4, 6]  # each sequence padded to an even length, as TP2
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    row = torch.zeros(sum(padded), dtype=torch.long)
    starts = torch.tensor([0, *padded]).cumsum(0)
    for s, start in zip(seqs, starts.tolist(), strict=False):
        row[start : start + s.numel()] = s
    real = torch.tensor([0, *lengths]).cumsum(0).int()
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=real,
        cu_seqlens_kv=real,
        cu_seqlens_q_padded=starts.int(),
        cu_seqlens_kv_padded=starts.int(),
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
    )
    out = net(row[None], None, None, packed_seq_params=params)[0]
    for s, start in zip(seqs, starts.tolist(), strict=False):
        want = _alone(net, s)
        assert torch.allclose(out[start : start + s.numel()], want, rtol=1e-5, atol=1e-5)
    # the check can fail: one causal mask over the whole row lets sequence 2 see sequence 1
    causal = ~torch.ones(row.numel(), row.numel(), dtype=torch.bool).tril()[None, None]
    seen = net(row[None], torch.arange(row.numel())[None], causal)[0]
    second = slice(int(starts[1]), int(starts[1]) + lengths[1])
    assert not torch.allclose(seen[second], _alone(net, seqs[1]), rtol=1e-3, atol=1e-3)


def test_the_padded_form_gives_the_unpadded_rows_logits(model):
    net, vocab, width = model
    gen = torch.Generator().manual_seed(4)
    lengths = [width, 4]
    rows = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.bool)
    for k, n in enumerate(lengths):
        rows[k, :n] = torch.randint(0, vocab, (n,), generator=gen)
        mask[k, :n] = True
    out = net(rows, torch.arange(width)[None].expand(2, -1), mask)
    for k, n in enumerate(lengths):
        assert torch.allclose(out[k, :n], _alone(net, rows[k, :n]), rtol=1e-5, atol=1e-5)


def test_offsets_that_do_not_cover_the_row_are_refused():
    from thd_attention import block_causal_mask

    with pytest.raises(ValueError, match="ends at 5"):
        block_causal_mask(torch.tensor([0, 5]), 6)
    with pytest.raises(ValueError, match="start at 0"):
        block_causal_mask(torch.tensor([1, 6]), 6)
