"""Stub of ``sglang.srt.utils.patch_torch`` (same importers as ``sglang.srt.utils``)."""

from _import_stub import stub_function

monkey_patch_torch_reductions = stub_function(__name__, "monkey_patch_torch_reductions")
