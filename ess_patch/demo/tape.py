"""Record a run's sampled tokens, or replay them teacher-forced in another layout.

Tensor parallelism splits the bf16 rollout engine's matmuls, which changes their rounding;
at a sharp policy one sampled token can then flip, and two layouts' rewards differ for a
reason that has nothing to do with the layout's correctness. A run that replays another
run's tokens samples nothing: the engine scores the recorded tokens (the same KV-cache pass,
teacher-forced), so the rewards are the recorded run's by construction and every log-prob
is comparable at float32 tolerance.

One file per arm, step and data-parallel rank (``{arm}-{step}-dp{rank}.pt``), a plain dict
of tensors read back with ``weights_only=True``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import EssPatchError

__all__ = ["TAPE_MODES", "RolloutTape", "TapeError"]

TAPE_MODES = ("record", "replay")


class TapeError(EssPatchError, FileNotFoundError):
    """A replayed run asks for a step the tape does not hold (or holds in another shape)."""


class RolloutTape:
    """One arm's tape on one rank: ``record()`` on the recording run, ``tokens()`` on a replay."""

    def __init__(self, directory: str, mode: str, arm: str, dp_rank: int, writes: bool) -> None:
        self.directory, self.mode, self.arm = Path(directory), mode, arm
        self.dp_rank = dp_rank
        # the ranks of a TP group and the PP stages all sample the same tokens: one writes
        self.writes = writes

    @property
    def replaying(self) -> bool:
        return self.mode == "replay"

    def _path(self, step: int) -> Path:
        return self.directory / f"{self.arm}-{step}-dp{self.dp_rank}.pt"

    def record(self, step: int, tokens: torch.Tensor) -> None:
        """Keep this rank's sampled tokens of ``step`` (recording run, one rank per DP rank)."""
        if self.mode != "record" or not self.writes:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self._path(step).with_suffix(".tmp")
        torch.save({"tokens": tokens.detach().cpu()}, tmp)
        tmp.replace(self._path(step))

    def tokens(self, step: int, shape: tuple[int, int]) -> torch.Tensor:
        """The recorded tokens of ``step`` (``shape``: this rank's rows x response length).

        Raises:
            TapeError: no file for this arm, step and DP rank, or one of another shape: the
                replay needs the recording's arms, steps, dp, prompts and response length.
        """
        path = self._path(step)
        if not path.is_file():
            raise TapeError(
                f"rollout tape {self.directory}: no {path.name} (arm {self.arm!r}, step {step}, "
                f"DP rank {self.dp_rank}); record it with the same arms, steps and dp first"
            )
        data = torch.load(path, weights_only=True)
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, torch.Tensor) or tuple(tokens.shape) != tuple(shape):
            got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(data).__name__
            raise TapeError(
                f"rollout tape {path}: holds tokens of shape {got}, this run needs {shape} "
                "(the same prompts_per_rank, group_size and response_len as the recording)"
            )
        return tokens.long()
