"""Import-time stub package (tests/frameworks/stubs/README.md)."""
