"""Benchmarks: run with ``make bench`` (they are never part of the test suite)."""
