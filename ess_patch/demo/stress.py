"""Moved to :mod:`ess_patch.demo.scenarios.stress` (0.5, issue 40): this name stays an alias."""

import sys

from .scenarios import stress as _moved

sys.modules[__name__] = _moved
