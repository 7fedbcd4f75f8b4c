"""Benchmarks of ess-patch: the estimator, its collectives and the patched optimizer step.

Run all of them with ``python -m benchmarks`` (or ``python benchmarks/run.py``) from the
repository root; ``--quick`` for a short run. Not part of the test suite: they print tables
and whether each target of BENCHMARKS.md is met, and never fail a build.
"""
