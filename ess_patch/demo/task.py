"""The demo's tiny policy and environment (pure torch, no downloads).

Environment: a prompt names one of ``NUM_TASKS`` tasks; the policy answers with
``RESPONSE_LEN`` tokens from a vocabulary of ``VOCAB``. Each task has a hidden target
sequence (drawn once from the seed); the reward is the fraction of response tokens that
match it, in [0, 1]. A uniform policy scores ``1 / VOCAB`` on average, a perfect one 1.

Policy: an autoregressive, position-wise network. The logits of response token t depend on
the task, the position t and the previous token (embeddings summed), through
``NUM_BLOCKS`` residual tanh blocks and a linear head. There is no attention, so a
context-parallel rank computes the log-probs of the tokens of its zigzag chunk locally
(the CP collectives the demo exercises are the gradient reduction and the ESS reduction).
The network is a list of parts ``[embed, block_1 .. block_n, head]`` so that pipeline
stages can own contiguous slices of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "HIDDEN",
    "NUM_BLOCKS",
    "NUM_TASKS",
    "PROMPT_LEN",
    "RESPONSE_LEN",
    "VOCAB",
    "Batch",
    "PolicyNet",
    "Stage",
    "logits_from_params",
    "make_targets",
    "rewards",
    "sample_rollouts",
    "stage_bounds",
]

VOCAB = 8
NUM_TASKS = 8
PROMPT_LEN = 4
RESPONSE_LEN = 12
HIDDEN = 32
NUM_BLOCKS = 2
#: ``prev`` index of the first response token (no previous response token yet).
START = VOCAB


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.task = nn.Embedding(NUM_TASKS, HIDDEN)
        self.pos = nn.Embedding(RESPONSE_LEN, HIDDEN)
        self.prev = nn.Embedding(VOCAB + 1, HIDDEN)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs``: ``[N, 3]`` long tensor of (task, position, previous token)."""
        return self.task(inputs[:, 0]) + self.pos(inputs[:, 1]) + self.prev(inputs[:, 2])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, VOCAB)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h)


class PolicyNet(nn.Module):
    """The whole policy: ``parts = [Embed, Block * NUM_BLOCKS, Head]``."""

    def __init__(self) -> None:
        super().__init__()
        self.parts = nn.ModuleList([Embed(), *(Block() for _ in range(NUM_BLOCKS)), Head()])
        with torch.no_grad():  # a near-uniform start: reward ~ 1 / VOCAB
            self.parts[-1].lin.weight.mul_(0.1)
            self.parts[-1].lin.bias.zero_()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        h = inputs
        for part in self.parts:
            h = part(h)
        return h


class Stage(nn.Module):
    """The parts ``[lo, hi)`` of a :class:`PolicyNet` (shares its parameters)."""

    def __init__(self, net: PolicyNet, lo: int, hi: int) -> None:
        super().__init__()
        self.lo, self.hi = lo, hi
        self.parts = nn.ModuleList(net.parts[lo:hi])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in self.parts:
            x = part(x)
        return x


def stage_bounds(num_parts: int, pp: int) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` slices of ``num_parts`` parts for ``pp`` stages (as even as can be).

    Raises:
        ValueError: more stages than parts.
    """
    if not 1 <= pp <= num_parts:
        raise ValueError(f"pipeline size {pp} must be in [1, {num_parts}] (the policy's parts)")
    base, extra = divmod(num_parts, pp)
    bounds, lo = [], 0
    for s in range(pp):
        hi = lo + base + (1 if s < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def logits_from_params(params: Mapping[str, torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
    """:meth:`PolicyNet.forward` from a ``state_dict``-like mapping (the rollout engine)."""
    h = (
        params["parts.0.task.weight"][inputs[:, 0]]
        + params["parts.0.pos.weight"][inputs[:, 1]]
        + params["parts.0.prev.weight"][inputs[:, 2]]
    )
    for k in range(1, NUM_BLOCKS + 1):
        h = h + torch.tanh(
            F.linear(h, params[f"parts.{k}.lin.weight"], params[f"parts.{k}.lin.bias"])
        )
    head = NUM_BLOCKS + 1
    return F.linear(h, params[f"parts.{head}.lin.weight"], params[f"parts.{head}.lin.bias"])


def make_targets(seed: int) -> torch.Tensor:
    """The hidden target sequence of every task: ``[NUM_TASKS, RESPONSE_LEN]``."""
    gen = torch.Generator().manual_seed(seed * 7919 + 17)
    return torch.randint(0, VOCAB, (NUM_TASKS, RESPONSE_LEN), generator=gen)


def rewards(tasks: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Fraction of response tokens equal to the task's target, per trajectory."""
    return (tokens == targets[tasks]).float().mean(dim=1)


@dataclass
class Batch:
    """One data-parallel rank's rollout (identical on its CP and PP peers)."""

    tasks: torch.Tensor  # [B] long
    tokens: torch.Tensor  # [B, RESPONSE_LEN] long
    rollout_logp: torch.Tensor  # [B, RESPONSE_LEN] float32: the sampling policy's log-probs
    lags: torch.Tensor  # [B] long: how many updates behind the trainer its policy was
    rewards: torch.Tensor  # [B] float32
    advantages: torch.Tensor  # [B] float32


@torch.no_grad()
def sample_rollouts(
    versions: Sequence[Mapping[str, torch.Tensor]],
    lags: torch.Tensor,
    tasks: torch.Tensor,
    targets: torch.Tensor,
    group_size: int,
    gen: torch.Generator,
) -> Batch:
    """Sample one response per task entry from the policy version ``lags[b]`` steps old.

    ``versions[-1]`` is the current policy and ``versions[-1 - k]`` the one k updates older.
    Advantages are group-relative: reward minus the mean of its ``group_size`` consecutive
    samples (the same prompt), as in GRPO without the std normalisation.
    """
    n = tasks.shape[0]
    tokens = torch.zeros(n, RESPONSE_LEN, dtype=torch.long)
    logp = torch.zeros(n, RESPONSE_LEN)
    for lag in lags.unique().tolist():
        rows = (lags == lag).nonzero().flatten()
        params = versions[-1 - lag]
        prev = torch.full((rows.numel(),), START, dtype=torch.long)
        for t in range(RESPONSE_LEN):
            pos = torch.full_like(prev, t)
            inputs = torch.stack([tasks[rows], pos, prev], dim=1)
            log_probs = torch.log_softmax(logits_from_params(params, inputs).float(), dim=-1)
            tok = torch.multinomial(log_probs.exp(), 1, generator=gen).flatten()
            tokens[rows, t] = tok
            logp[rows, t] = log_probs.gather(1, tok[:, None]).flatten()
            prev = tok
    r = rewards(tasks, tokens, targets)
    baseline = r.view(-1, group_size).mean(dim=1, keepdim=True)
    adv = (r.view(-1, group_size) - baseline).flatten()
    return Batch(tasks, tokens, logp, lags, r, adv)
