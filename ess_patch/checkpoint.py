"""The calibration in the optimizer's checkpoint: a resumed job keeps its base ratio.

Why: ``calibrate_rollouts`` spends its first K on-policy rollouts unscaled to learn the run's
on-policy rho. A job restarted from its checkpoint would calibrate again, on rollouts that are
no longer the run's first (the policy has moved) and, in a fully asynchronous run, rarely
on-policy. What the host already saves and restores with the policy is its optimizer's state
dict; so the optimizer's state dict carries the calibration under
:data:`~ess_patch.calibration.CHECKPOINT_KEY` and its load restores it: no copying by hand.

The wrappers are wrapt wrappers for the optimizer classes that define ``state_dict`` /
``sharded_state_dict`` (add the key, when this rank holds a calibration) and
``load_state_dict`` (remove the key before the host reads the dict, and restore the
calibration). A plain value in Megatron's sharded state dict is "common" state: saved once
and given to every rank on load, which is right since every rank holds the same calibration
(calibration.py). Without a calibration the state dicts are exactly the host's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["load_state_dict_wrapper", "state_dict_wrapper"]

logger = logging.getLogger(__name__)


def state_dict_wrapper(
    wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict
) -> Any:
    """wrapt wrapper for ``state_dict`` / ``sharded_state_dict``: the host's dict, plus the
    calibration this rank holds (none held: the host's dict unchanged)."""
    from . import calibration  # here: install() (run at start-up) must not import torch

    out = wrapped(*args, **kwargs)
    kept = calibration.saved()
    if kept is not None and isinstance(out, dict):
        out[calibration.CHECKPOINT_KEY] = kept
    return out


def load_state_dict_wrapper(
    wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict
) -> Any:
    """wrapt wrapper for ``load_state_dict(state_dict)``: restore the calibration a checkpoint
    kept, and hand the host its dict without our key (the host's own checks see only theirs).

    Raises:
        ValueError: the key holds something else than a calibration (nothing is loaded)."""
    from . import calibration  # here: install() (run at start-up) must not import torch

    if args:
        state, rest = args[0], args[1:]
    else:
        state, rest = kwargs.pop("state_dict", None), ()
    if isinstance(state, dict) and calibration.CHECKPOINT_KEY in state:
        state = dict(state)
        kept = state.pop(calibration.CHECKPOINT_KEY)
        before = calibration.snapshot()
        calibration.load(kept)
        try:
            return wrapped(state, *rest, **kwargs)
        except BaseException:
            calibration.restore(before)  # the host refused its checkpoint: nothing changes
            raise
    if not args:
        return wrapped(state_dict=state, **kwargs)
    return wrapped(state, *rest, **kwargs)
