"""Benchmarks: ratios against the alternatives, measured in the same run (not tests)."""
