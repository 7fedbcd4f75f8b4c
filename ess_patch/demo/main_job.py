"""Moved to :mod:`ess_patch.demo.scenarios.main_job` (0.5, issue 40): this name stays an alias."""

import sys

from .scenarios import main_job as _moved

sys.modules[__name__] = _moved
