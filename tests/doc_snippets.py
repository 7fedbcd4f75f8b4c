"""The documented commands and snippets, found and prepared for tests/test_doc_snippets.py.

Blocks are found in README.md, CHANGELOG.md, every docs/**/*.md and the files those include with
``--8<-- "path"`` (pymdownx.snippets, paths from the repository root), so a page added by anyone
is tested without being registered. The conventions (docs/development.md, "Documented commands
and snippets are tests"): an HTML comment on the line just above a fence,
``<!-- snippet: setup=NAME covered-by=PATH slow requires=gpu continues -->``, says what the
block needs; ``SETUPS`` below holds the named setups.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PYTHON = {"python", "py", "python3"}
SHELL = {"bash", "sh", "shell", "console"}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
_ANNOTATION = re.compile(r"^\s*<!--\s*snippet:(?P<options>.*?)-->\s*$")
_INCLUDE = re.compile(r'^\s*--8<--\s+"(?P<path>[^"]+)"\s*$')
_OPTION_KEYS = {"setup", "covered-by", "slow", "requires", "continues"}


@dataclass
class Block:
    """One fenced block: where it is, its language, its code and its annotation."""

    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str  # "python" or "shell"
    code: str
    options: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def _options(text: str, where: str) -> dict[str, str]:
    options = {}
    for item in shlex.split(text):
        key, _, value = item.partition("=")
        if key not in _OPTION_KEYS:
            raise ValueError(f"{where}: unknown snippet option {key!r} (known: {_OPTION_KEYS})")
        options[key] = value
    return options


def blocks_of(path: Path) -> tuple[list[Block], list[Path]]:
    """The python and shell blocks of one markdown file, and the files it includes."""
    rel = path.relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    includes: list[Path] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        include = _INCLUDE.match(lines[i])
        if include:
            includes.append(ROOT / include.group("path"))
        if not fence:
            i += 1
            continue
        start, marker, indent = i, fence.group("fence"), fence.group("indent")
        lang = fence.group("lang").lower()
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(marker):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1  # the closing fence
        annotation = _ANNOTATION.match(lines[start - 1]) if start else None
        options = _options(annotation.group("options"), f"{rel}:{start}") if annotation else {}
        kind = "python" if lang in PYTHON else "shell" if lang in SHELL else None
        if kind is None:
            continue
        code = "\n".join(body) + "\n"
        if "continues" in options:
            previous = next((b for b in reversed(found) if b.lang == kind), None)
            if previous is None:
                raise ValueError(f"{rel}:{start + 1}: 'continues' with no earlier {kind} block")
            previous.code += code
            continue
        found.append(Block(rel, start + 1, kind, code, options))
    return found, includes


def documented_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def all_blocks() -> list[Block]:
    """Every block of every documented file and of the files they include (each file once)."""
    seen: set[Path] = set()
    queue = [p for p in documented_files() if p.exists()]
    out: list[Block] = []
    while queue:
        path = queue.pop(0)
        if path in seen:
            continue
        seen.add(path)
        if not path.exists():
            raise FileNotFoundError(f"an included file does not exist: {path}")
        found, includes = blocks_of(path)
        out.extend(found)
        queue.extend(includes)
    return out


# --- shell commands ----------------------------------------------------------------------------


def commands(code: str) -> list[list[str]]:
    """The commands of a shell block: ``\\`` joins lines, ``#`` starts a comment, ``&&``, ``||``,
    ``;`` and new lines separate."""
    text = re.sub(r"\\\n", " ", code)
    out: list[list[str]] = []
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        current: list[str] = []
        for token in lexer:
            if token in {"&&", "||", ";", "&", "|"}:
                if current:
                    out.append(current)
                current = []
            else:
                current.append(token)
        if current:
            out.append(current)
    return out


def split_env(tokens: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading ``NAME=value`` assignments, and the command after them."""
    env = {}
    while tokens and re.fullmatch(r"[A-Za-z_]\w*=.*", tokens[0]):
        name, _, value = tokens[0].partition("=")
        env[name] = value
        tokens = tokens[1:]
    return env, tokens


def ess_settings(tokens: list[str]) -> dict[str, str]:
    """The ``ESS_*`` variables a command sets: its leading assignments, a JSON object of
    variables (``--train-env-vars '{...}'``) and Hydra ``...env_vars.NAME=value`` overrides."""
    env, rest = split_env(tokens)
    found = {k: v for k, v in env.items() if k.startswith("ESS_")}
    for token in rest:
        if token.startswith("{") and "ESS_" in token:
            found.update({k: str(v) for k, v in json.loads(token).items() if k.startswith("ESS_")})
        hydra = re.fullmatch(r"\+?[\w.]*env_vars\.(ESS_\w+)=(.*)", token)
        if hydra:
            found[hydra.group(1)] = hydra.group(2)
    return found


def vcpo_keys(tokens: list[str]) -> dict[str, object]:
    """VCPO's ``actor.ess_scaling.<key>=value`` Hydra overrides of a verl command, with the
    values as YAML reads them (``true``, numbers)."""
    found: dict[str, object] = {}
    for token in tokens:
        match = re.fullmatch(r"\+?[\w.]*actor\.ess_scaling\.(\w+)=(.*)", token)
        if match:
            value: object = match.group(2)
            if value in ("true", "false"):
                value = value == "true"
            else:
                with contextlib.suppress(ValueError):
                    value = float(value)
            found[match.group(1)] = value
    return found


def known_variables() -> set[str]:
    """Every ``ESS_PATCH_*`` name the package, the tests or tox.ini read, and every
    ``ESS_LR_*`` variable install() knows (``config.ENV_NAMES``: ``ESS_LR_<FIELD>`` for each
    ``EssLrConfig`` field, verl's ``ESS_LR_ENABLE``, the baseline's ``ESS_LR_BASELINE*``)."""
    from ess_patch.config import ENV_NAMES

    names = set(ENV_NAMES)
    sources = [*(ROOT / "ess_patch").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    for path in [*sources, ROOT / "tox.ini"]:
        names.update(re.findall(r"\bESS_PATCH_[A-Z_]+[A-Z]\b", path.read_text(encoding="utf-8")))
    return names


# --- setups ------------------------------------------------------------------------------------

#: Python setups: code run before the snippet (the names it uses) and a check after it. The
#: snippet's optimizer steps are recorded: the LR each update applied (a hook inside the step,
#: after ess-patch scaled it) and the scheduled LR the scheduler then saw (restored).
_RECORD = """
_applied, _scheduled = [], []

def _record_applied(opt, args, kwargs):
    _applied.append([g["lr"] for g in opt.param_groups])


class _Scheduler:
    def __init__(self, inner, groups, step):
        self._inner, self._groups, self._step = inner, groups, step

    def step(self, *args, **kwargs):
        _scheduled.append([g["lr"] for g in self._groups()])
        return self._step(*args, **kwargs)
"""

_ROLLOUT = """
import torch

_gen = torch.Generator().manual_seed(0)
log_probs = [-torch.rand(n, generator=_gen) for n in (5, 3, 8, 4)]
rollout_log_probs = [lp + 0.7 * torch.randn(lp.shape, generator=_gen) for lp in log_probs]
loss_masks = [torch.ones_like(lp) for lp in log_probs]
"""

_CHECK = """
assert result.scale < 0.999, result  # a real scale, not the no-op
assert _applied and len(_applied) == len(_scheduled), (_applied, _scheduled)
# the last update ran at the scheduled LR times the last result's scale, in every param group
for applied, scheduled in zip(_applied[-1], _scheduled[-1]):
    assert abs(applied - scheduled * result.scale) <= 1e-9 * scheduled, (applied, scheduled)
"""

SETUPS: dict[str, str] = {
    # one rank of a real megatron-core optimizer (Chained[FP32Optimizer], SGD) on CPU over gloo;
    # groups of one; two micro-batches per rollout, two steps in mini_batches
    "megatron": _RECORD
    + _ROLLOUT
    + """
import contextlib
import tempfile

from megatron_cpu import (
    batch,
    build_megatron_optimizer,
    forward_backward,
    inner_optimizers,
    megatron_world,
)

from ess_patch.demo.cpu import megatron_on_cpu

_stack = contextlib.ExitStack()
_stack.enter_context(megatron_on_cpu())
_stack.enter_context(megatron_world(tempfile.mkdtemp()))
_setup = build_megatron_optimizer("fp32", optimizer="sgd")
optimizer = _setup.optimizer
for _inner in inner_optimizers(optimizer):
    _inner.optimizer.register_step_pre_hook(_record_applied)
# megatron's OptimizerParamScheduler.step takes the increment
scheduler = _Scheduler(
    _setup.scheduler,
    lambda: optimizer.param_groups,
    lambda increment=1: _setup.scheduler.step(increment=increment),
)
is_pipeline_last_stage = True
cp_group = dp_group = pp_group = None
rollout = [["micro-batch 0"], ["micro-batch 1"]]
mini_batches = [
    {"log_probs": log_probs[:2], "rollout_log_probs": rollout_log_probs[:2],
     "loss_masks": loss_masks[:2]},
    {"log_probs": log_probs[2:], "rollout_log_probs": rollout_log_probs[2:],
     "loss_masks": loss_masks[2:]},
]


def train_step(samples):
    x, y = batch(0, len(_applied))
    forward_backward(_setup, x, y)
    optimizer.step()
    scheduler.step()
"""
    + "\n#SNIPPET\n"
    + _CHECK,
    # a plain torch optimizer with a torch LR scheduler, attached to ess-patch
    "torch_optimizer": _RECORD
    + _ROLLOUT
    + """
import ess_patch

_model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(_model.parameters(), lr=0.1)
ess_patch.attach(optimizer)
optimizer.register_step_pre_hook(_record_applied)  # after attach's: sees the applied LR
_torch_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
scheduler = _Scheduler(_torch_scheduler, lambda: optimizer.param_groups, _torch_scheduler.step)
_model(torch.ones(4)).sum().backward()
"""
    + "\n#SNIPPET\n"
    + _CHECK,
}


def python_program(block: Block) -> str:
    """The block with its setup around it (``#SNIPPET`` marks where it goes)."""
    name = block.options.get("setup")
    if not name:
        return block.code
    if name not in SETUPS:
        raise KeyError(f"{block.id}: no python setup {name!r} in tests/doc_snippets.py")
    return SETUPS[name].replace("\n#SNIPPET\n", "\n" + block.code + "\n")


def _analyze_dump(tmp: Path) -> dict[str, str]:
    """A slime train-data dump (the gathered format) of three rollouts."""
    from analyze_data import SIGMAS, make_rollout, save_slime_dump

    folder = tmp / "train_data"
    folder.mkdir()
    for rid, sigma in enumerate(SIGMAS[:3]):
        samples = make_rollout(rid, sigma)
        save_slime_dump(folder / f"{rid}_0.pt", rid, samples)
    return {"/path/to/dump_details/train_data": str(folder)}


#: Shell setups: given a temporary folder, the placeholders of the block and what replaces them.
SHELL_SETUPS: dict[str, Callable[[Path], dict[str, str]]] = {"analyze_dump": _analyze_dump}

#: a placeholder the reader fills in: only a setup can run such a command
PLACEHOLDER = re.compile(r"/path/to/|<[^>]+>|(?:^|\s)\.\.\.(?:\s|$)")
