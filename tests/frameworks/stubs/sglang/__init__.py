"""Import-time stub package (tests/frameworks/stubs/README.md)."""

# slime v0.2.0 sglang_utils/arguments.py:118 compares it with 0.4.10 (an ep-moe special case)
__version__ = "0.0.0+stub"
