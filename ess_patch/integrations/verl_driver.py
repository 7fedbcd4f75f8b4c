"""Moved to :mod:`ess_patch.integrations.verl.driver` (0.5, issue 40): this name stays an alias."""

import sys

from .verl import driver as _moved

sys.modules[__name__] = _moved
