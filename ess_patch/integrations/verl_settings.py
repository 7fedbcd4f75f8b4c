"""Moved to :mod:`ess_patch.integrations.verl.config` (0.5, issue 40): this name stays an alias."""

import sys

from .verl import config as _moved

sys.modules[__name__] = _moved
