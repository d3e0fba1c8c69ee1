"""Benchmarks run against the installed package: `pytest bench --benchmark-only`."""
