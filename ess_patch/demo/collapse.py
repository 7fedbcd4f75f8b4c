"""Moved to :mod:`ess_patch.demo.scenarios.collapse` (0.5, issue 40): this name stays an alias."""

import sys

from .scenarios import collapse as _moved

sys.modules[__name__] = _moved
