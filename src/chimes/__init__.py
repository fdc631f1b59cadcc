"""Chimes: a distributed job scheduler on PostgreSQL."""

__version__ = "0.3.4.dev0"
