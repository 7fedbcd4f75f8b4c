"""Stub of ``sglang.srt.debug_utils.dumper``: imported by miles/utils/dumper_utils.py:15.

The dumper itself is used only with ``--dumper-enable``. But ``train_one_step`` builds a
``DumperMegatronUtil`` on every step, which parses the (empty by default) per-phase
``--dumper-*`` override lists with ``DumperConfig._kv_pairs_to_dict``: the stub accepts only
an empty list there and raises for anything else.
"""

from typing import Any

from _import_stub import StubUsedError, stub_class, stub_function, stub_object


def _kv_pairs_to_dict(pairs: Any) -> dict:
    if not pairs:
        return {}
    raise StubUsedError(
        f"{__name__}.DumperConfig._kv_pairs_to_dict({pairs!r}) is an import-time stub: "
        "--dumper-* overrides need the real sglang"
    )


DumperConfig = stub_class(
    __name__, "DumperConfig", _kv_pairs_to_dict=staticmethod(_kv_pairs_to_dict)
)
_get_rank = stub_function(__name__, "_get_rank")
dumper = stub_object(__name__, "dumper")
