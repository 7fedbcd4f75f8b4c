"""Stub of ``sglang.srt.utils``: ``MultiprocessingSerializer`` is imported by
miles/backends/megatron_utils/sglang.py:20 and fsdp_utils/update_weight_utils.py:18 (weight sync
to the inference engines)."""

from _import_stub import stub_class

MultiprocessingSerializer = stub_class(__name__, "MultiprocessingSerializer")
