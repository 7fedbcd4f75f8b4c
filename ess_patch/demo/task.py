"""The demo's verifiable task: digit strings to sort, reverse or add, with partial credit.

A prompt is ``[TASK, d_1 .. d_n, SEP]`` (for "add": ``[TASK, a_1 .. a_n, b_1 .. b_n, SEP]``,
least significant digit first) and the answer is ``n`` digits: the prompt's digits sorted
ascending, reversed, or ``(a + b) mod 10**n`` (least significant first). ``n`` is the
response length (a setting, 16 to 256). The reward of a response is the fraction of its
positions that hold the right digit, in [0, 1]: partial credit, so a policy that learns part
of the structure (e.g. that a sorted answer starts with small digits) is rewarded for it. A
uniform policy scores 0.1.

Pure torch; the token ids fit the policy's vocabulary (:data:`VOCAB`).
"""

from __future__ import annotations

import torch

from ..errors import EssPatchValueError

__all__ = [
    "DIGITS",
    "SEP",
    "TASKS",
    "VOCAB",
    "make_prompts",
    "prompt_length",
    "rewards",
    "targets",
]

TASKS = ("sort", "reverse", "add")
DIGITS = 10
SEP = 10
_MARKER = {"sort": 11, "reverse": 12, "add": 13}
#: Token ids 0-9 are digits, 10 separates prompt and answer, 11-13 name the task; 16 keeps
#: the vocabulary divisible by every tensor-parallel size the demo offers (1, 2, 4).
VOCAB = 16


def _check(task: str, n: int) -> None:
    if task not in TASKS:
        raise EssPatchValueError(f"task={task!r}: give one of {TASKS}")
    if n < 1:
        raise EssPatchValueError(f"response length {n} must be >= 1")


def prompt_length(task: str, n: int) -> int:
    """Tokens in a prompt whose answer has ``n`` digits."""
    _check(task, n)
    return 2 * n + 2 if task == "add" else n + 2


def make_prompts(task: str, n: int, batch: int, generator: torch.Generator) -> torch.Tensor:
    """``batch`` random prompts, ``[batch, prompt_length(task, n)]`` long."""
    _check(task, n)
    width = 2 * n if task == "add" else n
    digits = torch.randint(0, DIGITS, (batch, width), generator=generator)
    marker = torch.full((batch, 1), _MARKER[task], dtype=torch.long)
    sep = torch.full((batch, 1), SEP, dtype=torch.long)
    return torch.cat([marker, digits, sep], dim=1)


def targets(task: str, prompts: torch.Tensor, n: int) -> torch.Tensor:
    """The right answer of each prompt, ``[batch, n]`` long."""
    _check(task, n)
    digits = prompts[:, 1:-1]
    if task == "sort":
        return digits.sort(dim=1).values
    if task == "reverse":
        return digits.flip(1)
    a, b = digits[:, :n], digits[:, n:]
    out = torch.empty_like(a)
    carry = torch.zeros(a.shape[0], dtype=torch.long, device=a.device)
    for i in range(n):  # little-endian: position 0 is the least significant digit
        s = a[:, i] + b[:, i] + carry
        out[:, i], carry = s % DIGITS, s // DIGITS
    return out


def rewards(responses: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """Fraction of positions where ``responses`` matches ``answer``, per row (float32)."""
    if responses.shape != answer.shape:
        raise EssPatchValueError(
            f"responses {tuple(responses.shape)} vs answers {tuple(answer.shape)}"
        )
    return (responses == answer).float().mean(dim=1)
