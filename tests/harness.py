"""Multi-process harness for CPU distributed tests (gloo + real Megatron ``parallel_state``).

Usage, from a test module (``tests/`` is not a package; pytest's default ``prepend`` import
mode puts it on ``sys.path``, so ``harness`` imports by its bare name)::

    import pytest
    import torch
    from harness import layout, run_ranks

    def _sum_over_dp(x):                      # module level: children import it by name
        lay = layout()
        t = torch.tensor([x * (lay.dp_rank + 1)])
        torch.distributed.all_reduce(t, group=lay.dp_group)
        return lay.coords, t.item()

    @pytest.mark.dist
    def test_dp_sum(tmp_path):
        results = run_ranks(_sum_over_dp, dp=2, cp=2, args=(1.0,), tmp_path=tmp_path)
        assert [r[1] for r in results] == [3.0] * 4   # global-rank order

``run_ranks(fn, dp=, cp=, pp=)`` starts ``dp*cp*pp`` fresh processes. Each one joins a gloo
world through a ``FileStore`` in a private run directory, calls the real
``megatron.core.parallel_state.initialize_model_parallel`` (TP=1), runs ``fn(*args, **kwargs)``
and writes its return value (``torch.save``) or its traceback (JSON) to a per-rank file. The
parent joins with one overall bound and returns the results in global-rank order, or raises
:class:`DistTestFailure` naming the root-cause rank, its (dp, cp, pp) coordinates and its own
traceback, preferring a rank whose error is not just a peer's ``Connection closed by peer`` /
gloo timeout. On timeout the stuck ranks dump their Python stacks (``faulthandler`` on
SIGUSR1) before being killed, and the report names them and shows where they were.

The launcher itself (forkserver, per-rank setup, root-cause report) is ``gloo_ranks`` next
to this file (the collectives benchmark uses it too); this module keeps the tests'
API: ``run_ranks`` raises :class:`DistTestFailure` (an ``AssertionError``, so pytest shows it
as a test failure) and ``FAIL_GRACE_S`` can be monkeypatched here.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gloo_ranks as _launch
from gloo_ranks import RankLayout, _pick_root_cause, layout, rank_coords, run_dir

__all__ = [
    "DistTestFailure",
    "RankLayout",
    "_pick_root_cause",
    "layout",
    "rank_coords",
    "run_dir",
    "run_ranks",
]

# Seconds the surviving ranks get to write their own error after the first rank failed.
FAIL_GRACE_S = _launch.FAIL_GRACE_S


class DistTestFailure(AssertionError):
    """A rank raised, died or did not finish in time. The message carries the root cause."""


def run_ranks(
    fn: Callable[..., Any],
    *,
    dp: int = 1,
    cp: int = 1,
    pp: int = 1,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = 60.0,
    tmp_path: Path | str | None = None,
    collective_timeout: float | None = None,
    gloo_groups: bool = False,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``dp*cp*pp`` fresh gloo ranks with Megatron groups set up.

    Returns each rank's return value, in global-rank order. Raises :class:`DistTestFailure`
    if any rank raised, died, or was still running ``timeout`` seconds after the launch; the
    message names the root-cause rank with its (dp, cp, pp) coordinates and its traceback.
    ``tmp_path``: where the run directory goes (pytest's ``tmp_path``; kept for inspection);
    default a temporary directory removed afterwards. ``collective_timeout``: gloo timeout in
    seconds (default ``timeout / 2``). ``gloo_groups``: forwarded as Megatron's
    ``create_gloo_process_groups`` (turn it on for code that asks for
    ``get_data_parallel_group_gloo``).
    """
    directory = None
    if tmp_path is not None:
        Path(tmp_path).mkdir(parents=True, exist_ok=True)
        directory = tempfile.mkdtemp(prefix="run_ranks-", dir=tmp_path)
    try:
        return _launch.launch_ranks(
            fn,
            dp=dp,
            cp=cp,
            pp=pp,
            args=args,
            kwargs=kwargs,
            directory=directory,
            timeout=timeout,
            collective_timeout=collective_timeout,
            fail_grace=FAIL_GRACE_S,
            gloo_groups=gloo_groups,
        )
    except _launch.RankFailure as exc:
        raise DistTestFailure(str(exc)) from None
