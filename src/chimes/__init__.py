"""Chimes: a distributed job scheduler on PostgreSQL."""

__version__ = "0.2.0"
