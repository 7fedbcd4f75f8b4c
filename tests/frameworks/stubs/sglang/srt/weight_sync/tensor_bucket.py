"""Stub of ``sglang.srt.weight_sync.tensor_bucket`` (same importers as ``sglang.srt.utils``)."""

from _import_stub import stub_class

FlattenedTensorBucket = stub_class(__name__, "FlattenedTensorBucket")
