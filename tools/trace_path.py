"""Follow a rollout's log-probs from a framework hook to the applied LR, and count the detours.

Usage: ``python tools/trace_path.py`` (from the repository root; prints a table).

The layers are the package's own import graph: a module's level is one more than the highest
level of the ess_patch modules it imports (anywhere in its file, lazy imports included), so
the math sits at the bottom and the integrations near the top. The path is recorded with
``sys.setprofile`` while one process runs, through the real miles/slime hook machinery
(``rl_hooks.advantage_wrapper`` on a one-rank ``Framework``) and a real torch optimizer
``attach``-ed to ess-patch:

- ``rollout``: granularity rollout, log-probs at the advantage hook, one ``optimizer.step()``;
- ``step``: granularity step, the hook starts the per-step ledger, one policy-loss call adds
  the step's samples (``loss_ledger.policy_loss_wrapper`` around a stand-in loss that calls
  the wrapped ``get_log_probs_and_entropy``), one ``optimizer.step()`` decides and applies.

Counted on the sequence of ess_patch modules control passes through (consecutive repeats
collapsed): *returns*, entries into a module the path had already left (a callee returning
included); *re-entries*, those of them that are calls (control sent back into a module it had
finished with); *climbs*, calls from a module into one of a higher level (a callback up the
layering), with the largest such jump. ``tests/test_layering.py`` holds the bounds.
"""

from __future__ import annotations

import ast
import itertools
import sys
from argparse import Namespace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ess_patch"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> set[str]:
    """The ess_patch modules ``path`` imports (relative or absolute, at any depth)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.startswith("ess_patch"):
                found.add(target)
                found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ess_patch"))
    return found


def levels() -> dict[str, int]:
    """Level of every ess_patch module (1 = imports no other ess_patch module)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    deps = {
        name: {d for d in _imports(path, name) if d in files and d != name}
        for name, path in files.items()
    }
    # a package's __init__ that re-exports is not a layer of its own: drop it as a dependency
    deps = {n: {d for d in ds if files[d].name != "__init__.py"} for n, ds in deps.items()}
    out: dict[str, int] = {}

    def level(name: str, seen: tuple[str, ...] = ()) -> int:
        if name in out:
            return out[name]
        if name in seen:  # an import cycle: report it, count the module once
            print(f"cycle: {' -> '.join((*seen, name))}", file=sys.stderr)
            return 0
        value = 1 + max((level(d, (*seen, name)) for d in deps[name]), default=0)
        out[name] = value
        return value

    for name in files:
        level(name)
    return out


def _ess_module(frame) -> str | None:
    """The ess_patch module of the nearest frame at or above ``frame``."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("ess_patch"):
            return name
        frame = frame.f_back
    return None


def record(run) -> list[tuple[str, str, str | None]]:
    """``(event, module, caller)`` for every call into and return out of an ess_patch frame
    while ``run()`` runs (``caller``: the ess_patch module the call came from, None for an
    entry from outside the package, e.g. torch calling an optimizer hook)."""
    events: list[tuple[str, str, str | None]] = []

    def profile(frame, event, _arg):
        if event not in ("call", "return"):
            return
        if not frame.f_globals.get("__name__", "").startswith("ess_patch"):
            return
        back = _ess_module(frame.f_back)
        if event == "call":
            events.append(("call", frame.f_globals["__name__"], back))
        elif back is not None:
            events.append(("return", back, None))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return events


def count(events: list[tuple[str, str, str | None]], level: dict[str, int]) -> dict:
    path: list[tuple[str, str, str | None]] = []
    for event in events:
        if not path or path[-1][1] != event[1]:
            path.append(event)
    left: set[str] = set()
    returns = reentries = climbs = widest = 0
    for (_, prev, _), (event, module, caller) in itertools.pairwise(path):
        left.add(prev)
        if module in left:
            returns += 1
            reentries += event == "call"
        if event == "call" and caller is not None and level[module] > level[caller]:
            climbs += 1
            widest = max(widest, level[module] - level[caller])
    modules = list(dict.fromkeys(m for _, m, _ in path))
    return {
        "modules": len(modules),
        "hops": len(path) - 1,
        "returns": returns,
        "re-entries": reentries,
        "climbs": climbs,
        "widest climb": widest,
        "path": " > ".join(m.removeprefix("ess_patch.") for _, m, _ in path),
    }


def rollout() -> dict:
    """The traced rollout: 4 trajectories of 8 tokens, fixed seed."""
    import torch

    gen = torch.Generator().manual_seed(0)
    lp = [torch.randn(8, generator=gen) - 2 for _ in range(4)]
    rlp = [x + 0.5 * torch.randn(8, generator=gen) for x in lp]
    masks = [torch.ones(8, dtype=torch.int64) for _ in range(4)]
    return {"log_probs": lp, "rollout_log_probs": rlp, "loss_masks": masks}


def scenarios():
    import torch

    import ess_patch
    from ess_patch.estimator import trajectory_stats  # noqa: F401  (warm the imports)
    from ess_patch.integrations import loss_ledger
    from ess_patch.integrations.rl_hooks import Framework, Groups, advantage_wrapper
    from ess_patch.state import reset

    data = rollout()
    lp, rlp, masks = (data[k] for k in ("log_probs", "rollout_log_probs", "loss_masks"))
    options = {}
    if "step_samples" in Framework.__dataclass_fields__:  # ess-patch 0.1: a split at the hook
        options["step_samples"] = lambda args, rollout_data, dp_size: [[0, 1, 2, 3]]
    framework = Framework(
        name="trace",
        groups=lambda: Groups(None, 0, 1, None, None, True),
        no_input_reason=lambda args: None,
        unsupported_reason=lambda args: None,
        measure_in_loss=lambda args, rollout_data: None,
        **options,
    )

    def one(granularity: str):
        def fresh():
            reset()
            param = torch.nn.Parameter(torch.zeros(2))
            return param, ess_patch.attach(torch.optim.SGD([param], lr=1.0))

        args = Namespace(use_ess_lr=True, ess_lr_granularity=granularity, loss_type="policy_loss")
        hook = advantage_wrapper(framework)

        def get_log_probs_and_entropy(*_a, **_k):
            return {"log_probs": lp}

        def policy_loss_function(args, batch, logits, sum_of_sample_mean):
            loss_ledger.log_probs_wrapper(get_log_probs_and_entropy, None, (), {})
            return torch.zeros(())

        def run(param, optimizer, applied):
            hook(lambda args, rollout_data: None, None, (args, data), {})
            batch = {"rollout_log_probs": rlp, "loss_masks": masks}
            if granularity == "step":
                loss_ledger.policy_loss_wrapper(
                    policy_loss_function, None, (args, batch, None, None), {}
                )
            param.grad = torch.ones(2)
            optimizer.step()
            applied.append(float(-param.detach()[0]))  # SGD: the step is the applied LR

        run(*fresh(), [])  # warm: first calls import lazily
        param, optimizer = fresh()
        applied: list[float] = []
        events = record(lambda: run(param, optimizer, applied))
        ess_patch.detach(optimizer)
        return events, applied[0]

    return {"rollout": one("rollout"), "step": one("step")}


def trace() -> dict[str, dict]:
    """Each scenario's counts, its path and the LR its ``optimizer.step()`` applied."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    level = levels()
    out = {}
    for name, (events, applied) in scenarios().items():
        out[name] = {**count(events, level), "applied lr": applied}
    return out


def main() -> None:
    results = trace()
    print("| path | modules | hops | returns | re-entries | climbs | widest climb | applied LR |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['modules']} | {r['hops']} | {r['returns']} | {r['re-entries']} | "
            f"{r['climbs']} | {r['widest climb']} | {r['applied lr']:.6f} |"
        )
    for name, r in results.items():
        print(f"\n{name}: {r['path']}")


if __name__ == "__main__":
    main()
