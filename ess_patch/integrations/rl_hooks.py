"""Moved to :mod:`ess_patch.integrations.miles_slime` (0.5, issue 40): this name stays an alias.

What miles and slime share is ``miles_slime.py``; what every integration may use of it (the
groups, ``Framework`` and the flags' validation, the metrics) is ``framework.py``, re-exported
by ``miles_slime``, so every name once imported from here still is.
"""

import sys

from . import miles_slime as _moved

sys.modules[__name__] = _moved
