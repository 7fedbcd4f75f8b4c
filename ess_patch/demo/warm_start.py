"""A short supervised warm start of the demo's policy, cached by its settings.

RL post-training starts from a competent, sharp policy (an instruct model), not from a random
one. :func:`ensure` trains the demo's ``GPTModel`` (from the run's seed, whole model, TP = PP =
1) with cross-entropy on the task's right answers (teacher forcing) for a few hundred Adam
steps, measures the sampled reward and per-token entropy of the result with the bf16 rollout
engine, and saves the whole-model state dict under a name that is a hash of every setting
(:meth:`WarmStart.key`). A second call with the same settings loads nothing and trains
nothing: it returns the cached file. Every pipeline / tensor-parallel layout of the demo loads
that same file (``DemoConfig.init_weights``; ``train._load_init`` cuts this rank's slices).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import EssPatchValueError
from . import task as task_mod
from .policy import PolicySpec

__all__ = ["WarmStart", "default_cache_dir", "ensure"]

logger = logging.getLogger(__name__)

#: Bump when the training below changes: cached files of another version are not reused.
VERSION = 1
#: Prompts the result is measured on (sampled at temperature 1, as RL samples).
EVAL_PROMPTS = 256


@dataclass(frozen=True)
class WarmStart:
    """Every setting the warm-started weights depend on."""

    task: str
    response_len: int
    num_layers: int
    hidden: int
    seed: int
    steps: int = 300
    lr: float = 1e-3
    batch: int = 64

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch < 1 or not self.lr > 0:
            raise EssPatchValueError(
                f"WarmStart: steps >= 0, batch >= 1 and lr > 0 needed, got {self}"
            )

    def spec(self) -> PolicySpec:
        n = self.response_len
        return PolicySpec(
            num_layers=self.num_layers,
            hidden=self.hidden,
            max_len=task_mod.prompt_length(self.task, n) + n,
        )

    def key(self) -> str:
        """A hash of the settings, the torch version and :data:`VERSION`."""
        text = json.dumps(
            {**asdict(self), "version": VERSION, "torch": torch.__version__}, sort_keys=True
        )
        return hashlib.sha256(text.encode()).hexdigest()[:20]


def default_cache_dir() -> Path:
    """``$ESS_PATCH_CACHE/warm-start``, else ``$XDG_CACHE_HOME`` (or ``~/.cache``)/ess-patch/..."""
    root = os.environ.get("ESS_PATCH_CACHE")
    if root:
        return Path(root) / "warm-start"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ess-patch" / "warm-start"


def ensure(ws: WarmStart, cache_dir: str | Path | None = None) -> tuple[Path, dict[str, Any]]:
    """The cached weights of ``ws`` (trained now if absent) and their measurements.

    Returns ``(path of the state dict, {"reward", "entropy", "start_reward", "trained"})``.
    Safe for concurrent callers: the file is written under a temporary name and renamed.
    """
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"warm-{ws.key()}.pt"
    meta_path = path.with_suffix(".json")
    if path.is_file() and meta_path.is_file():
        return path, {**json.loads(meta_path.read_text()), "trained": False}
    weights, meta = _train(ws)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save(weights, tmp)
    os.replace(tmp, path)
    tmp_meta = meta_path.with_name(f"{meta_path.name}.{os.getpid()}.tmp")
    tmp_meta.write_text(json.dumps({**meta, "settings": asdict(ws)}, indent=2) + "\n")
    os.replace(tmp_meta, meta_path)
    logger.info(
        "warm start %s: reward %.3f entropy %.3f", path.name, meta["reward"], meta["entropy"]
    )
    return path, {**meta, "trained": True}


def _measure(model: Any, ws: WarmStart, gen_seed: int) -> tuple[float, float]:
    """Sampled reward and per-token entropy of ``model`` (bf16 engine, temperature 1)."""
    from .policy import RolloutEngine, global_weights, train_inputs

    engine = RolloutEngine(ws.spec())
    engine.load(global_weights(model))
    gen = torch.Generator().manual_seed(gen_seed)
    prompts = task_mod.make_prompts(ws.task, ws.response_len, EVAL_PROMPTS, gen)
    out = engine.sample(prompts, ws.response_len, gen)
    reward = task_mod.rewards(out.tokens, task_mod.targets(ws.task, prompts, ws.response_len))
    with torch.no_grad():
        ids, pos = train_inputs(prompts, out.tokens)
        logits = model(ids, pos, None, runtime_gather_output=True)[:, -ws.response_len :]
        lsm = torch.log_softmax(logits.float(), dim=-1)
        entropy = -(lsm.exp() * lsm).sum(-1).mean()
    return float(reward.mean()), float(entropy)


def _train(ws: WarmStart) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Cross-entropy on the right answers from the seed's initial weights (one process)."""
    from .policy import build_policy, global_weights, single_process, train_logprobs

    with single_process():
        torch.manual_seed(ws.seed)  # the same initial weights as the demo's ranks draw
        model = build_policy(ws.spec())
        start_reward, _ = _measure(model, ws, ws.seed * 7 + 1)
        opt = torch.optim.Adam(model.parameters(), lr=ws.lr)
        gen = torch.Generator().manual_seed(ws.seed * 1_000_003 + 7919)
        for _ in range(ws.steps):
            prompts = task_mod.make_prompts(ws.task, ws.response_len, ws.batch, gen)
            answer = task_mod.targets(ws.task, prompts, ws.response_len)
            loss = -train_logprobs(model, prompts, answer).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        reward, entropy = _measure(model, ws, ws.seed * 7 + 2)
        weights = {k: v for k, v in global_weights(model).items() if isinstance(v, torch.Tensor)}
    return weights, {"reward": reward, "entropy": entropy, "start_reward": start_reward}
