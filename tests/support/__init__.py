"""Helpers that tests and benchmarks share (neither imports the other)."""
