"""``ess-patch doctor``: what is installed, what would be patched, and what is wrong."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import site
import sys
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from .autoinstall import ENV as AUTO_ENV
from .autoinstall import requested
from .config import EssLrConfig
from .install import INTEGRATIONS, failed_integrations, is_installed
from .integrations.registry import COMPONENTS, component
from .integrations.shapes import History
from .patching import MISSING, UNWRAPPED, VENDORED, WRAPPED, MissingTargetError, target_status

__all__ = ["MINIMUM_VERSIONS", "Report", "collect", "findable", "render"]

PTH = "ess_patch-autoinstall.pth"
#: The oldest versions ess-patch supports: pyproject's ``dependencies`` lower bounds
#: (tests/test_packaging.py checks that the two agree).
MINIMUM_VERSIONS = {"torch": "2.1", "wrapt": "1.16"}


@dataclass
class Report:
    """Lines to show, and the problems among them (each a full sentence with the fix)."""

    sections: dict[str, list[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def add(self, section: str, line: str) -> None:
        self.sections.setdefault(section, []).append(line)

    def problem(self, section: str, line: str) -> None:
        self.add(section, f"PROBLEM {line}")
        self.problems.append(line)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def findable(module: str) -> bool:
    """Whether ``module`` can be imported here (found without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _versions(report: Report) -> None:
    section = "versions"
    report.add(section, f"python        {platform.python_version()} ({sys.executable})")
    core = component("megatron")  # the library every integration's optimizers come from
    for dist in ("ess-patch", "torch", "wrapt", core.integration.distribution):
        found = _version(dist)
        if found is None:
            if dist == core.integration.distribution and findable(core.detector):
                report.add(
                    section,
                    f"{dist:<13} not a distribution (a vendored tree: "
                    f"{importlib.util.find_spec(core.detector).origin})",
                )
            elif dist == core.integration.distribution:
                report.problem(
                    section,
                    f"{dist} is not installed: nothing for install() to "
                    "patch (pip install 'ess-patch[megatron]')",
                )
            else:
                report.problem(section, f"{dist} is not installed (pip install {dist})")
            continue
        report.add(section, f"{dist:<13} {found}")
        minimum = MINIMUM_VERSIONS.get(dist)
        if minimum and _older(found, minimum):
            report.problem(
                section,
                f"{dist} {found} is older than {minimum}, the oldest ess-patch "
                f"supports (pip install -U '{dist}>={minimum}')",
            )
        if dist == core.integration.distribution and not core.integration.supports(found):
            report.problem(
                section,
                f"{dist} {found} is outside the supported range "
                f"{core.integration.supported}; use a supported release or the patches/ "
                "series for your version",
            )
    # the components that are source trees, not distributions: where they import from
    for row in COMPONENTS:
        if row.integration.distribution is not None:
            continue
        name = row.detector
        spec = importlib.util.find_spec(name) if findable(name) else None
        location = (
            spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else None
        )
        report.add(section, f"{name:<13} {'importable from ' + location if location else 'absent'}")


def _targets(report: Report) -> None:
    for name, integration in INTEGRATIONS.items():
        section = f"targets: {name} ({integration.supported})"
        # Two levels: "megatron" alone is findable wherever megatron-core is, megatron.rl not.
        top = ".".join(integration.modules[0].split(".")[:2])
        if not findable(top):
            report.add(section, f"-- {top} is not importable here; nothing to patch")
            continue
        for target in integration.targets:
            try:
                importlib.import_module(target.module)
            except ImportError as exc:
                state = f"module not importable ({exc.name or exc})"
                if target.required and not _optional_module(target.module):
                    report.problem(
                        section,
                        f"{target.path}: {state}; install the framework's "
                        "dependencies in this environment",
                    )
                else:
                    report.add(section, f"-- {target.path}: {state}")
                continue
            except Exception as exc:  # a framework module failing at import time
                report.problem(
                    section,
                    f"{target.path}: importing {target.module} raised {type(exc).__name__}: {exc}",
                )
                continue
            status = target_status(target)
            if status == MISSING and target.required:
                report.problem(
                    section, f"{target.path} is missing; supported: {integration.supported}"
                )
            elif status == UNWRAPPED and name in failed_integrations():
                report.add(section, f"-- {target.path}: not wrapped ({name} was rolled back)")
            else:
                report.add(section, _STATUS_LINE[status].format(path=target.path))
        if integration.history is not None:
            _shape(report, section, integration.history)


_STATUS_LINE = {
    MISSING: "-- {path}: not in this version (optional)",
    VENDORED: "ok {path}: vendored diff applied (install() skips it)",
    WRAPPED: "ok {path}: wrapped by install() in this process",
    UNWRAPPED: "ok {path}: install() would wrap it",
}


def _shape(report: Report, section: str, history: History) -> None:
    """The framework's shape here (groups, hook, metrics), as install() would choose it."""
    try:
        history.choose_all()
    except MissingTargetError as exc:
        report.problem(section, str(exc))
        return
    except Exception as exc:  # a host module failing at import time (reported above too)
        report.add(section, f"-- shape not decided: {type(exc).__name__}: {exc}")
        return
    report.add(section, f"supported: {history.supported}")
    report.add(section, f"shape: {history.describe()}")


def _optional_module(module: str) -> bool:
    # the layer-wise optimizer module only exists from megatron-core 0.16
    return module.endswith("layer_wise_optimizer")


def _activation(report: Report) -> None:
    section = "activation"
    pth = [Path(d) / PTH for d in site.getsitepackages() if (Path(d) / PTH).exists()]
    wanted = requested()
    report.add(section, f"installed in this process: {'yes' if is_installed() else 'no'}")
    for reason in failed_integrations().values():
        # an integration rolled back when a library imported after install() lacked a symbol
        report.problem(section, f"{reason} (rolled back at import; the others stay installed)")
    report.add(
        section,
        f"{AUTO_ENV}={os.environ.get(AUTO_ENV, '')!r} ({'on' if wanted is not None else 'off'})",
    )
    if pth:
        report.add(section, f"auto-install hook: {pth[0]}")
    elif wanted is not None:
        report.problem(
            section,
            f"{AUTO_ENV} is set but {PTH} is not in site-packages (an "
            "editable install does not ship it): reinstall with "
            "`pip install .` or call ess_patch.install() yourself",
        )
    else:
        report.add(section, f"auto-install hook: {PTH} not found (editable install?)")
    try:
        config = EssLrConfig.from_env()
        report.add(section, f"config from ESS_LR_* environment: {config}")
    except ValueError as exc:
        report.problem(section, f"ESS_LR_* environment: {exc}")


def _older(found: str, minimum: str) -> bool:
    try:
        return Version(found.split("+")[0]) < Version(minimum)
    except InvalidVersion:
        return False


def collect() -> Report:
    """Inspect this environment (imports the host libraries that are present)."""
    report = Report()
    _versions(report)
    _targets(report)
    _activation(report)
    return report


def render(report: Report) -> str:
    lines = []
    for section, entries in report.sections.items():
        lines.append(f"[{section}]")
        lines.extend(f"  {entry}" for entry in entries)
    lines.append("")
    if report.problems:
        lines.append(f"{len(report.problems)} problem(s):")
        lines.extend(f"- {p}" for p in report.problems)
    else:
        lines.append("no problems found")
    return "\n".join(lines)
