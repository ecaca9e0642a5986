"""Benchmarks: each prints a ratio against a baseline timed in the same run."""
