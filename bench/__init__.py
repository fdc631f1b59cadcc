"""Benchmarks for Chimes and the Python schedulers it is compared with: ``python -m bench --help``."""
