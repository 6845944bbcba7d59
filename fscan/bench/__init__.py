"""Benchmarks for fscan: ``python -m fscan.bench`` prints every table in one run."""
