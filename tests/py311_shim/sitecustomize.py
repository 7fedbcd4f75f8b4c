"""Test-only: Python 3.11 gets ``typing.override`` (new in 3.12), which some megatron-core 0.18+
modules import; megatron-core 0.17-0.19 wheels run on 3.11 otherwise (DESIGN.md section 3).
On ``PYTHONPATH`` only of the subprocesses that run those versions (tests/megatron_versions.py).
"""

import typing

if not hasattr(typing, "override"):
    import typing_extensions

    typing.override = typing_extensions.override
