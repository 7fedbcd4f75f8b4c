"""``ess-patch analyze``: what ESS-LR would have done on a run, from its train-data dumps.

Layers (one job each): :mod:`.read` loads one dump file safely and says what it is,
:mod:`.assemble` groups files by rollout and rebuilds each rollout's trajectories across
ranks and CP slices, :mod:`.report` turns them into per-setting results, a CSV, a summary
table and a figure.
"""

from __future__ import annotations

from .read import DumpError
from .report import Setting, analyze, default_settings

__all__ = ["DumpError", "Setting", "analyze", "default_settings"]
