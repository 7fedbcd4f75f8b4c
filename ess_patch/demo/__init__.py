"""``ess-patch demo``: fully-async RL of a tiny megatron-core GPTModel, ESS-LR off and on.

Needs the ``demo`` extra (megatron-core, matplotlib, tqdm; tensorboard for event files).
Nothing here is imported by ``import ess_patch``. See :mod:`ess_patch.demo.trainer` for what
one rank does, :mod:`ess_patch.demo.policy` for the model and its bf16 rollout engine,
:mod:`ess_patch.demo.task` for the task and the reward, :mod:`ess_patch.demo.cpu` for the
demo-only shim that lets megatron-core run on a CPU, and :mod:`ess_patch.demo.scenarios` for
the scenarios. ``run``, ``DemoResult`` and ``quick_config`` here are the mixed scenario's
(:mod:`ess_patch.demo.scenarios.mixed`; ``run`` is its ``run_mixed``).

Python use::

    from ess_patch.demo import DemoConfig, run
    result = run(DemoConfig(steps=50), "ess-demo-out/mine")
    print(result.table)

The ranks are forked from a forkserver, which re-imports the caller's main script: call
``run`` from under ``if __name__ == "__main__":`` in a script.
"""

from __future__ import annotations

# the output file names, under their old names here too
from .scenarios.mixed import FIGURE_FILE as FIGURE_FILE
from .scenarios.mixed import RECORDS_FILE as RECORDS_FILE
from .scenarios.mixed import SUMMARY_FILE as SUMMARY_FILE
from .scenarios.mixed import TENSORBOARD_DIR as TENSORBOARD_DIR
from .scenarios.mixed import DemoResult, quick_config
from .scenarios.mixed import run_mixed as run
from .trainer.config import ARMS, DemoConfig

__all__ = ["ARMS", "DemoConfig", "DemoResult", "quick_config", "run"]
